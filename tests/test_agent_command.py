"""agent.command (grpo/agent/command.py): your agent as a program, one jailed process per session, the real `openai`
SDK inside it, the HF engine with a tiny model outside. Its turns must be the same tokens an in-process harness gets;
from inside, it must reach its own session's port and nothing else of the run: no other port, no UDP, no file of
the run, no other session; and no process of it outlives its session."""

import socket
import textwrap
import time

import pytest
from episode_helpers import sampling_cfg
from test_agent_runner import chatty_agent, prompts, single_turn  # noqa: F401 (a fixture)

from grpo.common.packages import DATA_PACKAGE, package_folder
from grpo.config import load_config
from grpo.config.rules import command_errors
from grpo.sampler.rollout.hf_engine import HFEngine

ASKS = """
    import json, os, sys
    import openai
    row = json.loads(sys.stdin.readline())
    client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the session
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["question"]}])
"""
POSTS = """
    def post(reward):
        client.post("/reward", body={"reward": reward}, cast_to=object)
"""


def script(tmp_path, body: str, name="agent.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(ASKS) + textwrap.dedent(POSTS) + textwrap.dedent(body))
    return path


def command_run(chatty_agent, command: str, *overrides, group=2, max_new_tokens=12, seed=1, stranger=False):
    """`stranger`: a server of the host's at 127.0.0.2 on the endpoint's port number while the sessions run."""
    from grpo.agent.runner import AgentRunner

    model, tokenizer = chatty_agent
    cfg = load_config(None, [f"agent.command={command}", "data.prefill=", "agent.idle_timeout_s=30",
                             "agent.session_timeout_s=60", *overrides])
    runner = AgentRunner(cfg.agent, tokenizer, max_new_tokens, 256, "policy")
    beside = socket.create_server(("127.0.0.2", runner.server.port)) if stranger else None
    try:
        run = runner.run(HFEngine(model, tokenizer, sampling_cfg(max_new_tokens)), prompts(tokenizer, 1), group,
                         seed=seed)
        left = processes_left(runner.harnesses.fn, group)
    finally:
        runner.close()
        if beside is not None:
            beside.close()
    return run, left


def processes_left(command, sessions: int) -> list[list[str]]:
    """Each kept warden's child processes (none: every session's processes ended with it); each warden alive and
    back in the pool (a killed command's jail comes back a moment after its kill)."""
    deadline = time.monotonic() + 5
    while len(command._idle) < sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    wardens = [jail._process for jail in command._idle]
    assert len(wardens) == sessions and all(warden.poll() is None for warden in wardens)
    return [open(f"/proc/{w.pid}/task/{w.pid}/children").read().split() for w in wardens]


def test_a_commands_turns_are_the_tokens_an_in_process_harness_gets_and_its_posted_reward_scores(chatty_agent,
                                                                                                 tmp_path):
    from test_agent_runner import run_agent

    agent = script(tmp_path, "post(0.25 if row['reference_answer'] in (reply.choices[0].message.content or '') "
                             "else 0.75)\n")
    run, left = command_run(chatty_agent, f"python {agent}", max_new_tokens=40)
    native = run_agent(chatty_agent, single_turn)
    assert [p.token_ids for p in run.prompts] == [p.token_ids for p in native.prompts]
    assert [(e.tokens, e.model, e.logps) for e in run.episodes] == [(e.tokens, e.model, e.logps)
                                                                    for e in native.episodes]
    assert [e.reward for e in run.episodes] == [0.25 if e.reward == 1.0 else 0.75 for e in native.episodes]
    assert left == [[]] * len(left)  # both sessions' processes gone with them


PROBES = """
    reached = []
    other_port, secret = int(sys.argv[1]), sys.argv[2].split("=", 1)[1]
    def probe(name, fn):
        try:
            fn()
            reached.append(name)
        except Exception:
            pass
    probe("other port", lambda: socket.create_connection(("127.0.0.1", other_port), timeout=2))
    endpoint_port = int(os.environ["OPENAI_BASE_URL"].split(":")[2].split("/")[0])
    probe("endpoint's port elsewhere", lambda: socket.create_connection(("127.0.0.2", endpoint_port), timeout=2))
    probe("endpoint's port on ::1", lambda: socket.create_connection(("::1", endpoint_port), timeout=2))
    probe("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", other_port)))
    probe("unix socket", lambda: socket.socket(socket.AF_UNIX))
    probe("bind", lambda: socket.socket().bind(("127.0.0.1", 0)))
    probe("mptcp", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM, 262).connect(("127.0.0.1", other_port)))
    probe("fast open", lambda: socket.socket().sendto(b"x", socket.MSG_FASTOPEN, ("127.0.0.1", other_port)))
    probe("listen", lambda: socket.socket().listen())
    probe("run file", lambda: open(secret).read())
    probe("run folder", lambda: os.listdir(os.path.dirname(secret)))
    probe("data", lambda: open(sys.argv[3].split("=", 1)[1], "rb").read(10))
    other = openai.OpenAI(api_key="not-mine", max_retries=0)
    probe("other key", lambda: other.chat.completions.create(model="policy", messages=[{"role": "user",
                                                                                       "content": "hi"}]))
    probe("own key elsewhere", lambda: openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"].replace(
        os.environ["OPENAI_API_KEY"], "x" * 43), max_retries=0).models.list())
    probe("environment", lambda: [os.environ[k] for k in ("SECRET_OF_THE_RUN",)])
    print("reached:", reached)
    post(len(reached) + (0.5 if open(sys.argv[0]).read() else 0))  # its own script it may read
"""


def test_from_inside_a_command_reaches_its_own_session_and_nothing_else_of_the_run(chatty_agent, tmp_path,
                                                                                    monkeypatch):
    secret = tmp_path / "run" / "reference_answers.jsonl"
    secret.parent.mkdir()
    secret.write_text('{"answer": 7}\n')
    monkeypatch.setenv("SECRET_OF_THE_RUN", "s3cret")
    dataset = next(p for p in (package_folder(DATA_PACKAGE) / "embedded").rglob("*") if p.is_file())
    assert dataset.read_bytes()[:10]  # here it can be read
    agent = script(tmp_path, "import socket\n" + textwrap.dedent(PROBES))
    with socket.create_server(("127.0.0.1", 0)) as other:  # the trainer's port, say
        run, left = command_run(chatty_agent, f"python {agent} {other.getsockname()[1]} --secret={secret} "
                                              f"--data={dataset}", group=1, stranger=True)
    assert [e.reward for e in run.episodes] == [0.5]  # nothing reached; it read its own script and posted
    assert not any(e.environment_failed for e in run.episodes)
    assert left == [[]]


OUTPUT_PROBES = """
    import subprocess
    print("the key is", os.environ["OPENAI_API_KEY"], flush=True)  # as a harness's log line may show it
    child = (
        "import glob, os, sys\\n"
        "found = 0\\n"
        "for path in ['/proc/self/fd/2', f'/proc/{os.getppid()}/fd/1', '.output',\\n"
        "             *glob.glob('*output*'), *glob.glob('../*output*'), *glob.glob('/tmp/*/*output*')]:\\n"
        "    try:\\n"
        "        found += sys.argv[1] in open(path, errors='replace').read()\\n"
        "    except OSError:\\n"
        "        pass\\n"
        "print(found)\\n")
    seen = subprocess.run([sys.executable, "-c", child, os.environ["OPENAI_API_KEY"]], stdout=subprocess.PIPE,
                          text=True).stdout
    post(float(seen.strip() or -1))
"""


def test_what_a_command_prints_cannot_be_read_back_by_a_process_it_starts(chatty_agent, tmp_path):
    """Its output goes to a file beside its jail folder, written through a descriptor: a process of the model's code
    cannot read a key the harness printed (an OpenAI client's log line holds the session's URL)."""
    agent = script(tmp_path, OUTPUT_PROBES)
    run, left = command_run(chatty_agent, f"python {agent}", group=1)
    assert [e.reward for e in run.episodes] == [0.0]  # it ran, and read the key nowhere
    assert left == [[]]


def test_the_jails_outlive_their_sessions_and_serve_the_next_steps(chatty_agent, tmp_path):
    from grpo.agent.runner import AgentRunner

    folder = tmp_path / "my_agent"  # the script and a module beside it, readable through agent.readable
    folder.mkdir()
    (folder / "scoring.py").write_text("def score(text):\n    return 0.5\n")
    agent = script(folder, "from scoring import score\npost(score(reply.choices[0].message.content))\n")
    model, tokenizer = chatty_agent
    cfg = load_config(None, [f"agent.command=python {agent}", f"agent.readable=[{folder}]", "data.prefill="])
    runner = AgentRunner(cfg.agent, tokenizer, 12, 256, "policy")
    engine = HFEngine(model, tokenizer, sampling_cfg(12))
    try:
        first = runner.run(engine, prompts(tokenizer, 1), 2, seed=1)
        wardens = sorted(jail._process.pid for jail in runner.harnesses.fn._idle)
        second = runner.run(engine, prompts(tokenizer, 1), 2, seed=2)
        assert sorted(jail._process.pid for jail in runner.harnesses.fn._idle) == wardens  # the same two, kept
        assert processes_left(runner.harnesses.fn, 2) == [[], []]
        kept = list(runner.harnesses.fn._idle)
    finally:
        runner.close()
    assert [e.reward for e in first.episodes + second.episodes] == [0.5] * 4
    assert all(jail.closed and jail._process is None for jail in kept)  # closed with the runner


def test_a_command_that_never_ends_is_killed_with_its_children_at_its_session_time(chatty_agent, tmp_path):
    agent = script(tmp_path, "import subprocess, time\nsubprocess.Popen(['sleep', '3600'])\ntime.sleep(3600)\n")
    # room for two jailed interpreters importing openai at once on a loaded machine before their first request
    run, left = command_run(chatty_agent, f"python {agent}", "agent.session_timeout_s=15", "agent.idle_timeout_s=12")
    assert all(e.environment_failed and "agent.session_timeout_s=15" in e.env_error for e in run.episodes)
    assert all(all(e.model) for e in run.episodes)  # its turn was received: kept, scored as failed
    assert left == [[]] * len(left)


def test_a_command_that_exits_otherwise_than_0_fails_its_session_and_keeps_the_turn_it_received(chatty_agent,
                                                                                                tmp_path):
    # what it posted is dropped: a process of the model's code in its jail may have posted it, then killed it
    agent = script(tmp_path, "post(0.5)\nsys.exit(3)\n")
    run, _ = command_run(chatty_agent, f"python {agent}")
    assert [e.env_error for e in run.episodes] == ["the agent command exited with status 3 (its output is in the "
                                                   "sampler's log, marked [jailed call])"] * 2
    assert [e.reward for e in run.episodes] == [None, None]
    assert all(all(e.model) for e in run.episodes)


def test_an_agent_may_read_its_own_folders_and_nothing_of_the_runs(tmp_path):
    from grpo.config.rules import readable_errors, run_paths

    for name in ("run/spool", "cache", "mine/agent", "data"):
        (tmp_path / name).mkdir(parents=True)
    cfg = load_config(None, ["agent.command=python a.py", "data.prefill=", f"run.dir={tmp_path / 'run'}",
                             f"model.cache_dir={tmp_path / 'cache'}", f"data.path={tmp_path / 'data'}"])
    protected = run_paths(cfg)
    assert readable_errors([str(tmp_path / "mine" / "agent")], protected) == []
    assert [e.split(" (")[0] for e in readable_errors([str(tmp_path / "run" / "spool"), str(tmp_path / "cache"),
                                                       str(tmp_path), str(tmp_path / "data")], protected)] == [
        f"agent.readable: '{tmp_path / 'run' / 'spool'}' is in the run folder",
        f"agent.readable: '{tmp_path / 'cache'}' is in the model cache",
        f"agent.readable: '{tmp_path}' holds the run folder",
        f"agent.readable: '{tmp_path / 'data'}' is in the dataset"]


def test_the_command_line_is_checked_at_start(tmp_path):
    assert command_errors("python agent.py") == []
    assert command_errors("no-such-program --x") == ["agent.command runs 'no-such-program', which is no program on "
                                                      "PATH nor an executable file"]
    assert command_errors("python 'unclosed") == ["agent.command is not a command line (No closing quotation): "
                                                   "\"python 'unclosed\""]
    with pytest.raises(Exception, match="agent.readable: '.' holds the run folder"):
        load_config(None, ["agent.command=python a.py", "agent.readable=[.]", "data.prefill="])
    with pytest.raises(Exception, match="agent.entrypoint and agent.command are both set"):
        load_config(None, ["agent.command=python a.py", "agent.entrypoint=a:b", "data.prefill="])
