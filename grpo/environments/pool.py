"""The episodes' environments in a child process: a step that hangs or raises costs that step,
never the run.

The child is the reward sandbox's kind (grpo/child.py: forked, JSON over a pipe, never pickle, a
time limit per call, replaced when it hangs or dies). It is cut off from the network at start (a network namespace of its own where the kernel
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
import logging
import os
from dataclasses import dataclass

from grpo.child import NO_ANSWER, Child, ChildFailed, ChildRefused, close_inherited_sockets
from grpo.environments import Reply, environment_factory

log = logging.getLogger(__name__)
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


class _Episodes:
    """The child's handler: one environment per live episode, by key."""

    def __init__(self, make):
        self.make, self.episodes = make, {}

    def __call__(self, request):
        kind, key, value = request
        if kind == "forget":
            for gone in value:
                _close(self.episodes.pop(gone, None))
            return NO_ANSWER
        try:
            if kind == "open":  # a new episode, or one this (new) child rebuilds from its messages
                self.episodes[key] = self.make(value)
                return opening_of(self.episodes[key])
            reply = self.episodes[key].step(value)
            if not isinstance(reply, Reply):
                raise TypeError(f"step returned a {type(reply).__name__}, not a grpo.environments.Reply")
            answer = reply.to_json()
            answer[0] = [valid_text(t) for t in answer[0]] if isinstance(answer[0], list) else valid_text(answer[0])
            return answer
        except Exception:  # the environment's fault: reported, the episode is rebuilt from its messages
            _close(self.episodes.pop(key, None))
            raise

    def close(self) -> None:
        for gone in list(self.episodes):
            _close(self.episodes.pop(gone))


def _isolated_episodes(name: str, args: dict, limits: "Limits"):
    """The child's setup: cut off from the network, within its budgets, holding no socket of the
    sampler's; then the handler of its episodes. ChildRefused where it cannot be isolated."""
    def setup(pipe_fd: int):
        close_inherited_sockets(keep=pipe_fd)
        try:
            how = deny_network() if limits.network == "deny" else "allowed"
            limit_resources(limits.memory_mb, limits.processes, limits.cpu_s, own_namespace=how == "namespace")
        except (IsolationError, OSError, ValueError) as e:
            raise ChildRefused(str(e)) from None
        return _Episodes(environment_factory(name, args)), how
    return setup


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


def failed_reply(failure: str) -> Reply:
    """What the model reads after an environment call that failed (env/env_errors counts it)."""
    return Reply(text=f"error: the environment failed: {failure}")


class StepFailed(ChildFailed):
    """An environment call that raised (`where`: the line of the environment's code), hung or lost its process."""


def described(error: Exception) -> str:
    """A failed call as the episode records it: the error, and where in the environment's code it was
    raised (the model reads the error alone: failed_reply)."""
    where = getattr(error, "where", None)
    return f"{error} ({where})" if where else str(error)


class EnvironmentPool:
    """Steps episodes' environments (env.name, env.args) in a child with a time limit per call.

    The parent knows which episodes the child holds. One it does not hold (new, or lost with a
    killed child) is rebuilt first: made from its row, then its earlier messages replayed one call
    at a time, each with its own env.timeout_s, so a rebuild after another episode's hang does
    not run out of time and fail the episodes that did nothing wrong."""

    def __init__(self, name: str, args: dict, timeout_s: float, limits: "Limits | None" = None):
        environment_factory(name, args)  # a bad env.name fails here, in the sampler, in one line
        self.timeout_s, self.limits = timeout_s, limits or Limits()
        try:  # fails closed: no environment runs with a network it should not have
            self._child = Child("environments", _isolated_episodes(name, dict(args), self.limits))
        except ChildRefused as e:
            raise IsolationError(str(e)) from None
        self.isolation = self._child.info
        self._held: set[str] = set()  # the episodes the child holds (read through `_holding`)
        self._incarnation = 0  # the child's restarts when `_held` was filled
        log.info("environments run in a child process: network %s", self.isolation)

    @property
    def restarts(self) -> int:
        return self._child.restarts

    def _call(self, kind: str, key: str, value):
        """One request to the child within env.timeout_s; StepFailed (the child replaced where it
        hung or died: it then holds no episode)."""
        try:
            return self._child.call([kind, key, value], self.timeout_s,
                                    f"no reply within env.timeout_s={self.timeout_s:g} s")
        except ChildFailed as e:
            self._holding().discard(key)  # an environment that raised was dropped by the child
            raise StepFailed(str(e), e.where) from None
        except ChildRefused as e:  # a replacement child that could not start
            raise IsolationError(str(e)) from None

    def open(self, key: str, row: dict) -> tuple[str | None, str | None]:
        """Start episode `key` from its dataset row: (its opening message or None, the failure or None)."""
        try:
            return self._open(key, row), None
        except (StepFailed, IsolationError) as e:
            return None, described(e)

    def _open(self, key: str, row: dict) -> str | None:
        self._restart_if_dead()
        opening = self._call("open", key, row)
        self._holding().add(key)
        return opening

    def _restart_if_dead(self) -> None:
        if not self._child.alive():  # died between calls: it holds no episode any more
            try:
                self._child.restart()
            except ChildRefused as e:
                raise IsolationError(str(e)) from None

    def _holding(self) -> set[str]:
        """The episodes the child holds: none once it was replaced (a hang, a death, a broken pipe)."""
        if self._child.restarts != self._incarnation:
            self._held, self._incarnation = set(), self._child.restarts
        return self._held

    def step(self, key: str, row: dict, history: list[str], message: str) -> tuple[Reply, str | None]:
        """The environment's reply to `message` in episode `key` (its earlier messages: `history`);
        on a failure, (an error message for the model, the failure and where it was raised)."""
        try:
            self._restart_if_dead()
            if key not in self._holding():
                self._open(key, row)
                for earlier in history:
                    self._call("step", key, earlier)
            return Reply.from_json(self._call("step", key, message)), None
        except (StepFailed, IsolationError) as e:  # IsolationError: a replacement child that could not start
            return failed_reply(str(e)), described(e)

    def forget(self, keys: list[str]) -> None:
        """Drop finished episodes' environments."""
        held = [key for key in keys if key in self._holding()]
        self._held.difference_update(held)
        if held:
            self._child.tell(["forget", "", held])  # lost with a child that is gone, and its environments with it

    def close(self) -> None:
        """The child closes the environments it holds when the pipe closes (given a second), then goes."""
        self._child.close(grace_s=1.0)
