"""What the environments' child (and the rewards' child) lets a model's code do, tried from inside
it the way a policy would: through a code-execution tool (tests/sandbox_probes.py), forking
background processes and hanging, reading the environment for API keys, connecting to the host's
Unix sockets, signalling its parent, writing into the run folder. docs/environments.md, "What the
sandbox allows", names each of these tests."""

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import psutil
import pytest
from conftest import REPO

import grpo.environments.pool as pool_module
from common.child import PASSED_ENVIRONMENT, landlock_abi
from grpo.environments.pool import EnvironmentPool
from grpo.settings import EnvConfig
from rewards import REWARD_FUNCTIONS
from rewards.sandbox import RewardFailed, RewardSandbox

PROBES = str(REPO / "tests" / "sandbox_probes.py")
TOOLS = {"tools": [f"{PROBES}:python", f"{PROBES}:shell"], "parser": "hermes"}
SECRET = "sk-sandbox-test-0123456789"  # an API key as a sampler holds it in its environment


def call(tool: str, code: str) -> str:
    """The model's message: one hermes tool call."""
    argument = "code" if tool == "python" else "command"
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': {argument: code}})}</tool_call>"


def run(pool, code: str, tool: str = "python", key: str | None = None):
    """(what the tool printed, or the failure's text; the failure or None)."""
    reply, failure = pool.step(key or uuid.uuid4().hex, {}, [], call(tool, code))
    return (reply.text[0] if isinstance(reply.text, list) else reply.text), failure


