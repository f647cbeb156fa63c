"""The episodes' environments in a child process: a step that hangs or raises costs that step,
never the run.

The child is grpo/common/child.py's kind (a Python started by exec, which never held the data, the model
or a variable outside the allow-list; JSON over a pipe, never pickle, a
time limit per call, replaced when it hangs or dies, a session of its own ended as one, an
allow-list of environment variables: PATH, HOME, LANG, LC_*, its own TMPDIR, env.pass_env). It is
cut off from the network at start (a network namespace of its own where the kernel allows
unprivileged ones, else a seccomp filter on socket(); where neither can be had it refuses to start
unless env.network=allow), confined (`confine`: no Unix socket of the host, no signal or
ptrace out of its own processes, the other processes' environments hidden where it has its own
namespaces), gets budgets of memory, processes and CPU (env.memory_mb, env.max_processes,
env.cpu_s), and holds one environment per live episode. docs/environments.md, "What the sandbox
allows", has what it can and cannot do. A step that raises
becomes an error message to the model; one that does not answer within `env.timeout_s` gets the
child killed and a new one forked. The parent keeps each episode's
earlier messages, so a new child rebuilds an episode it does not hold by replaying them, one call
at a time with its own time limit: the other episodes of the turn go on where they were. Each
replayed reply is checked against a digest of what the episode was shown (`shown_digest`); one
that differs (an environment that is not deterministic given its seed and messages) ends that
episode as failed (ReplayMismatch), never shows it another world.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import hashlib
import json
import logging
import os

from grpo.common.child import NO_ANSWER, Child, ChildFailed, ChildRefused, close_inherited_sockets
from grpo.common.jail import jail_description
from grpo.common.jail_rules import ancestors, signal_rules
from grpo.common.kernel_filters import landlock_scope, seccomp_deny
from grpo.environments import Reply, cut, environment_factory
from grpo.settings import EnvConfig

log = logging.getLogger(__name__)
CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWNS = 0x10000000, 0x40000000, 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000


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
    """A user, network and mount namespace of its own: only a loopback that is down, nothing
    reachable (abstract Unix sockets, which belong to a network namespace, included); in its mount
    namespace the other processes' environment variables are hidden (hide_other_environments)."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS) != 0:
        return False
    try:  # the same user inside, so files are created as before (unmapped, creating one fails)
        for name, value in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(value)
    except OSError:
        pass
    return True


NETWORK_FAMILIES = (2, 10, 17, 40)  # AF_INET, AF_INET6, AF_PACKET, AF_VSOCK
AF_UNIX = 1
SOCK_DGRAM, SOCK_RAW, SOCK_TYPE_MASK = 2, 3, 0xF  # socket types (a Unix SOCK_RAW is a datagram one); SOCK_CLOEXEC
#                                                  and SOCK_NONBLOCK are higher bits of the same argument


def seccomp_deny_sockets() -> bool:
    """A seccomp filter on this process and every process it starts (a subprocess, a C library):
    socket() of an internet, packet or vsock family fails with EACCES, at the system call, below
    Python's `socket` and `_socket`, and io_uring (which makes sockets without socket()) is off.
    False when libseccomp is missing or the filter cannot load."""
    return seccomp_deny([("socket", errno.EACCES, {0: family}) for family in NETWORK_FAMILIES]
                        + [("io_uring_setup", errno.EACCES, {})])


def hide_other_environments() -> int:
    """In this process's own mount namespace (unshare_network), /dev/null over the environ file of
    every other process and thread running now (/proc/<pid>/environ: the variables a process was
    started with, the sampler's API keys among them), for it and all it starts; how many."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:  # nothing of it reaches the sampler's mounts
        return 0
    hidden, own = 0, str(os.getpid())
    for pid in (p for p in os.listdir("/proc") if p.isdigit() and p != own):
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # gone
        for path in {f"/proc/{pid}/environ", *(f"/proc/{pid}/task/{t}/environ" for t in tasks),
                     *(f"/proc/{t}/environ" for t in tasks)}:  # a thread's id reads its process's too
            hidden += libc.mount(b"/dev/null", path.encode(), None, MS_BIND, None) == 0
    return hidden


# what no process of the child may do, whatever else confines it: reach a Unix socket (a host
# service's, the sampler's, the trainer's; a stream socketpair(), which the pipe to the sampler and a
# tool's own multiprocessing use, stays: it cannot connect elsewhere; a datagram one could send to a
# path, and is refused), inspect or write another process's memory, or undo the mounts
# that hide the other processes' environments (a namespace, a mount; clone3 gets ENOSYS, which
# makes the C library fall back to clone(), whose flags a filter can read)
CONFINED_CALLS = ([("socket", errno.EACCES, {0: AF_UNIX}), ("io_uring_setup", errno.EACCES, {}),
                   *[("socketpair", errno.EACCES, {0: AF_UNIX, 1: (SOCK_TYPE_MASK, kind)})
                     for kind in (SOCK_DGRAM, SOCK_RAW)],
                   ("clone3", errno.ENOSYS, {})]
                  + [(call, errno.EPERM, {}) for call in ("ptrace", "process_vm_readv", "process_vm_writev",
                                                          "pidfd_getfd", "mount", "umount2", "unshare", "setns")]
                  + [("clone", errno.EPERM, {0: (flag, flag)}) for flag in (CLONE_NEWUSER, CLONE_NEWNS)])


def confine() -> dict:
    """The child's confinement beyond the network: a Landlock domain (landlock_scope: signals and
    abstract Unix sockets scoped to the child's own processes from Linux 6.12, no ptrace out of it),
    and a seccomp filter (CONFINED_CALLS; where Landlock cannot scope signals, signal_rules for the
    keeper, the sampler and their parents). What applied, for the log and the pool's `confinement`."""
    abi = landlock_scope()
    signals = "landlock" if abi >= 6 else "seccomp"
    filtered = seccomp_deny(CONFINED_CALLS + (signal_rules(ancestors()) if signals == "seccomp" else []))
    return {"landlock_abi": abi, "seccomp": filtered,
            "signals": signals if signals == "landlock" or filtered else "not confined"}


