"""An environment stepped once by a sampler on a machine that refuses new namespaces (as a container's
seccomp profile does: Docker's default refuses unshare), and with --no-seccomp, seccomp filters too: the
environments' child, a Python started by exec, inherits what the kernel refuses this process.

argv: environment (path:Class), message[, --no-seccomp][, --network-allowed]. Prints one JSON line:
[isolation, reply text, failure], or ["refused", the error]."""

import errno
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo.common.kernel_filters import seccomp_deny  # noqa: E402
from grpo.environments.pool import (  # noqa: E402
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWUSER,
    EnvironmentPool,
    IsolationError,
)
from grpo.settings import EnvConfig  # noqa: E402

PR_SET_SECCOMP = 22

if __name__ == "__main__":
    environment, message = sys.argv[1], sys.argv[2]
    rules = [("unshare", errno.EPERM, {}), ("clone3", errno.ENOSYS, {})] + [
        ("clone", errno.EPERM, {0: (flag, flag)}) for flag in (CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWNS)]
    if "--no-seccomp" in sys.argv:  # a filter refuses new filters after itself
        rules += [("seccomp", errno.EINVAL, {}), ("prctl", errno.EINVAL, {0: PR_SET_SECCOMP})]
    assert seccomp_deny(rules), "this test needs libseccomp"
    logging.basicConfig(level=logging.INFO)
    try:
        pool = EnvironmentPool(environment, {}, 60.0,
                               EnvConfig(network="allow" if "--network-allowed" in sys.argv else "deny"))
    except IsolationError as e:
        print(json.dumps(["refused", str(e)]), flush=True)
        sys.exit(0)
    try:
        reply, failure = pool.step("a", {}, [], message)
        print(json.dumps([pool.isolation, reply.text, failure]), flush=True)
    finally:
        pool.close()
