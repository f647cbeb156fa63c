"""The episodes' environments in a child process: a step that hangs or raises costs that step,
never the run.

Like the reward sandbox (rewards/sandbox.py) the child is forked and talks JSON over a pipe, never
pickle. It is cut off from the network at start (a network namespace of its own where the kernel
allows unprivileged ones, else a seccomp filter on socket(); where neither can be had it refuses
to start unless env.network=allow), gets budgets of memory, processes and CPU (env.memory_mb,
env.max_processes, env.cpu_s), and holds one environment per live episode. A step that raises
becomes an error message to the model; one that does not answer within `env.timeout_s` gets the
child killed and a new one forked. The parent keeps each episode's
earlier messages, so a new child rebuilds an episode it does not hold by replaying them, one call
at a time with its own time limit: the other episodes of the turn go on where they were.
"""

from __future__ import annotations

import ctypes
import json
import logging
import multiprocessing
import os
import signal
import stat
from dataclasses import dataclass

from grpo.environments import Reply, environment_factory

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000


class IsolationError(RuntimeError):
    """The environments' child could not be cut off from the network (env.network=deny)."""


def deny_network() -> str:
    """Cut this (single-threaded) process and everything it starts off the network; how
    ("namespace" or "seccomp"). IsolationError when neither can be had."""
    if unshare_network():
        return "namespace"
    if seccomp_deny_sockets():  # where user namespaces are refused (some containers)
        return "seccomp"
    raise IsolationError("the environments' child cannot be cut off from the network here (no user namespaces, "
                         "no libseccomp): set env.network=allow to run environments with network access")


def unshare_network() -> bool:
    """A user and network namespace of its own: only a loopback that is down, nothing reachable."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        return False
    try:  # the same user inside, so files are created as before (unmapped, creating one fails)
        for name, value in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(value)
    except OSError:
        pass
    return True


NETWORK_FAMILIES = (2, 10, 17, 40)  # AF_INET, AF_INET6, AF_PACKET, AF_VSOCK
SCMP_ACT_ALLOW, SCMP_ACT_ERRNO_EACCES, SCMP_CMP_MASKED_EQ = 0x7FFF0000, 0x00050000 | 13, 7
INT_MASK = 0xFFFFFFFF  # the kernel reads socket()'s family as an int: compare the low 32 bits only


class _ArgCmp(ctypes.Structure):  # libseccomp's struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


def seccomp_deny_sockets() -> bool:
    """A seccomp filter on this process and every process it starts (a subprocess, a C library):
    socket() of an internet, packet or vsock family fails with EACCES, at the system call, below
    Python's `socket` and `_socket`, and io_uring (which makes sockets without socket()) is off.
    False when libseccomp is missing or the filter cannot load."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError:
        return False
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_load.argtypes = lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        return False
    try:
        number = lib.seccomp_syscall_resolve_name(b"socket")
        for family in NETWORK_FAMILIES:
            rule = _ArgCmp(0, SCMP_CMP_MASKED_EQ, INT_MASK, family)
            if lib.seccomp_rule_add_array(ctx, SCMP_ACT_ERRNO_EACCES, number, 1, ctypes.byref(rule)) != 0:
                return False
        uring = lib.seccomp_syscall_resolve_name(b"io_uring_setup")
        if uring >= 0 and lib.seccomp_rule_add_array(ctx, SCMP_ACT_ERRNO_EACCES, uring, 0, None) != 0:
            return False
        return lib.seccomp_load(ctx) == 0
    finally:
        lib.seccomp_release(ctx)


def limit_resources(memory_mb: int, processes: int, cpu_s: int, own_namespace: bool) -> None:
    """Budgets of the child above what it has at the fork (it is a copy of the sampler): address
    space (each thread's stack and arena count too), processes and threads (only in its own user
    namespace, where the kernel counts the child's alone; not enforced for root), CPU seconds over
    its life and of each process it starts; 0 leaves one unlimited. Past them an allocation or fork
    fails in the environment's code (an error message to the model) or the process is killed (a restart)."""
    import resource

    def budget(kind: int, used: int, extra: int) -> None:
        if extra > 0:
            soft, hard = resource.getrlimit(kind)
            value = used + extra if hard == resource.RLIM_INFINITY else min(used + extra, hard)
            resource.setrlimit(kind, (value, hard))

    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    budget(resource.RLIMIT_AS, int(status["VmSize"].split()[0]) * 1024, memory_mb * 2**20)
    if own_namespace:  # outside it the count is every thread of the user on the machine
        budget(resource.RLIMIT_NPROC, int(status["Threads"]), processes)
    budget(resource.RLIMIT_CPU, int(sum(os.times()[:2])) + 1, cpu_s)


