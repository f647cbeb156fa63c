"""What model-written code can reach, tried from inside the way a gaming policy would: through a
code-execution tool in an episode (an EnvironmentPool stepping tests/sandbox_probes.py:python),
through an environment that runs the model's program with run_tool (tests/sandbox_probes.py:
CodeRunner), and through a rule reward that runs the completion (tests/sandbox_probes.py:
run_completion, what a unit-test reward does). Each probe sets `escaped`; each test asserts that the attack failed, by
value, and that the run went on. docs/environments.md, "What the sandbox allows", names each test."""

import json
import os
import re
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
from helpers import command_line

from grpo.common.child import ChildFailed
from grpo.common.jail import Jail, JailLimits
from grpo.environments.pool import EnvironmentPool
from grpo.rewards.sandbox import RewardFailed, RewardSandbox
from grpo.settings import EnvConfig

PROBES = str(REPO / "tests" / "sandbox_probes.py")
TOOLS = {"tools": [f"{PROBES}:python", f"{PROBES}:shell"], "parser": "hermes"}
PROBE_REWARD = f"{PROBES}:run_completion"
SECRET = "sk-sandbox-test-0123456789"  # an API key as a sampler holds it in its environment
HELD = {}  # what the sampler holds in memory (rows' answers, a client's key), set by the tests


def call(tool: str, code: str) -> str:
    """The model's message: one hermes tool call."""
    argument = "code" if tool == "python" else "command"
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': {argument: code}})}</tool_call>"


def run(pool, code: str, tool: str = "python", key: str | None = None):
    """(what the tool printed, or its error's text; the environment's failure or None)."""
    reply, failure = pool.step(key or uuid.uuid4().hex, {}, [], call(tool, code))
    return (reply.text[0] if isinstance(reply.text, list) else reply.text), failure


@pytest.fixture(params=["tool", "environment", "reward"])
def inside(request):
    """Runs probe code inside a tool call of an episode, a program an environment runs through the
    jail (tests/sandbox_probes.py:CodeRunner), or a rule reward; answers whether it set `escaped`
    ("True"/"False"), or the error the call ended with."""
    if request.param in ("tool", "environment"):
        pool = EnvironmentPool("tools", TOOLS, 30.0) if request.param == "tool" else \
            EnvironmentPool(f"{PROBES}:CodeRunner", {}, 30.0)
        if request.param == "tool":
            yield lambda code: run(pool, code + "\nprint(bool(escaped))")[0].strip()
        else:
            yield lambda code: pool.step(uuid.uuid4().hex, {}, [], code + "\nprint(bool(escaped))")[0].text.strip()
        pool.close()
    else:
        sandbox = RewardSandbox(timeout_s=30.0)

        def scored(code: str) -> str:
            try:
                return str(sandbox(PROBE_REWARD, code, {"reference_answer": "42"}) == 1.0)
            except RewardFailed as e:
                return f"error: {e}"
        yield scored
        sandbox.close()


def attempts(*tries: str) -> str:
    """Probe code: `escaped` is true where any of the `tries` (statements) ran without an OSError."""
    body = "".join(f"try:\n    {t}\n    escaped = True\nexcept OSError:\n    pass\n" for t in tries)
    return "escaped = False\n" + body


# ----------------------------------------------------------------------------- files

