"""The jail's warden (grpo/common/jail.py has the picture and the owner's side): a Python started by exec
that imports the functions it serves once and forks a jailed process for each call.

Per call: a folder of its own (the only one it may write, with the limits' `writable`), a cgroup
(grpo/common/jail_budget.py), then in the child a session of its own, rlimits, namespaces (user, mount,
PID, IPC and, unless allowed, network), no capabilities, a Landlock domain made for that call and
the seccomp filter compiled once (grpo/common/jail_rules.py). The call's stdout and stderr go to a file
beside its folder (opened by the warden, written through the descriptor: the call cannot open it by name), whose
first lines the warden copies to its own stderr marked as the call's. Every
descriptor but its answer pipe is closed. After the answer (or the time limit, or a budget) every
process the call started is killed, adopted orphans included (the warden is a subreaper); the
answer is sent before its folder is removed.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from grpo.common import jail_relay
from grpo.common.child import ChildRefused, _replace_environment, end_session, raised_at
from grpo.common.jail import HEADER, JAILED, MAX_ANSWER_BYTES, JailLimits, read_frame, write_frame
from grpo.common.kernel_filters import load_seccomp_program

EXIT_GRACE_S = 0.05  # how long a call that answered has to exit before its tree is killed
TICK_S = 0.02  # how often the warden looks at a running call's budgets
SHOWN_OUTPUT_BYTES = 4000  # of what a call printed, copied to the log
REQUEST_LIMIT = 2**30  # the owner's requests (a batched reward's whole batch): ours, not the model's
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def _prctl(option: int, value: int) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(option, value)


@dataclass
class Confinement:
    """What every call of a warden gets: the limits, the folder its calls' folders are made in, the
    folders it may read (the system's, the interpreter's, the project's, the served modules'), the
    compiled seccomp filter, and the warden's descriptors."""

    limits: JailLimits
    folder: str
    readable: list[str]
    seccomp: bytes | None
    keep: tuple[int, ...]


def confinement(limits: JailLimits, folder: str, keep: tuple[int, ...]) -> Confinement:
    from grpo.common import jail_rules as rules
    from grpo.common.kernel_filters import landlock_abi

    # where Landlock cannot scope signals and the call gets no PID namespace: none to the warden and above
    protect = [] if landlock_abi() >= 6 else rules.signal_rules([(os.getpid(), os.getpgid(0)), *rules.ancestors()])
    readable = [*rules.readable_folders(limits.network), *limits.readable]
    return Confinement(limits, folder, readable, rules.jail_filter(limits.network, protect, limits.connect_port > 0),
                       keep)


def serve(requests: int, answers: int, owner: int) -> None:
    """The loop: the first frame names the resolver, what to import, the limits and the folder;
    then each frame is a call. Ends when the owner closes its pipe or dies."""
    from grpo.common.imports import import_object

    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # a call's orphans come here, where they are ended with it
    if os.getppid() != owner:
        return
    setup = read_frame(requests, limit=REQUEST_LIMIT)
    limits = JailLimits(**{**setup["limits"], "writable": tuple(setup["limits"]["writable"]),
                           "readable": tuple(setup["limits"]["readable"])})
    jail = confinement(limits, setup["folder"], (requests, answers))
    try:
        resolve = import_object(setup["resolver"], "the jail's resolver")
        functions = {target: resolve(target) for target in setup["targets"]}
        jail.readable += served_files(functions.values())
        info = describe_jail(jail)
    except Exception as e:
        write_frame(answers, ["refused", f"{type(e).__name__}: {e}"])
        return
    write_frame(answers, ["ready", info])
    while True:
        try:
            target, arguments, timeout_s = read_frame(requests, limit=REQUEST_LIMIT)
        except EOFError:
            return
        try:
            if target not in functions:
                functions[target] = resolve(target)
                jail.readable += served_files([functions[target]])
        except Exception as e:
            write_frame(answers, ["error", f"{type(e).__name__}: {e}", raised_at(e)])
            continue
        _prepare(functions[target], arguments)
        answer, clean_up = run_call(functions[target], arguments, timeout_s, jail)
        write_frame(answers, answer)
        clean_up()  # after the answer: a folder of many files takes a while


def served_files(functions) -> list[str]:
    """What a call may read of the user's code: each served function's module file, or its
    package's folder (the modules it imports lazily); not the folder a single file sits in."""
    import inspect

    found = []
    for fn in functions:
        fn = inspect.unwrap(fn)  # the user's function under its resolver's wrapper (`__wrapped__`)
        module = sys.modules.get(getattr(fn, "__module__", ""), None)
        path = getattr(module, "__file__", None)
        if path:
            found.append(str(Path(path).parent) if Path(path).name == "__init__.py" else path)
    return found