def limit_resources(memory_mb: int, processes: int, cpu_s: int, own_namespace: bool) -> None:
    """Budgets of the child above what it has at its start (a Python with its modules imported): address
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


def isolated_episodes(name: str, args: dict, limits: dict, timeout_s: float, pipe_fd: int):
    """The child's setup (a Python started by exec: it holds nothing of the sampler's, not the data;
    `limits`: the env section as a dict):
    cut off from the network, the other processes' environments hidden (in its namespace), within its
    budgets (env.network, env.memory_mb, env.max_processes, env.cpu_s), holding no socket of the
    sampler's, confined (confine); then the handler of its episodes. ChildRefused where it cannot be
    isolated. Its info: [how the network is cut off, what confines it]."""
    close_inherited_sockets(keep=pipe_fd)
    limits = EnvConfig(**limits)
    # the jail of tools (and of any environment's run_tool), started before this child confines
    # itself: it makes namespaces of its own
    from grpo.environments.tools import start_tool_jail

    try:
        jail_info = start_tool_jail(list(args.get("tools", [])) if name == "tools" else [], limits, timeout_s).info
    except ChildRefused as e:  # the tool environment cannot run without it; another one only if it calls run_tool
        if name == "tools":
            raise
        jail_info = {"refused": str(e)}
    try:
        how = deny_network() if limits.network == "deny" else "allowed"
        hidden = hide_other_environments() if how == "namespace" else 0
        limit_resources(limits.memory_mb, limits.max_processes, limits.cpu_s, own_namespace=how == "namespace")
    except (IsolationError, OSError, ValueError) as e:
        raise ChildRefused(str(e)) from None
    make = environment_factory(name, args)
    return _Episodes(make), [how, {**confine(), "environments_hidden": hidden > 0, "tool_jail": jail_info}]


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




def failed_reply(failure: str) -> Reply:
    """What the model reads after an environment call that failed (env/env_errors counts it)."""
    return Reply(text=cut(f"error: the environment failed: {failure}"))


class StepFailed(ChildFailed):
    """An environment call that raised (`where`: the line of the environment's code), hung or lost its process."""


def described(error: Exception) -> str:
    """A failed call as the episode records it: the error, and where in the environment's code it was
    raised (the model reads the error alone: failed_reply)."""
    where = getattr(error, "where", None)
    return f"{error} ({where})" if where else str(error)


class ReplayMismatch(Exception):
    """A rebuilt episode's environment answered a replayed message (or opened) otherwise than the
    episode was shown: the episode cannot go on in the world it saw. Its environment is dropped."""


def shown_digest(shown: Reply | str | None) -> str:
    """A digest of what an episode was shown: a reply (its text, role, reward, done, counts) or its
    opening message (None: it had none). A rebuild's replay is checked against it."""
    value = shown.to_json() if isinstance(shown, Reply) else shown
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def check_replayed(shown: list[str | None] | None, index: int, replayed: Reply | str | None) -> None:
    """ReplayMismatch where a rebuild's `replayed` value (index 0: the opening its environment made; n:
    the reply to message n) differs from what was recorded (`shown`: digests; None where none was)."""
    if shown is None or index >= len(shown) or shown[index] is None or shown_digest(replayed) == shown[index]:
        return
    what = "opened with another message than it first did" if index == 0 else \
        f"replied to message {index} otherwise than the episode was shown"
    raise ReplayMismatch(f"its environment, rebuilt after it was lost, {what}: the environment is not "
                         "deterministic given its seed and messages (docs/environments.md)")


class Replays:
    """The rebuilds of lost episodes a pool made, and how their replays went (env/ metrics): episodes
    rebuilt, earlier messages replayed on them, rebuilds whose opening or a replayed reply differed."""

    # what rebuilding episodes cost over the pool's life (counted per pool: instance attributes once
    # counted; the runner counts each call's share: env/rebuilds, env/replayed_steps, env/replay_mismatches)
    rebuilds = replayed_steps = replay_mismatches = 0

    def replay(self, shown: list[str | None] | None, opening, history: list[str], step, forget) -> None:
        """A rebuilt episode's `opening`, then its earlier messages `history` through `step(message) ->
        reply`, each checked against `shown` (check_replayed); on a mismatch `forget()` drops it and
        ReplayMismatch is raised."""
        self.rebuilds += 1
        try:
            check_replayed(shown, 0, opening)
            for n, earlier in enumerate(history, start=1):
                replayed = step(earlier)
                self.replayed_steps += 1
                check_replayed(shown, n, replayed)
        except ReplayMismatch:
            self.replay_mismatches += 1
            forget()
            raise


class EnvironmentPool(Replays):
    """Steps episodes' environments (env.name, env.args) in a child with a time limit per call.

    The parent knows which episodes the child holds. One it does not hold (new, or lost with a
    killed child) is rebuilt first: made from its row, then its earlier messages replayed one call
    at a time, each with its own env.timeout_s, so a rebuild after another episode's hang does
    not run out of time and fail the episodes that did nothing wrong. Each replayed reply is
    checked against what the episode was shown (ReplayMismatch when it differs)."""

    def __init__(self, name: str, args: dict, timeout_s: float, limits: EnvConfig | None = None, announce: bool = True):
        """`limits`: the env section, whose budgets and env.pass_env the child gets (its defaults: none given)."""
        environment_factory(name, args)  # a bad env.name fails here, in the sampler, in one line
        self.timeout_s, self.limits = timeout_s, limits or EnvConfig()
        try:  # fails closed: no environment runs with a network it should not have
            self._child = Child("environments", ("grpo.environments.pool:isolated_episodes",
                                                 [name, dict(args), dataclasses.asdict(self.limits), timeout_s]),
                                pass_env=tuple(self.limits.pass_env), clean=True)
        except ChildRefused as e:
            raise IsolationError(str(e)) from None
        self.isolation, self.confinement = self._child.info  # the network's ("namespace", ...), and the rest's
        self._held: set[str] = set()  # the episodes the child holds (read through `_holding`)
        self._incarnation = 0  # the child's restarts when `_held` was filled
        if not announce:  # another lane of the same environment (grpo/environments/lanes.py) said it
            return
        log.info("environments run in a child process: network %s, signals %s, Landlock ABI %d, seccomp %s, other "
                 "processes' environments %s", self.isolation, self.confinement["signals"],
                 self.confinement["landlock_abi"], "on" if self.confinement["seccomp"] else "off",
                 "hidden" if self.confinement["environments_hidden"] else "readable")
        log.info("tool calls run in a jail each: %s", jail_description(self.confinement["tool_jail"]))
        if not self.confinement["seccomp"]:
            log.warning("no libseccomp here: the environments' child can reach the host's Unix sockets and its "
                        "processes can leave its session (docs/environments.md: What the sandbox allows)")

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

    def step(self, key: str, row: dict, history: list[str], message: str,
             shown: list[str | None] | None = None) -> tuple[Reply, str | None]:
        """The environment's reply to `message` in episode `key` (its earlier messages: `history`);
        on a failure, (an error message for the model, the failure and where it was raised).
        `shown`: the digests (shown_digest) of what the episode was shown, its opening then the reply
        to each message of `history`; a rebuild that replays otherwise raises ReplayMismatch (None:
        the replay is not checked)."""
        try:
            self._restart_if_dead()
            if key not in self._holding():
                self._rebuild(key, row, history, shown)
            return Reply.from_json(self._call("step", key, message)), None
        except (StepFailed, IsolationError) as e:  # IsolationError: a replacement child that could not start
            return failed_reply(str(e)), described(e)

    def _rebuild(self, key: str, row: dict, history: list[str], shown: list[str | None] | None) -> None:
        """Episode `key` made from its row, its earlier messages replayed one call at a time, each
        reply checked against what the episode was shown; ReplayMismatch (the environment dropped)."""
        self.replay(shown, self._open(key, row), history,
                    lambda message: Reply.from_json(self._call("step", key, message)),
                    lambda: self.forget([key]))

    def forget(self, keys: list[str]) -> None:
        """Drop finished episodes' environments."""
        held = [key for key in keys if key in self._holding()]
        self._held.difference_update(held)
        if held:
            self._child.tell(["forget", "", held])  # lost with a child that is gone, and its environments with it

    def close(self) -> None:
        """The child closes the environments it holds when the pipe closes (given a second), then goes."""
        self._child.close(grace_s=1.0)