def test_the_code_reads_no_data_and_writes_nothing_of_the_run_or_the_checkout(inside, tmp_path):
    """The dataset (its own question's answer is there), a run folder's files, the checkout's config:
    not readable. A pickle planted where a resume would load it, a module of the checkout or of the
    venv opened for appending: refused (nothing is written: the open itself fails)."""
    checkpoints = tmp_path / "runs" / "a" / "checkpoints" / "3"
    checkpoints.mkdir(parents=True)
    (checkpoints / "latest").write_text("3")
    site = next(p for p in sys.path if p.endswith("site-packages"))
    data = next((REPO / "data" / "embedded").rglob("*.*"))
    tries = [f"open({str(data)!r}, 'rb').read(1)", f"open({str(checkpoints / 'latest')!r}).read()",
             f"open({str(REPO / 'config.yaml')!r}).read()",
             f"open({str(checkpoints / 'mp_rank_00_model_states.pt')!r}, 'wb').close()",
             f"open({str(REPO / 'common' / 'jail.py')!r}, 'a').close()",
             f"open({os.path.join(site, 'six.py')!r}, 'a').close()"]
    for attempt in tries:
        assert inside(attempts(attempt)) == "False", attempt
    assert sorted(os.listdir(checkpoints)) == ["latest"]
    assert inside("import tempfile, os\np = os.path.join(tempfile.gettempdir(), 'x')\nopen(p, 'w').write('1')\n"
                  "escaped = open(p).read() == '1'") == "True"  # its own folder it writes


def test_the_code_cannot_make_a_device_node(inside, tmp_path):
    assert inside(attempts(f"os.mknod({str(tmp_path / 'disk')!r}, 0o60600, os.makedev(8, 0))").replace(
        "escaped = False", "import os\nescaped = False")) == "False"


# ----------------------------------------------------------------------------- other processes

def test_no_process_outside_the_call_can_be_read_signalled_or_traced(inside):
    """The sampler (this test's process): its memory and environment through /proc, a signal (0: the
    permission check alone), ptrace, process_vm_readv."""
    sampler = os.getpid()
    tries = [f"open('/proc/{sampler}/mem', 'rb').read(1)", f"open('/proc/{sampler}/environ', 'rb').read(1)",
             f"os.kill({sampler}, 0)", "os.kill(-1, 0)",
             f"assert libc.ptrace(0x4206, {sampler}, 0, 0) == 0 or (_ for _ in ()).throw(OSError())",
             "assert os.listdir('/proc') == [] or (_ for _ in ()).throw(OSError())"]
    code = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n" + attempts(*tries)
    assert inside(code) == "False"


def test_the_call_holds_nothing_of_the_sampler(inside, monkeypatch):
    """The sampler holds rows' answers and an API key in memory and its environment; the call was
    started by exec, so a search of its whole heap (gc) and of its environment finds neither."""
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    HELD.update(answers=[f"answer-{n}-{uuid.uuid4().hex}" for n in range(3)], key=SECRET)
    try:
        reversed_needles = [n[::-1] for n in [SECRET, *HELD["answers"]]]  # the probe's text does not hold them
        code = (f"import gc, os\nneedles = [n[::-1] for n in {reversed_needles!r}]\n"
                "def strings(o):\n    items = o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple, "
                "set)) else ()\n    return [v for v in list(items) if isinstance(v, str)]\n"
                "escaped = any(n in v and not any(v is m for m in needles) for o in gc.get_objects() "
                "for v in strings(o) for n in needles) or any(n in v for v in os.environ.values() for n in needles)")
        assert inside(code) == "False"
    finally:
        HELD.clear()


def test_the_environments_own_process_holds_nothing_of_the_sampler(monkeypatch):
    """An environment's process holds its episodes and nothing else: it is forked from a process made by
    exec before the sampler's data, so neither the rows' answers in the sampler's memory nor its API key
    are in its heap or environment, and no module of the data is loaded."""
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    HELD.update(answers=[f"answer-{n}-{uuid.uuid4().hex}" for n in range(3)], key=SECRET)
    import grpo.data.embedded  # noqa: F401 the sampler's data module, loaded here
    pool = EnvironmentPool(f"{PROBES}:InOwnProcess", {}, 30.0)
    try:
        reversed_needles = [n[::-1] for n in [SECRET, *HELD["answers"]]]
        code = (f"import gc, os, sys\nneedles = [n[::-1] for n in {reversed_needles!r}]\n"
                "def strings(o):\n    items = o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple, "
                "set)) else ()\n    return [v for v in list(items) if isinstance(v, str)]\n"
                "print(any(n in v and not any(v is m for m in needles) for o in gc.get_objects() "
                "for v in strings(o) for n in needles), any(n in v for v in os.environ.values() for n in needles),"
                "'grpo.data.embedded' in sys.modules)")
        reply, failure = pool.step(uuid.uuid4().hex, {}, [], code)
        assert failure is None and reply.text.split() == ["False", "False", "False"]
    finally:
        pool.close()
        HELD.clear()