def processes_with(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return found


def gone_within(marker: str, seconds: float) -> bool:
    """Whether no process carries `marker` within `seconds`."""
    return within(seconds, lambda: not processes_with(marker))


def within(seconds: float, done) -> bool:
    """Whether done() comes true within `seconds`."""
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def background(marker: str, detached: bool = False) -> str:
    """Python code that starts a process carrying `marker` in its command line and leaves it running:
    a direct child, or (detached) a grandchild whose parent, a shell, exits at once."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)", marker]
    if detached:
        return f"import subprocess\nsubprocess.run({shlex.join(sleeper) + ' &'!r}, shell=True)\n"
    return f"import subprocess\nsubprocess.Popen({sleeper!r})\n"


@pytest.fixture
def kill_markers():
    """Whatever a failed test left running is killed (by its marker) when the test ends."""
    markers = []
    yield markers
    for marker in markers:
        for p in processes_with(marker):
            p.kill()


# ----------------------------------------------------------------------------- processes

def test_the_processes_a_call_started_end_when_it_times_out(kill_markers):
    marker = f"grpo-probe-{uuid.uuid4().hex}"
    kill_markers.append(marker)
    pool = EnvironmentPool("tools", TOOLS, timeout_s=3.0)
    try:
        code = background(marker) + background(marker, detached=True) + "import time\ntime.sleep(600)\n"
        seen = []
        watcher = threading.Thread(target=lambda: [seen.append(len(processes_with(marker))) or time.sleep(0.1)
                                                   for _ in range(25)])
        watcher.start()
        text, failure = run(pool, code)
        watcher.join()
        assert failure == "no reply within env.timeout_s=3 s" and pool.restarts == 1
        assert max(seen) == 2  # both ran while the call hung
        assert gone_within(marker, 5.0), [p.cmdline() for p in processes_with(marker)]
        assert run(pool, "print(6 * 7)") == ("42\n", None)  # the new child serves
    finally:
        pool.close()


def test_a_process_that_starts_a_session_of_its_own_still_ends_with_the_child(kill_markers):
    """A tool may start a session of its own (start_new_session=True, a pty, a daemon's setsid and
    double fork, whose parent exits at once): the keeper, a subreaper, adopts the orphan, and closing
    the child ends it with the rest. coreutils' `timeout` (a process group of its own) works."""
    session, daemon = f"grpo-probe-{uuid.uuid4().hex}", f"grpo-probe-{uuid.uuid4().hex}"
    kill_markers += [session, daemon]
    pool = EnvironmentPool("tools", TOOLS, timeout_s=10.0)
    try:
        code = (f"import os, subprocess, sys\n"
                f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', {session!r}], "
                f"start_new_session=True)\n"
                f"pid = os.fork()\n"
                f"if pid == 0:\n"
                f"    os.setsid()\n"
                f"    if os.fork() == 0:\n"
                f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(600)', "
                f"{daemon!r}])\n"
                f"    os._exit(0)\n"
                f"os.waitpid(pid, 0)\n"
                f"print('started')\n")
        assert run(pool, code) == ("started\n", None)
        assert len(processes_with(session)) == 1 and len(processes_with(daemon)) == 1
        orphan = processes_with(daemon)[0]
        keeper = orphan.ppid()  # the keeper adopted it: it leads the child's session, which the orphan left
        assert os.getsid(keeper) == keeper and os.getsid(orphan.pid) not in (keeper, os.getsid(0))
        assert run(pool, "timeout 1 sleep 5; echo $?", tool="shell") == ("124\n", None) and pool.restarts == 0
    finally:
        pool.close()
    assert gone_within(session, 5.0) and gone_within(daemon, 5.0)


def test_the_processes_of_a_replaced_or_closed_child_end_with_it(kill_markers):
    first, second = f"grpo-probe-{uuid.uuid4().hex}", f"grpo-probe-{uuid.uuid4().hex}"
    kill_markers += [first, second]
    pool = EnvironmentPool("tools", TOOLS, timeout_s=3.0)
    try:
        assert run(pool, background(first) + "print('started')") == ("started\n", None)  # a call that returned
        assert len(processes_with(first)) == 1
        assert run(pool, "import time\ntime.sleep(600)")[1] == "no reply within env.timeout_s=3 s"  # another hangs
        assert gone_within(first, 5.0)
        assert run(pool, background(second, detached=True) + "print('started')") == ("started\n", None)
        assert len(processes_with(second)) == 1
    finally:
        pool.close()
    assert gone_within(second, 5.0)


SAMPLER = """
import json, sys, time
sys.path.insert(0, {repo!r})
import grpo.environments.pool as pool_module
if {no_namespace!r}:
    pool_module.unshare_network = lambda: False  # as where user namespaces are refused: the seccomp filter
from grpo.environments.pool import EnvironmentPool
pool = EnvironmentPool("tools", {tools!r}, 30.0)
reply, failure = pool.step("a", {{}}, [], {message!r})
print(json.dumps([reply.text, failure, pool.isolation, pool._child.tmp]), flush=True)
time.sleep(600)
"""


def sampler_process(folder, code: str, no_namespace: bool = False) -> subprocess.Popen:
    """A sampler in a process of its own (a script in `folder`: the code's markers stay out of its
    command line), started with an API key in its environment, whose pool has run `code` through
    the python tool (its output: one JSON line)."""
    script = folder / "sampler.py"
    script.write_text(SAMPLER.format(repo=str(REPO), tools=TOOLS, message=call("python", code),
                                     no_namespace=no_namespace))
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "OPENAI_API_KEY": SECRET})


def test_the_processes_of_a_tool_end_when_the_sampler_is_killed(tmp_path, kill_markers):
    marker = f"grpo-probe-{uuid.uuid4().hex}"
    kill_markers.append(marker)
    sampler = sampler_process(tmp_path, background(marker) + background(marker, detached=True) + "print('started')")
    try:
        text, failure, _, folder = json.loads(sampler.stdout.readline())
        assert (text, failure) == (["started\n"], None) and len(processes_with(marker)) == 2 and os.path.isdir(folder)
        sampler.kill()  # SIGKILL: no close(), no atexit
        sampler.wait()
        assert gone_within(marker, 5.0)
        assert within(5.0, lambda: not os.path.exists(folder))  # the child's TMPDIR: its keeper removes it last
    finally:
        sampler.kill()
        sampler.wait()


# ----------------------------------------------------------------------------- environment variables