def close_inherited_sockets(keep: int) -> None:
    """The sockets the sampler had open at the fork (its connection to the trainer, an engine's):
    closed, so that no environment writes to them."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd != keep and stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)
        except OSError:
            pass  # the listing's own descriptor, already gone


def _serve(conn, parent_end, name: str, args: dict, limits: "Limits") -> None:
    parent_end.close()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a child busy in a hang dies with its parent
    except (OSError, AttributeError):
        pass
    close_inherited_sockets(keep=conn.fileno())
    try:
        how = deny_network() if limits.network == "deny" else "allowed"
        limit_resources(limits.memory_mb, limits.processes, limits.cpu_s, own_namespace=how == "namespace")
    except (IsolationError, OSError, ValueError) as e:
        conn.send_bytes(json.dumps(["refused", str(e)]).encode())
        return
    conn.send_bytes(json.dumps(["ready", how]).encode())
    make = environment_factory(name, args)
    episodes: dict[str, object] = {}
    while True:
        try:
            kind, key, value = json.loads(conn.recv_bytes())
        except EOFError:
            for gone in list(episodes):
                _close(episodes.pop(gone))
            return
        if kind == "forget":
            for gone in value:
                _close(episodes.pop(gone, None))
            continue
        try:
            if kind == "open":  # a new episode, or one this (new) child rebuilds from its messages
                episodes[key] = make(value)
                answer = ["ok", opening_of(episodes[key])]
            else:
                reply = episodes[key].step(value)
                if not isinstance(reply, Reply):
                    raise TypeError(f"step returned a {type(reply).__name__}, not a grpo.environments.Reply")
                answer = ["ok", reply.to_json()]
                answer[1][0] = valid_text(answer[1][0])
        except Exception as e:  # the environment's fault: reported, the episode goes on
            _close(episodes.pop(key, None))  # rebuilt from its messages at its next step
            answer = ["error", f"{type(e).__name__}: {e}"]
        conn.send_bytes(json.dumps(answer).encode())


def opening_of(environment) -> str | None:
    """An environment's opening message (its `opening`), None when it has none or it is empty."""
    opening = getattr(environment, "opening", None)
    if opening is not None and not isinstance(opening, str):
        raise TypeError(f"the environment's opening is a {type(opening).__name__}, not a str")
    return valid_text(opening) or None


def valid_text(text: str | None) -> str | None:
    """Text a tokenizer takes: a lone surrogate (half of a broken character) becomes "?"."""
    return text if text is None else text.encode("utf-8", "replace").decode("utf-8")


def _close(environment) -> None:
    """An episode's environment is done with: its `close()`, if it has one (OpenEnv's servers
    close theirs at a session's end), once; a close that raises is logged, not fatal."""
    close = getattr(environment, "close", None)
    if callable(close):
        try:
            close()
        except Exception as e:
            log.warning("an environment's close() raised %s: %s", type(e).__name__, e)


START_TIMEOUT_S = 30.0
NETWORK_MODES = ("deny", "allow")  # env.network


@dataclass(frozen=True)
class Limits:
    """What the environments' child may use (env.network, env.memory_mb, env.max_processes, env.cpu_s)."""

    network: str = "deny"
    memory_mb: int = 4096
    processes: int = 64
    cpu_s: int = 3600

    @classmethod
    def of(cls, env_cfg) -> "Limits":
        return cls(env_cfg.network, env_cfg.memory_mb, env_cfg.max_processes, env_cfg.cpu_s)


class StepFailed(Exception):
    """An environment call that raised, hung or lost its process."""