def test_a_reward_call_sees_its_own_row_alone():
    """Two samples scored one after the other: the second's call finds the first's answer nowhere
    (nor anything the first left behind: the first's process and folder are gone)."""
    sandbox = RewardSandbox(timeout_s=30.0)
    try:
        first = ("import tempfile, os, builtins\nopen(os.path.join(tempfile.gettempdir(), 'left'), 'w')"
                 ".write(row['reference_answer'])\nbuiltins.LEFT = row['reference_answer']\nscore = 0.5")
        assert sandbox(PROBE_REWARD, first, {"reference_answer": "first-answer-31"}) == 0.5
        second = ("import gc, glob, tempfile, builtins\nleft = glob.glob('/tmp/grpo-jail-*/*/left') + "
                  "glob.glob(tempfile.gettempdir() + '/../*/left')\n"
                  "escaped = bool(left) or hasattr(builtins, 'LEFT') or any('first-answer-31' in repr(o) "
                  "for o in gc.get_objects() if isinstance(o, str))")
        assert sandbox(PROBE_REWARD, second, {"reference_answer": "second"}) == 0.0
    finally:
        sandbox.close()


# ----------------------------------------------------------------------------- sockets

def test_no_socket_reaches_the_host_or_the_network(inside, tmp_path):
    """A listener on loopback (TCP), a Unix socket file and an abstract one of the host, and the families a
    policy tries next: UDP, AF_XDP (44), packet, netlink, vsock. None opens; the listeners get nothing."""
    tcp = socket.create_server(("127.0.0.1", 0))
    tcp.setblocking(False)
    path, name = str(tmp_path / "host.sock"), f"\0grpo-probe-{uuid.uuid4().hex}"
    unix = []
    for address in (path, name):
        server = socket.socket(socket.AF_UNIX)
        server.bind(address)
        server.listen()
        server.setblocking(False)
        unix.append(server)
    try:
        port = tcp.getsockname()[1]
        tries = [f"socket.create_connection(('127.0.0.1', {port}), timeout=2)",
                 f"socket.socket(socket.AF_UNIX).connect({path!r})", f"socket.socket(socket.AF_UNIX).connect({name!r})",
                 f"socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {port}))",
                 "socket.socket(44, socket.SOCK_RAW)", "socket.socket(socket.AF_PACKET, socket.SOCK_RAW)",
                 "socket.socket(socket.AF_NETLINK, socket.SOCK_RAW)", "socket.socket(40, socket.SOCK_STREAM)",
                 "socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)"]
        code = "import socket\n" + attempts(*tries)
        assert inside(code) == "False"
        assert inside("import multiprocessing\na, b = multiprocessing.Pipe()\na.send(1)\n"
                      "escaped = b.recv() == 1") == "True"  # a stream pair of its own works
        for server in [tcp, *unix]:
            with pytest.raises(BlockingIOError):
                server.accept()
    finally:
        for server in [tcp, *unix]:
            server.close()