def _prepare(fn, arguments: list) -> None:
    """A function's `prepare(*arguments)`, where it has one (rewards/sandbox.py: a built-in's caches,
    built here before the fork from the row, kept for the later calls); a failure is the call's to
    report, so it is left for the call to meet."""
    prepare = getattr(fn, "prepare", None)
    if prepare is not None:
        try:
            prepare(*arguments)
        except Exception:
            pass


def describe_jail(jail: Confinement) -> dict:
    """What a call here gets (probed in a throw-away call), for the owner's log and the tests."""
    from grpo.common.jail_budget import CallBudget

    probe, clean_up = run_call(lambda: None, [], 30.0, jail)
    clean_up()
    if probe[0] != "ok":
        raise ChildRefused(f"a call cannot be jailed here: {probe[1]}")
    budget = CallBudget(jail.limits.memory_mb, jail.limits.max_processes)
    budget.close()
    return {**probe[2], "budgets": budget.kind}


def run_call(fn, arguments: list, timeout_s: float, jail: Confinement):
    """fn(*arguments) in a jailed process of its own: (the answer frame: ["ok", value, what confined
    it], ["error", what, where], ["timeout"], or ["error", what went past a budget]; what removes
    its folder and cgroups). Every process of the call is ended before it returns."""
    import tempfile

    from grpo.common import jail_rules as rules
    from grpo.common.jail_budget import CallBudget

    folder = tempfile.mkdtemp(dir=jail.folder)
    # what it prints goes to a file beside its folder, opened here: the call writes it through the descriptor and
    # cannot open it by name, so a process it starts cannot read what the call printed (a key in a logged URL)
    made, output_path = tempfile.mkstemp(dir=jail.folder, suffix=OUTPUT)
    os.close(made)
    output = os.open(output_path, os.O_WRONLY | os.O_APPEND)  # appending: a call that truncates it writes from 0
    ruleset, abi = rules.file_rules([folder, *jail.limits.writable], jail.readable, jail.limits.network,
                                    jail.limits.connect_port)
    budget = CallBudget(jail.limits.memory_mb, jail.limits.max_processes)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # never returns
        _jailed(fn, arguments, jail, folder, (ruleset, abi), budget, write_end, output)
    for fd in (write_end, output, *([ruleset] if ruleset >= 0 else [])):
        os.close(fd)
    try:
        answer = _await(read_end, pid, time.monotonic() + timeout_s, budget)
    finally:
        os.close(read_end)
        _end_call(pid)
    _show_output(Path(output_path))
    Path(output_path).unlink(missing_ok=True)

    def clean_up() -> None:
        shutil.rmtree(folder, ignore_errors=True)
        budget.close()
    return answer, clean_up


OUTPUT = ".output"  # the suffix of the file a call's stdout and stderr go to, beside its folder


def _show_output(path: Path) -> None:
    """The first lines a call printed, on the warden's stderr (the owner's log), each marked as the call's."""
    try:
        with open(path, "rb") as f:
            text = f.read(SHOWN_OUTPUT_BYTES).decode("utf-8", "replace")
    except OSError:
        return
    if text:
        sys.stderr.write("".join(f"[jailed call] {line}\n" for line in text.splitlines()))
        sys.stderr.flush()


def _end_call(pid: int) -> None:
    """The call's first process reaped (it exits once it has answered: waited for a moment), then
    every process left below the warden killed and reaped: the call's session, and orphans that
    left it and were adopted here (the warden serves one call at a time: all of them are its)."""
    deadline = time.monotonic() + EXIT_GRACE_S
    while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.0005)
    end_session(os.getpid())  # every descendant of the warden (grpo/common/child.py: this process spared)
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                break
        except ChildProcessError:
            break


def _await(read_end: int, pid: int, deadline: float, budget) -> list:
    from grpo.common.child import session_members

    poller = select.poll()
    poller.register(read_end, select.POLLIN)
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return ["timeout", ""]
        if poller.poll(min(left, TICK_S) * 1000):
            chunk = os.read(read_end, 2**20)
            if not chunk:
                over = budget.exceeded([])
                return ["error", _past(over, budget) if over else "the call's process died without an answer"]
            data += chunk
            if len(data) >= HEADER.size and len(data) >= HEADER.size + HEADER.unpack(data[:HEADER.size])[0]:
                return _decoded(data)
            if len(data) > MAX_ANSWER_BYTES + HEADER.size:
                return ["error", f"the call's answer is larger than {MAX_ANSWER_BYTES} bytes"]
        over = budget.exceeded(session_members(pid) if not budget.folders else [])
        if over:
            return ["error", _past(over, budget)]