ENVIRONMENT_PROBE = f"""
import glob, os, subprocess
sampler = int(open(f'/proc/{{os.getppid()}}/stat').read().rsplit(')', 1)[1].split()[1])  # the keeper's parent
def holds(path):
    try:
        return {SECRET!r}.encode() in open(path, 'rb').read()
    except OSError:
        return False
print(sorted(os.environ))
print('os.environ', any({SECRET!r} in v for v in os.environ.values()))
print('/proc/self/environ', holds('/proc/self/environ'))
print('the sampler', holds(f'/proc/{{sampler}}/environ'))
print('any process', [p for p in glob.glob('/proc/[0-9]*/environ') if holds(p)] != [])
print('subprocess', {SECRET!r} in subprocess.run(['env'], capture_output=True, text=True).stdout)
"""


def test_the_child_sees_an_allow_list_of_environment_variables_and_no_api_key(monkeypatch):
    """In-process: the sampler's variables (an API key among them, set after it started) reach
    neither os.environ nor a subprocess; env.pass_env names the ones that do."""
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    monkeypatch.setenv("GRPO_PASSED", "yes")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    pool = EnvironmentPool("tools", TOOLS, 10.0, EnvConfig(pass_env=["GRPO_PASSED"]))
    try:
        text, failure = run(pool, "import os, subprocess, tempfile\nprint(sorted(os.environ))\n"
                                  "print(tempfile.gettempdir() == os.environ['TMPDIR'])\n"
                                  "out = subprocess.run(['env'], capture_output=True, text=True).stdout\n"
                                  "print(sorted(line.split('=')[0] for line in out.splitlines()))")
        names = sorted({n for n in os.environ if n in PASSED_ENVIRONMENT or n.startswith("LC_")}
                       | {"GRPO_PASSED", "TMPDIR", "PYTHONHASHSEED"})
        assert failure is None and text == f"{names}\nTrue\n{names}\n"
    finally:
        pool.close()


@pytest.mark.parametrize("isolation", ["namespace", "seccomp"])
def test_no_api_key_of_the_sampler_reaches_the_child(isolation, tmp_path):
    """A sampler started with OPENAI_API_KEY in its environment: the child's os.environ, its own
    /proc/self/environ (a fork starts with its parent's block), a subprocess's environment: none
    holds it. The sampler's /proc/<pid>/environ is hidden in the child's mount namespace; where no
    user namespace can be had (seccomp), it stays readable (docs/environments.md says so)."""
    sampler = sampler_process(tmp_path, ENVIRONMENT_PROBE, no_namespace=isolation == "seccomp")
    try:
        text, failure, how, _ = json.loads(sampler.stdout.readline())
        assert failure is None and how == isolation
        lines = text[0].splitlines()
        assert "OPENAI_API_KEY" not in lines[0]
        readable = isolation == "seccomp"
        assert lines[1:] == ["os.environ False", "/proc/self/environ False", f"the sampler {readable}",
                             f"any process {readable}", "subprocess False"]
    finally:
        sampler.kill()
        sampler.wait()


HELD = {}  # what the sampler holds in memory (a client's API key), set by the test below


def test_what_the_sampler_holds_in_memory_is_in_the_childs_copy():
    """Not prevented: the child is a fork, so its memory is a copy of the sampler's as it was then (it
    has the user's modules that way). docs/environments.md says so."""
    HELD["api_key"] = SECRET
    pool = EnvironmentPool("tools", TOOLS, 10.0)
    try:
        assert run(pool, "import sys\nprint(sys.modules['test_sandbox'].HELD['api_key'])") == (f"{SECRET}\n", None)
    finally:
        pool.close()
        HELD.clear()