class EnvironmentPool:
    """Steps episodes' environments (env.name, env.args) in a child with a time limit per call.

    The parent knows which episodes the child holds. One it does not hold (new, or lost with a
    killed child) is rebuilt first: made from its row, then its earlier messages replayed one call
    at a time, each with its own env.timeout_s, so a rebuild after another episode's hang does
    not run out of time and fail the episodes that did nothing wrong."""

    def __init__(self, name: str, args: dict, timeout_s: float, limits: "Limits | None" = None):
        environment_factory(name, args)  # a bad env.name fails here, in the sampler, in one line
        self.name, self.args, self.timeout_s, self.limits = name, dict(args), timeout_s, limits or Limits()
        self.restarts = 0
        self._context = multiprocessing.get_context("fork")
        self._start()
        log.info("environments run in a child process: network %s", self.isolation)

    def _start(self) -> None:
        self._conn, child = self._context.Pipe()
        self._process = self._context.Process(target=_serve, args=(child, self._conn, self.name, self.args,
                                                                   self.limits), daemon=True, name="environments")
        self._process.start()
        child.close()
        self._held: set[str] = set()  # the episodes this child holds
        if not self._conn.poll(START_TIMEOUT_S):
            self._stop(grace_s=0.0)
            raise IsolationError(f"the environments' child did not start within {START_TIMEOUT_S:g} s")
        status, self.isolation = json.loads(self._conn.recv_bytes())
        if status != "ready":  # fails closed: no environment runs with a network it should not have
            self._process.join()
            raise IsolationError(self.isolation)

    def _restart(self) -> None:
        self._stop(grace_s=0.0)  # hung or dead: nothing to wait for
        self.restarts += 1
        self._start()

    def _call(self, kind: str, key: str, value):
        """One request to the child within env.timeout_s; StepFailed (the child replaced where it hung or died)."""
        try:
            self._conn.send_bytes(json.dumps([kind, key, value]).encode())
        except OSError as e:  # a pipe to a child that just died
            self._process.kill()
            raise StepFailed(f"the environment process could not take the call ({e})") from None
        if not self._conn.poll(self.timeout_s):
            self._restart()
            raise StepFailed(f"no reply within env.timeout_s={self.timeout_s:g} s")
        try:
            status, answer = json.loads(self._conn.recv_bytes())
        except EOFError:
            self._restart()
            raise StepFailed("the environment process died") from None
        if status != "ok":
            self._held.discard(key)
            raise StepFailed(answer)
        return answer

    def open(self, key: str, row: dict) -> tuple[str | None, str | None]:
        """Start episode `key` from its dataset row: (its opening message or None, the failure or None)."""
        try:
            return self._open(key, row), None
        except (StepFailed, IsolationError) as e:
            return None, str(e)

    def _open(self, key: str, row: dict) -> str | None:
        if not self._process.is_alive():  # died between calls: it holds no episode any more
            self._restart()
        opening = self._call("open", key, row)
        self._held.add(key)
        return opening

    def step(self, key: str, row: dict, history: list[str], message: str) -> tuple[Reply, str | None]:
        """The environment's reply to `message` in episode `key` (its earlier messages: `history`);
        on a failure, (an error message for the model, the failure)."""
        try:
            if not self._process.is_alive():  # died between calls: it holds no episode any more
                self._restart()
            if key not in self._held:
                self._open(key, row)
                for earlier in history:
                    self._call("step", key, earlier)
            return Reply.from_json(self._call("step", key, message)), None
        except (StepFailed, IsolationError) as e:  # IsolationError: a replacement child that could not start
            failure = str(e)
        return Reply(text=f"error: the environment failed: {failure}"), failure

    def forget(self, keys: list[str]) -> None:
        """Drop finished episodes' environments."""
        held = [key for key in keys if key in self._held]
        self._held.difference_update(held)
        if held and self._process.is_alive():
            try:
                self._conn.send_bytes(json.dumps(["forget", "", held]).encode())
            except OSError:
                pass  # the child is gone, and its environments with it

    def close(self) -> None:
        """The child closes the environments it holds when the pipe closes (given a second), then goes."""
        self._stop(grace_s=1.0)

    def _stop(self, grace_s: float) -> None:
        self._conn.close()
        if grace_s:
            self._process.join(timeout=grace_s)
        self._process.kill()
        self._process.join()