def _past(over: str, budget) -> str:
    limit = f"{budget.memory_mb} MB" if over == "memory" else f"{budget.max_processes} processes and threads"
    return f"the call went past its {over} budget ({limit})"


def _decoded(data: bytes) -> list:
    (size,) = HEADER.unpack(data[:HEADER.size])
    try:
        answer = json.loads(data[HEADER.size:HEADER.size + size])
    except (ValueError, RecursionError):
        return ["error", "the call's answer is not JSON, or is nested too deeply"]
    if not (isinstance(answer, list) and len(answer) >= 2 and answer[0] in ("ok", "error")):
        return ["error", "the call's answer is malformed"]
    return answer


def _jailed(fn, arguments: list, jail: Confinement, folder: str, ruleset: tuple[int, int], budget,
            answer_fd: int, output_fd: int) -> None:
    """The call's first process: confined, then fn(*arguments); its answer written to `answer_fd`.
    Never returns."""
    from grpo.common import jail_rules as rules

    status, limits, owner_folder = 0, jail.limits, Path.cwd()
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.setsid()
        budget.enter()
        _replace_environment({**os.environ, "TMPDIR": folder, "HOME": folder, JAILED: "1", **SINGLE_THREADED})
        _streams(output_fd)
        rules.limit_call(limits.memory_mb, limits.cpu_s, limits.file_mb)
        # one port: a network of its own whose 127.0.0.1:<port> is relayed to the host's (grpo/common/jail_relay.py)
        relay, relay_pid = (jail_relay.start_relay(limits.connect_port) if limits.connect_port and limits.namespaces
                            else (None, 0))
        own_network = not limits.network and limits.namespaces and rules.enter_namespaces(False)
        applied = {"namespaces": own_network or (limits.namespaces and rules.enter_namespaces(True))}
        if relay is not None and own_network:
            jail_relay.hand_over(relay, _own_loopback(limits.connect_port))
        elif relay is not None:  # no network namespace here: the call's connects go out, to that port alone
            relay.close()
            os.waitpid(relay_pid, 0)
        applied["own_network"] = bool(own_network)
        if applied["namespaces"]:
            inner = os.fork()  # the first process of the new PID namespace runs the call
            if inner:
                os.close(answer_fd)
                _, code = os.waitpid(inner, 0)
                os._exit(os.waitstatus_to_exitcode(code) % 256)
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        applied["own_proc"] = applied["namespaces"] and rules.mount_own_proc()
        os.chdir(folder)
        applied["capabilities_dropped"] = rules.drop_capabilities()
        applied["landlock_abi"] = 0
        if ruleset[0] >= 0:
            rules.enter_file_rules(ruleset[0])
            applied["landlock_abi"] = ruleset[1]
        os.closerange(3, answer_fd)  # the ruleset, the warden's pipes: nothing but the answer pipe stays open
        os.closerange(answer_fd + 1, os.sysconf("SC_OPEN_MAX"))
        if jail.seccomp is None or not load_seccomp_program(jail.seccomp):
            raise ChildRefused("the call's seccomp filter could not load (is libseccomp installed?)")
        answer = ["ok", fn(*arguments), applied]
    except BaseException as e:
        answer = ["error", f"{type(e).__name__}: {e}", raised_at(e, owner_folder)]
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        write_frame(answer_fd, answer)
    except (TypeError, ValueError, RecursionError) as e:
        write_frame(answer_fd, ["error", f"the call returned a value that is not JSON: {e}"])
    except OSError:
        status = 1
    os._exit(status)


def _own_loopback(port: int):
    """In the call's new network namespace: its loopback up and the relay's listener at 127.0.0.1:`port`."""
    try:
        return jail_relay.own_loopback(port)
    except OSError as e:
        raise ChildRefused(f"the call's own network could not be made ({e}): its port {port} would lead nowhere")


# numerical libraries start a thread per core, each counted against max_processes: one here
SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _streams(output_fd: int) -> None:
    """stdin reads nothing; stdout and stderr go to the call's output file (never to the owner's log,
    which a call could otherwise write over or truncate)."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    os.close(output_fd)


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