def test_the_reward_child_sees_the_allow_list_and_its_processes_end_with_its_timeout(monkeypatch, kill_markers):
    marker = f"grpo-probe-{uuid.uuid4().hex}"
    kill_markers.append(marker)

    def probing(completion, answer):
        if completion == "environment":
            return float(any(SECRET in v for v in os.environ.values()))
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker])
        time.sleep(600)

    monkeypatch.setitem(REWARD_FUNCTIONS, "probing", probing)  # before the fork: the child has it
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    sandbox = RewardSandbox(timeout_s=2.0)
    try:
        assert sandbox("probing", "environment", {"reference_answer": "1"}) == 0.0
        with pytest.raises(RewardFailed, match="no answer within rewards.timeout_s=2 s"):
            sandbox("probing", "hang", {"reference_answer": "1"})
        assert gone_within(marker, 5.0)
    finally:
        sandbox.close()


# ----------------------------------------------------------------------------- signals, other processes' memory

@pytest.mark.parametrize("confinement", ["landlock", "seccomp"])
def test_the_child_cannot_signal_the_sampler(confinement, monkeypatch):
    """Landlock (Linux 6.12) scopes signals to the child's own processes; without it a seccomp filter
    refuses signals to the keeper, the sampler and their parents (another process outside, here a
    victim the test started, can then be signalled: docs/environments.md says so). Either way a
    tool still ends its own subprocesses (subprocess.run's timeout)."""
    if confinement == "landlock" and landlock_abi() < 6:
        pytest.skip(f"the kernel's Landlock ABI is {landlock_abi()}: signals are scoped from ABI 6 (Linux 6.12)")
    if confinement == "seccomp":
        monkeypatch.setattr(pool_module, "landlock_scope", lambda: 0)  # as on a kernel without Landlock
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(True))
    victim = subprocess.Popen(["sleep", "60"])
    pool = EnvironmentPool("tools", TOOLS, 20.0)
    try:
        assert pool.confinement["signals"] == confinement
        sampler, landlock = os.getpid(), confinement == "landlock"
        code = (f"import ctypes, os, signal, subprocess\n"
                f"def attempt(name, do):\n"
                f"    try:\n        do()\n        print(name, 'done')\n"
                f"    except (OSError, subprocess.SubprocessError) as e:\n        print(name, type(e).__name__)\n"
                f"attempt('parent', lambda: os.kill(os.getppid(), signal.SIGUSR1))\n"
                f"attempt('sampler', lambda: os.kill({sampler}, signal.SIGUSR1))\n"
                f"attempt('sampler group', lambda: os.killpg({os.getpgid(0)}, 0))\n"
                f"attempt('sampler pidfd', "
                f"lambda: signal.pidfd_send_signal(os.pidfd_open({sampler}), signal.SIGUSR1))\n"
                f"attempt('victim', lambda: os.kill({victim.pid}, signal.SIGKILL))\n"
                f"libc = ctypes.CDLL(None, use_errno=True)\n"
                f"print('ptrace', libc.ptrace(0x4206, {sampler}, 0, 0), ctypes.get_errno())\n"  # PTRACE_SEIZE: no stop
                + (f"attempt('memory', lambda: open('/proc/{sampler}/mem', 'rb').close())\n" if landlock else "") +
                "attempt('own subprocess', lambda: subprocess.run(['sleep', '10'], timeout=0.5))\n")
        text, failure = run(pool, code)
        assert failure is None and text.splitlines() == [
            "parent PermissionError", "sampler PermissionError", "sampler group PermissionError",
            "sampler pidfd PermissionError", f"victim {'PermissionError' if landlock else 'done'}",
            "ptrace -1 1", *(["memory PermissionError"] if landlock else []), "own subprocess TimeoutExpired"]
        assert received == [] and pool.restarts == 0
        assert (victim.poll() is None) == landlock
    finally:
        pool.close()
        victim.kill()
        victim.wait()
        signal.signal(signal.SIGUSR1, previous)


# ----------------------------------------------------------------------------- Unix sockets