def test_without_namespaces_the_filters_still_hold(tmp_path):
    """The fallback (a kernel or container that refuses user namespaces): no AF_XDP or UDP to a
    listener on loopback, no capability left (the sampler here is root), bpf, open_tree and fsopen
    refused, signals to the sampler refused by Landlock's scope."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))
    listener.setblocking(False)
    jail = Jail("probe", "grpo.environments.tools:jailed_tool", [f"{PROBES}:python"], JailLimits(namespaces=False))
    try:
        assert jail.info["namespaces"] is False
        code = ("import ctypes, os, socket\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                "class H(ctypes.Structure):\n    _fields_ = [('v', ctypes.c_uint32), ('p', ctypes.c_int)]\n"
                "data = (ctypes.c_uint32 * 6)()\nlibc.capget(ctypes.byref(H(0x20080522, 0)), data)\n"
                "print('capabilities', list(data))\n"
                "for name, number in (('bpf', 321), ('open_tree', 428), ('fsopen', 430)):\n"
                "    print(name, libc.syscall(number, 0, 0, 0), ctypes.get_errno())\n"
                + attempts("socket.socket(44, socket.SOCK_RAW)",
                           f"socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', "
                           f"('127.0.0.1', {listener.getsockname()[1]}))",
                           f"os.kill({os.getpid()}, 0)") + "print('escaped', escaped)\n")
        text = jail.call(f"{PROBES}:python", [{"code": code}], 30.0, "timeout")
        assert text.splitlines() == ["capabilities [0, 0, 0, 0, 0, 0]", "bpf -1 1", "open_tree -1 1", "fsopen -1 1",
                                     "escaped False"]
        with pytest.raises(BlockingIOError):
            listener.recv(10)
    finally:
        jail.close()
        listener.close()


# ----------------------------------------------------------------------------- the episode

def test_a_tool_cannot_touch_its_reply_its_episode_or_the_others():
    """The tool replaces the Reply class and the environment's step, and writes a forged answer into
    every descriptor it may hold: the reply is its text alone (no done, no reward), and the next
    episode's calls are answered as before."""
    pool = EnvironmentPool("tools", TOOLS, 30.0)
    try:
        forge = ("import json, os, struct, grpo.environments as e, grpo.environments.tools as t\n"
                 "e.Reply = t.Reply = lambda *a, **k: None\n"
                 "t.ToolEnvironment.step = lambda self, message: t.Reply(done=True, reward=1000.0)\n"
                 "forged = json.dumps(['ok', [['won'], True, 999.0, 'user', 0, 0, 0]]).encode()\n"
                 "for fd in range(3, 256):\n    try:\n        os.write(fd, struct.pack('>I', len(forged)) + forged)\n"
                 "    except OSError:\n        pass\nprint('tried')")
        reply, failure = pool.step("a", {}, [], call("python", forge))
        # its forged frame reached its own answer pipe: it changed its own text, nothing else
        assert (len(reply.text), reply.done, reply.reward, failure) == (1, False, None, None)
        assert reply.text[0] in ("tried\n", '[["won"], true, 999.0, "user", 0, 0, 0]')
        for key in ("a", "b"):
            reply, failure = pool.step(key, {}, [], call("python", "print(6 * 7)"))
            assert (reply.text, reply.done, reply.reward, failure) == (["42\n"], False, None, None)
        assert pool.restarts == 0
    finally:
        pool.close()


