"""What an environment's child can reach: no network (namespaces or seccomp), a memory budget, and a
start where the tools' jail cannot start."""


import json
import subprocess
import sys

import pytest
from conftest import REPO
from episode_helpers import ENVS

from grpo.environments.pool import EnvironmentPool


def test_environments_have_no_network():
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    pool = EnvironmentPool(f"{ENVS}:NetworkProbe", {}, timeout_s=5.0)
    try:
        reply, failure = pool.step("a", {}, [], str(server.getsockname()[1]))
        assert failure is None and reply.text != "connected" and reply.text.startswith("OSError")
    finally:
        pool.close()
        server.close()


def listening_port():
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server, server.getsockname()[1]


def refused_namespaces(environment: str, message: str, *flags: str) -> list:
    """tests/refused_namespaces.py: the environment stepped once where new namespaces are refused."""
    out = subprocess.run([sys.executable, str(REPO / "tests" / "refused_namespaces.py"), environment, message, *flags],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("isolation", ["namespace", "seccomp"])
def test_neither_the_c_socket_module_nor_a_subprocess_reaches_the_network(isolation):
    """The namespace, and the seccomp filter where user namespaces are refused (here by a seccomp
    filter on the sampler, as a container's profile refuses them): both act below Python, on every
    process the child starts."""
    server, port = listening_port()
    try:
        if isolation == "seccomp":
            how, text, failure = refused_namespaces(f"{ENVS}:SocketProbe", str(port))
        else:
            pool = EnvironmentPool(f"{ENVS}:SocketProbe", {}, timeout_s=60.0)
            try:
                (reply, failure), how = pool.step("a", {}, [], str(port)), pool.isolation
                text = reply.text
            finally:
                pool.close()
        assert how == isolation
        assert failure is None and "connected" not in text and text.endswith(", subprocess refused")
        if isolation == "seccomp":  # the filter reads the family as the kernel does: its low 32 bits
            assert text == "_socket PermissionError, raw socket refused, subprocess refused"
        else:  # sockets can be made in the namespace; nothing is reachable from it
            assert text.startswith("_socket OSError")
    finally:
        server.close()


def test_without_isolation_the_child_refuses_to_start_unless_the_network_is_allowed():
    from grpo.settings import EnvConfig

    # neither namespaces nor seccomp filters to be had (refused by a filter on the sampler)
    assert refused_namespaces(f"{ENVS}:Counter", "1", "--no-seccomp") == [
        "refused", "the environments' child cannot be cut off from the network here (no user namespaces, no "
                   "libseccomp): set env.network=allow to run environments with network access"]
    server, port = listening_port()
    pool = EnvironmentPool(f"{ENVS}:NetworkProbe", {}, 5.0, EnvConfig(network="allow"))
    try:
        assert pool.isolation == "allowed" and pool.step("a", {}, [], str(port))[0].text == "connected"
    finally:
        pool.close()
        server.close()


def test_the_child_has_a_memory_budget():
    from grpo.settings import EnvConfig

    pool = EnvironmentPool(f"{ENVS}:Allocates", {}, 30.0, EnvConfig(memory_mb=256))
    try:
        assert pool.step("a", {}, [], "64")[0].text == "allocated 64 MB"
        reply, failure = pool.step("b", {}, [], "1024")
        # the environment's error, the child lives on
        assert failure == "MemoryError:  (tests/scripted_envs.py:103, in step)" and pool.restarts == 0
    finally:
        pool.close()

def test_an_environment_that_runs_no_tool_starts_where_the_tool_jail_cannot_and_run_tool_says_why():
    """Where the jail cannot start (here: no seccomp filter can be loaded), an environment that never
    calls run_tool still runs; the log says that calls would fail, and why."""
    out = subprocess.run([sys.executable, str(REPO / "tests" / "refused_namespaces.py"), f"{ENVS}:Counter", "1",
                          "--no-seccomp", "--network-allowed"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    how, text, failure = json.loads(out.stdout.splitlines()[-1])
    assert (how, failure) == ("allowed", None) and text
    assert "tool calls run in a jail each: none: it could not start (the tools jail could not start" in out.stderr