def test_the_child_cannot_reach_a_unix_socket_of_the_host(tmp_path):
    """A socket file (a host service's, the trainer's ipc://) and an abstract one: socket(AF_UNIX) is
    refused in the tool's process and in its subprocess; so is a datagram socketpair() (SOCK_DGRAM, or
    SOCK_RAW, which Unix sockets make a datagram one), which could
    connect again to a datagram socket of the host (journald's, /dev/log) or sendto() one; a stream
    socketpair() (multiprocessing.Pipe) works."""
    path, name = str(tmp_path / "host.sock"), f"\0grpo-probe-{uuid.uuid4().hex}"
    servers = []
    for address in (path, name):
        server = socket.socket(socket.AF_UNIX)
        server.bind(address)
        server.listen()
        server.setblocking(False)
        servers.append(server)
    datagrams = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    datagrams.bind(str(tmp_path / "log.sock"))
    datagrams.setblocking(False)
    servers.append(datagrams)
    pool = EnvironmentPool("tools", TOOLS, 20.0)
    try:
        connect = f"import socket; socket.socket(socket.AF_UNIX).connect({path!r})"
        code = (f"import multiprocessing, socket, subprocess, sys\n"
                f"for address in ({path!r}, {name!r}):\n"
                f"    try:\n        socket.socket(socket.AF_UNIX).connect(address)\n        print('connected')\n"
                f"    except OSError as e:\n        print(type(e).__name__, e.errno)\n"
                f"child = subprocess.run([sys.executable, '-c', {connect!r}], capture_output=True, text=True)\n"
                f"print(child.stderr.strip().splitlines()[-1])\n"
                f"a, b = multiprocessing.Pipe()\na.send('pipe works')\nprint(b.recv())\n"
                f"for kind in (socket.SOCK_DGRAM, socket.SOCK_RAW):  # a Unix SOCK_RAW is a datagram socket\n"
                f"    try:\n        x, y = socket.socketpair(socket.AF_UNIX, kind | socket.SOCK_CLOEXEC)\n"
                f"        x.sendto(b'escaped', {str(tmp_path / 'log.sock')!r})\n        print('sent')\n"
                f"    except OSError as e:\n        print(type(e).__name__, e.errno)\n")
        text, failure = run(pool, code)
        assert failure is None and text.splitlines() == [
            "PermissionError 13", "PermissionError 13", "PermissionError: [Errno 13] Permission denied", "pipe works",
            "PermissionError 13", "PermissionError 13"]
        for server in servers[:2]:
            with pytest.raises(BlockingIOError):
                server.accept()  # nothing came in
        with pytest.raises(BlockingIOError):
            datagrams.recv(100)  # nothing was sent
    finally:
        pool.close()
        for server in servers:
            server.close()


# ----------------------------------------------------------------------------- files, CPU

def test_the_child_writes_where_the_sampler_can_in_its_own_temporary_folder(tmp_path):
    """Not a file sandbox: it writes into a run folder (docs/environments.md says so); its TMPDIR is
    its own, removed with it; it makes no device node (root could read a disk through one)."""
    weights = tmp_path / "runs" / "a" / "weights"
    weights.mkdir(parents=True)
    pool = EnvironmentPool("tools", TOOLS, 10.0)
    try:
        code = (f"import os, stat, tempfile\n"
                f"open({str(weights / 'LATEST')!r}, 'w').write('999')\n"
                f"print(tempfile.gettempdir())\n"
                f"try:\n    os.mknod({str(tmp_path / 'disk')!r}, stat.S_IFBLK | 0o600, os.makedev(8, 0))\n"
                f"except OSError as e:\n    print(type(e).__name__)\n")
        text, failure = run(pool, code)
        own = pool._child.tmp
        assert failure is None and text == f"{own}\nPermissionError\n"
        assert (weights / "LATEST").read_text() == "999" and os.path.isdir(own)
    finally:
        pool.close()
    assert not os.path.exists(own)


def test_a_call_past_the_cpu_budget_gets_the_child_replaced():
    pool = EnvironmentPool("tools", TOOLS, 60.0, EnvConfig(cpu_s=1))
    try:
        started = time.monotonic()
        text, failure = run(pool, "while True:\n    pass")
        assert failure == "the environments process died" and pool.restarts == 1
        assert time.monotonic() - started < 30  # the CPU budget, not the 60 s limit
        assert run(pool, "print('next')") == ("next\n", None)
    finally:
        pool.close()