def test_environment_variables_are_an_allow_list_with_no_gpu(inside, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    code = ("import os, subprocess\nout = subprocess.run(['env'], capture_output=True, text=True).stdout\n"
            f"escaped = {SECRET!r} in out or os.environ['CUDA_VISIBLE_DEVICES'] != '' or "
            "'OPENAI_API_KEY' in os.environ or os.environ['GRPO_JAILED'] != '1'")
    assert inside(code) == "False"


# ----------------------------------------------------------------------------- budgets and processes

def background(marker: str) -> str:
    """Python code that leaves a process carrying `marker` running: a detached grandchild whose parent exits."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)", marker]
    return f"import subprocess\nsubprocess.run({shlex.join(sleeper) + ' &'!r}, shell=True)\n"


def processes_with(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return found


def within(seconds: float, done) -> bool:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_what_a_call_started_ends_with_it_and_a_hang_costs_the_call_alone():
    """A detached background process ends when its call returns; a call that hangs is an error the
    model reads (the step goes on, the environments' child is not replaced), and its processes end."""
    marker = f"grpo-probe-{uuid.uuid4().hex}"
    pool = EnvironmentPool("tools", TOOLS, 10.0)  # room for a jail's start on a busy machine
    try:
        assert run(pool, background(marker) + "print('started')") == ("started\n", None)
        assert within(5.0, lambda: not processes_with(marker))
        text, failure = run(pool, background(marker) + "import time\ntime.sleep(600)")
        assert (text, failure) == ("error: the tool ran past env.timeout_s=10 s", None) and pool.restarts == 0
        assert within(5.0, lambda: not processes_with(marker))
        assert run(pool, "print('next')") == ("next\n", None)
    finally:
        pool.close()
        for p in processes_with(marker):
            p.kill()


def test_a_fork_bomb_and_a_memory_bomb_fail_their_call_not_the_sampler():
    """Past env.max_processes the kernel refuses the fork (a cgroup) or the call is ended (the watch);
    four processes of 600 MB under env.memory_mb=1024 end the call, never the sampler. Each error
    names the budget; the next call is served by the same child."""
    pool = EnvironmentPool("tools", TOOLS, 30.0, EnvConfig(max_processes=16, memory_mb=1024))
    try:
        bomb = ("import os, time\nfor _ in range(200):\n    try:\n        if os.fork() == 0:\n"
                "            time.sleep(30)\n            os._exit(0)\n    except OSError:\n"
                "        print('refused')\n        break\n")
        text, failure = run(pool, bomb)
        assert failure is None
        # the kernel refuses the fork (the cgroup's pids.max), or the warden's watch sees the tree past it first
        assert text in ("refused\n", "error: the call went past its processes budget (16 processes and threads)")
        hog = ("import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        b = bytearray(600 * 2**20)\n"
               "        b[::4096] = b'1' * (len(b) // 4096)\n        time.sleep(30)\n        os._exit(0)\n"
               "time.sleep(30)\n")
        text, failure = run(pool, hog)
        assert (text, failure) == ("error: the call went past its memory budget (1024 MB)", None)
        assert run(pool, "print('alive')") == ("alive\n", None) and pool.restarts == 0
    finally:
        pool.close()


def test_a_call_past_its_cpu_seconds_is_ended():
    pool = EnvironmentPool("tools", TOOLS, 60.0, EnvConfig(cpu_s=3))  # the child's own start fits in it
    try:
        started = time.monotonic()
        text, failure = run(pool, "while True:\n    pass")
        assert (text, failure) == ("error: the call's process died without an answer", None)
        assert time.monotonic() - started < 30 and pool.restarts == 0  # the CPU budget, not the 60 s limit
        assert run(pool, "print('next')") == ("next\n", None)
    finally:
        pool.close()


SAMPLER = """
import json, sys, time
sys.path.insert(0, {repo!r})
from grpo.environments.pool import EnvironmentPool
pool = EnvironmentPool("tools", {tools!r}, 30.0)
reply, failure = pool.step("a", {{}}, [], {message!r})
print(json.dumps([reply.text, failure]), flush=True)
time.sleep(600)
"""


def test_the_jail_ends_when_the_sampler_is_killed(tmp_path):
    """A call that hangs in a sampler that is SIGKILLed: the call, its warden and the environments'
    child all end."""
    marker = f"grpo-probe-{uuid.uuid4().hex}"
    script = tmp_path / "sampler.py"
    script.write_text(SAMPLER.format(repo=str(REPO), tools=TOOLS, message=call("python", "print('ok')")))
    sampler = subprocess.Popen([sys.executable, str(script), marker], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert json.loads(sampler.stdout.readline()) == [["ok\n"], None]
        family = psutil.Process(sampler.pid).children(recursive=True)
        assert any("grpo.common.jail" in command_line(p) for p in family)
        sampler.kill()
        sampler.wait()
        gone, alive = psutil.wait_procs(family, timeout=10)
        assert alive == []
    finally:
        sampler.kill()
        sampler.wait()


def test_a_reward_that_hangs_or_raises_fails_its_sample_and_the_next_is_scored():
    sandbox = RewardSandbox(timeout_s=1.0)
    try:
        with pytest.raises(RewardFailed, match="no answer within rewards.timeout_s=1 s"):
            sandbox(PROBE_REWARD, "while True:\n    pass", {"reference_answer": "1"})
        with pytest.raises(RewardFailed, match="ZeroDivisionError: division by zero") as raised:
            sandbox(PROBE_REWARD, "1 / 0", {"reference_answer": "1"})
        assert re.fullmatch(r"tests/sandbox_probes.py:\d+, in run_completion", raised.value.where)
        assert sandbox(PROBE_REWARD, "score = 0.25", {"reference_answer": "1"}) == 0.25
        assert sandbox._jails[0].restarts == 0
    finally:
        sandbox.close()


def test_a_jail_that_cannot_start_says_why():
    with pytest.raises(Exception, match="env.tools: cannot import 'no_such_module:tool'"):
        Jail("probe", "grpo.environments.tools:jailed_tool", ["no_such_module:tool"])
    assert issubclass(RewardFailed, ChildFailed)


def test_a_killed_warden_is_started_again_for_the_next_call():
    sandbox = RewardSandbox(timeout_s=5.0)
    try:
        os.kill(sandbox._jails[0]._process.pid, signal.SIGKILL)
        sandbox._jails[0]._process.wait()
        assert sandbox(PROBE_REWARD, "score = 3.0", {"reference_answer": "1"}) == 3.0
        assert sandbox._jails[0].restarts == 1
    finally:
        sandbox.close()


# ----------------------------------------------------------------------------- what one call leaves for the next

def test_a_call_leaves_nothing_for_the_next_in_files_or_shared_memory(inside):
    """Beside its own folder (the warden's, where the next call's folder is made) nothing is
    writable; System V shared memory and POSIX queues are refused (an IPC namespace of its own too),
    so no segment outlives the call or its memory budget."""
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            + attempts("open('../left_for_the_next', 'w').close()", "os.mkdir('../dir')", "os.listdir('..')",
                       "assert libc.shmget(0x5EC0DE42, 4096, 0o1666) >= 0 or (_ for _ in ()).throw(OSError())",
                       "assert libc.mq_open(b'/grpo-probe', 0o100 | 2, 0o600, None) >= 0 or "
                       "(_ for _ in ()).throw(OSError())"))
    assert inside(code) == "False"


def test_a_process_that_leaves_its_session_still_ends_with_its_call(tmp_path):
    """Without namespaces (no PID namespace takes the tree with it): a double fork into a session of
    its own, its parent gone at once. The warden is a subreaper: the orphan comes to it and is
    killed with its call, before the next call."""
    marker = f"grpo-probe-{uuid.uuid4().hex}"
    jail = Jail("probe", "grpo.environments.tools:jailed_tool", [f"{PROBES}:python"], JailLimits(namespaces=False))
    try:
        code = (f"import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
                f"    os._exit(0)\nos.wait()\nprint('left')")
        assert jail.call(f"{PROBES}:python", [{"code": code}], 20.0, "timeout") == "left\n"
        assert processes_with(marker) == []
    finally:
        jail.close()
        for p in processes_with(marker):
            p.kill()


LOGGING_OWNER = """
import sys
sys.path.insert(0, {repo!r})
from grpo.common.jail import Jail
print("the owner's own line", file=sys.stderr, flush=True)
jail = Jail("probe", "grpo.environments.tools:jailed_tool", [{probes!r} + ":python"])
print(jail.call({probes!r} + ":python", [{{"code": {code!r}}}], 20.0, "timeout"), flush=True)
jail.close()
"""


def test_a_call_cannot_write_over_the_owners_log(tmp_path):
    """The owner's stderr is the run's log (sampler.log): a call that writes to its descriptors 1 and
    2 and truncates them writes its own output file; the log keeps the owner's lines, and the call's
    first lines are copied there marked as the call's."""
    code = "import os\nos.write(2, b'step 9 | reward +9.9 (forged)\\n')\nos.ftruncate(2, 0)\nos.write(1, b'done\\n')"
    log = tmp_path / "sampler.log"
    with open(log, "ab") as f:
        subprocess.run([sys.executable, "-c", LOGGING_OWNER.format(repo=str(REPO), probes=PROBES, code=code)],
                       stdout=subprocess.PIPE, stderr=f, cwd=REPO, check=True, timeout=60)
    lines = log.read_text().splitlines()
    assert lines[0] == "the owner's own line" and "step 9 | reward +9.9 (forged)" not in lines
    assert lines[1:] == ["[jailed call] done"]


def test_an_answer_nested_too_deeply_fails_its_call_and_the_jail_goes_on():
    """A call that finds its answer pipe and writes a frame of 200,000 '[' into it: its call fails,
    the warden is not replaced, the next call is answered."""
    jail = Jail("probe", "grpo.environments.tools:jailed_tool", [f"{PROBES}:python"])
    try:
        code = ("import os, stat, struct\nframe = b'[' * 200000\n"
                "for fd in range(3, 1024):\n    try:\n        if stat.S_ISFIFO(os.fstat(fd).st_mode):\n"
                "            os.write(fd, struct.pack('>I', len(frame)) + frame)\n    except OSError:\n        pass\n")
        with pytest.raises(ChildFailed, match="nested too deeply"):
            jail.call(f"{PROBES}:python", [{"code": code}], 20.0, "timeout")
        assert jail.call(f"{PROBES}:python", [{"code": "print(2)"}], 20.0, "timeout") == "2\n"
        assert jail.restarts == 0
    finally:
        jail.close()


def test_a_killed_warden_leaves_no_folder_or_cgroup_and_closing_twice_is_harmless():
    from grpo.common.jail_budget import PREFIX, _v1_parents, _v2_parent

    jail = Jail("probe", "grpo.environments.tools:jailed_tool", [f"{PROBES}:python"])
    first, warden = jail.folder, jail._process.pid
    threading.Timer(1.0, lambda: os.kill(warden, signal.SIGKILL)).start()
    with pytest.raises(ChildFailed):
        jail.call(f"{PROBES}:python", [{"code": "import time\ntime.sleep(30)"}], 20.0, "timeout")
    try:
        assert jail.call(f"{PROBES}:python", [{"code": "print(3)"}], 20.0, "timeout") == "3\n"
        assert not os.path.exists(first) and jail.restarts == 1
        parents = [p for p in [_v2_parent(), *_v1_parents().values()] if p is not None]
        assert [f for p in parents for f in p.glob(f"{PREFIX}{warden}-*")] == []
    finally:
        jail.close()
    jail.close()
    kept = os.open(os.devnull, os.O_RDONLY)  # takes a number the jail's pipes had
    try:
        jail.close()
        os.fstat(kept)  # still open
    finally:
        os.close(kept)


def test_with_the_network_allowed_names_resolve_and_a_package_reads_its_own_modules(tmp_path):
    """rewards.network=allow: localhost resolves (the resolver's files are readable). A reward in a
    package imports a module of its package lazily, in the call (the package's folder is readable,
    not the folder it sits in)."""
    package = tmp_path / "myrewards"
    package.mkdir()
    (package / "__init__.py").write_text("def lazy(completion, row):\n    from myrewards import helper\n"
                                         "    return helper.VALUE\n")
    (package / "helper.py").write_text("VALUE = 0.75\n")
    (tmp_path / "answers.txt").write_text("42")
    sys.path.insert(0, str(tmp_path))
    sandbox = RewardSandbox(timeout_s=20.0, limits=JailLimits(network=True), names=["myrewards:lazy"])
    try:
        assert sandbox("myrewards:lazy", "x", {}) == 0.75
        code = "import socket\nscore = float(bool(socket.getaddrinfo('localhost', 80)))"
        assert sandbox(PROBE_REWARD, code, {}) == 1.0
        assert sandbox(PROBE_REWARD, attempts(f"open({str(tmp_path / 'answers.txt')!r}).read()"), {}) == 0.0
    finally:
        sandbox.close()
        sys.path.remove(str(tmp_path))
