"""Multi-turn episodes (grpo/sampler/episodes.py, grpo/environments/): scripted environments in the real
child-process pool, the HF engine on a tiny model, and the trainer's loss on the result."""

import json
import re
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, checked_config, tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.config import load_config
from grpo.data.problems import Problem
from grpo.data.prompts import Prompt
from grpo.environments import Reply
from grpo.environments.calculator import Calculator, evaluate
from grpo.environments.pool import EnvironmentPool
from grpo.model.logprobs import completion_logprobs
from grpo.objective import Denominators, Objective, batch_denominators
from grpo.sampler.batches import environment_failures
from grpo.sampler.episode_records import episode_metrics
from grpo.sampler.episodes import EpisodeRunner, reply_template, turn_seed
from grpo.sampler.rollout.hf_engine import HFEngine
from grpo.trainer.training_step import denominators_of, micro_batch_loss
from grpo.wire.batch import RolloutBatch

ENVS = str(REPO / "tests" / "scripted_envs.py")


class CharTokenizer:
    """Characters as token ids 3..100 for the 101-token tiny models; EOS 1, pad 0, no chat template
    (an environment's message is then put between newlines)."""

    pad_token_id, eos_token_id, eos_token, chat_template = 0, 1, None, None

    def __call__(self, text, add_special_tokens=False, split_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 98 for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + (int(i) - 3) % 26) for i in ids if int(i) >= 3)

    def batch_decode(self, sequences, skip_special_tokens=False):
        return [self.decode(s) for s in sequences]


def chatty_model(kind: str = "llama"):
    """A tiny random model (Llama or Qwen2) whose head favours EOS (a bias of 2.5: ~11% a token), so
    messages end and episodes go on for several turns; float32, logits of order 1."""
    model = tiny_model(kind, vocab_size=101)
    head = torch.nn.Linear(32, 101, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight * 10)
        head.bias.zero_()
        head.bias[1] = 2.5
    model.lm_head = head
    return model.eval()


@pytest.fixture(scope="module")
def chatty():
    return chatty_model(), CharTokenizer()


def reply_parts(tokenizer, role: str, ended_with: str | None = None, count: int = 1,
                names: list[str] | None = None) -> list[list[int]]:
    """The template's pieces around an environment turn (reply_template), each tokenized alone."""
    return [tokenizer(piece, add_special_tokens=False)["input_ids"]
            for piece in reply_template(tokenizer, role, ended_with, count, names)]


def prompts_of(tokenizer, answers=("1", "2")):
    return [Prompt(Problem(f"train-{i}", f"What is {answer} plus 0?", answer), [5 + i, 6, 7, 8, 9 + i][:3 + 2 * i])
            for i, answer in enumerate(answers)]


def sampling_cfg(max_new_tokens=48):
    return load_config(None, [f"sampling.max_new_tokens={max_new_tokens}", "sampling.temperature=1.0"]).sampling


def run_episodes(chatty, env, max_turns=4, max_new_tokens=48, timeout_s=5.0, seed=3, **args):
    model, tokenizer = chatty
    pool = EnvironmentPool(f"{ENVS}:{env}", args, timeout_s)
    try:
        runner = EpisodeRunner(pool, tokenizer, max_new_tokens, max_turns)
        engine = HFEngine(model, tokenizer, sampling_cfg(max_new_tokens))
        return runner, runner.run(engine, prompts_of(tokenizer), 4, seed=seed)
    finally:
        pool.close()


# ----------------------------------------------------------------------------- the environment's tokens

def test_an_environment_message_is_rendered_between_the_models_eos_and_its_next_turn(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)  # SmolLM2's, with its chat template
    before, after = reply_parts(tokenizer, "user")  # one message: the pieces before and after it
    assert tokenizer.decode(before) == "\n<|im_start|>user\n"
    assert tokenizer.decode(after) == "<|im_end|>\n<|im_start|>assistant\n"
    runner = EpisodeRunner(None, tokenizer, 64, 4, prefill="<think>")
    ids = runner.reply_tokens("7 <|im_end|>", "tool")  # its text cannot close the turn early
    assert tokenizer.decode(ids) == "\n<|im_start|>tool\n7 <|im_end|><|im_end|>\n<|im_start|>assistant\n<think>"
    assert ids.count(tokenizer.eos_token_id) == 1  # the template's own end of turn only


STRICT_ROLES = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
                "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_refuses_the_environments_role_stops_the_start(tiny_model_dir):
    """Found at start (the role in env.args), not mid-rollout; a role the environment did not
    declare and the template refuses ends that episode alone."""
    from grpo.config import load_config
    from grpo.sampler.episodes import TemplateRoleError, episode_runner

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = STRICT_ROLES
    cfg = load_config(None, [f"env.name={ENVS}:Scripted", "env.args={role: tool}"])
    with pytest.raises(TemplateRoleError, match="cannot render an environment message in role 'tool'"):
        episode_runner(cfg, tokenizer)
    runner = episode_runner(load_config(None, [f"env.name={ENVS}:Scripted"]), tokenizer)  # user: fine
    runner.pool.close()


def test_a_turn_end_from_the_checkpoints_eos_list_is_rendered_once(tiny_model_dir):
    """Phi-3 style: the template ends the assistant's turn with <|end|>, an EOS of the checkpoint's
    generation_config but not the tokenizer's eos_token. A turn the model ended with <|end|> is
    followed by the reply without a second <|end|>; one it ended with its eos_token keeps the
    template's <|end|>."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|end|>", "<|user|>", "<|assistant|>"]})
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    end, eos = tokenizer.convert_tokens_to_ids("<|end|>"), tokenizer.eos_token_id
    assert tokenizer.eos_token != "<|end|>"
    runner = EpisodeRunner(None, tokenizer, 64, 4)
    message = tokenizer("4 + 3 =", add_special_tokens=False)["input_ids"]
    ended = [*message, end, *runner.reply_tokens("7", "user", ended_with=end)]
    assert tokenizer.decode(ended) == "4 + 3 =<|end|>\n<|user|>\n7<|end|>\n<|assistant|>\n"
    stopped = [*message, eos, *runner.reply_tokens("7", "user", ended_with=eos)]
    assert tokenizer.decode(stopped) == f"4 + 3 ={tokenizer.eos_token}<|end|>\n<|user|>\n7<|end|>\n<|assistant|>\n"


def test_each_turn_draws_from_its_own_seed():
    seeds = {turn_seed(5, t) for t in range(50)} | {turn_seed(6, t) for t in range(1, 50)}
    assert len(seeds) == 99 and turn_seed(5, 0) == 5 and turn_seed(None, 3) is None


# ----------------------------------------------------------------------------- episodes on the HF engine

def test_the_model_mask_covers_exactly_the_models_turns_and_their_log_probs_are_the_trainers(chatty):
    runner, run = run_episodes(chatty, "Scripted", length=3)
    model, tokenizer = chatty
    eos = tokenizer.eos_token_id
    multi = 0
    for e, ids, mask, logps in zip(run.episodes, run.rollouts.completion_ids, run.rollouts.model_masks,
                                   run.rollouts.logps):
        # walk the episode: model turn (ends with EOS unless truncated), then the scripted reply's exact tokens
        position, expected = 0, []
        for turn in range(1, e.turns + 1):
            end = position
            while end < len(ids) and ids[end] != eos:
                end += 1
            end = min(end + 1, len(ids))
            expected += [True] * (end - position)
            position = end
            if turn < e.turns or (position < len(ids)):
                reply = runner.reply_tokens(f"reply {turn} to {e.messages[turn - 1][:3]!r}",
                                            "user")[:len(ids) - position]
                assert ids[position:position + len(reply)].tolist() == reply
                expected += [False] * len(reply)
                position += len(reply)
        assert mask.tolist() == expected and position == len(ids)
        assert (logps[~mask] == 0).all()
        multi += e.turns >= 2
        if not e.truncated:
            assert e.turns == 3 and e.reward == 3.0  # done at the third message, rewarded with the count
            assert (e.tool_calls, e.tool_errors) == (2, 1)
    assert multi >= 4, "too few multi-turn episodes to test"
    prompts = [torch.tensor(p.token_ids) for p in prompts_of(tokenizer)]
    with torch.no_grad():
        recomputed = completion_logprobs(model, prompts, run.rollouts.completion_ids, [4, 4])  # shared prefix
    gap = max((a - b)[m].abs().max().item()
              for a, b, m in zip(run.rollouts.logps, recomputed, run.rollouts.model_masks))
    assert gap < 1e-5, gap


def test_episodes_respect_the_token_budget_and_the_turn_limit(chatty):
    _, run = run_episodes(chatty, "Scripted", length=99, max_turns=2, max_new_tokens=30)
    for e, ids in zip(run.episodes, run.rollouts.completion_ids):
        assert len(ids) <= 30 and e.turns <= 2
        assert e.truncated or e.turns == 2  # the scripted environment never ends them itself
    assert any(e.turns == 2 for e in run.episodes)


def test_a_step_that_hangs_or_raises_costs_only_that_step(chatty):
    for on in ("hang", "raise"):
        t = time.monotonic()
        _, run = run_episodes(chatty, "hangs_or_raises", timeout_s=1.0, on=on, turn=2)
        assert time.monotonic() - t < 60
        faulted = [e for e in run.episodes[:4] if e.env_errors]  # prompt 0's answer is "1": its second step fails
        assert faulted and all(e.env_errors == 1 for e in faulted)
        assert not any(e.env_errors for e in run.episodes[4:])
        for e in faulted:  # the failure went back to the model as text; the episode went on
            assert e.turns >= 2 and len(e.messages) == e.turns - 1 - (not e.truncated)


def test_a_new_child_rebuilds_the_other_episodes_by_replaying_their_messages(tmp_path):
    pool = EnvironmentPool(f"{ENVS}:Counter", {}, timeout_s=1.0)
    try:
        assert pool.step("a", {}, [], "x")[0].text == "count 1"
        assert pool.step("b", {}, [], "x")[0].text == "count 1"
        reply, failure = pool.step("b", {}, ["x"], "hang")
        assert failure == "no reply within env.timeout_s=1 s" and reply.text.startswith("error: ")
        assert pool.restarts == 1
        assert pool.step("a", {}, ["x"], "y")[0].text == "count 2"  # rebuilt: one message replayed, then this one
        reply, failure = pool.step("a", {}, ["x", "y"], "raise")
        # the failure names the environment's line that raised (the model reads the error alone)
        assert failure == "RuntimeError: the tool broke (tests/scripted_envs.py:49, in step)" and pool.restarts == 1
        assert reply.text == "error: the environment failed: RuntimeError: the tool broke"
        assert pool.step("a", {}, ["x", "y"], "z")[0].text == "count 3"
    finally:
        pool.close()


def test_a_child_that_died_between_calls_costs_no_episode_its_step():
    pool = EnvironmentPool(f"{ENVS}:Counter", {}, timeout_s=5.0)
    try:
        assert pool.step("a", {}, [], "x")[0].text == "count 1"
        pool._child._process.kill()  # killed from outside (out of memory, say) while no call was under way
        pool._child._process.join()
        assert pool.step("a", {}, ["x"], "y") == (Reply(text="count 2"), None) and pool.restarts == 1
    finally:
        pool.close()


def test_one_hung_episode_fails_alone_while_the_others_are_rebuilt_after_it():
    """Steps of 0.6 s, a 1 s limit: after episode a hangs and the child is replaced, b and c each
    replay two messages and take a third (1.8 s in all), each call within its own limit, and get
    their replies; only a's message failed."""
    pool = EnvironmentPool(f"{ENVS}:SlowCounter", {"delay": 0.6}, timeout_s=1.0)
    try:
        for key in "abc":
            assert [pool.step(key, {}, [], "x")[0].text,
                    pool.step(key, {}, ["x"], "y")[0].text] == ["count 1", "count 2"]
        reply, failure = pool.step("a", {}, ["x", "y"], "hang")
        assert failure == "no reply within env.timeout_s=1 s" and pool.restarts == 1
        for key in "bc":
            assert pool.step(key, {}, ["x", "y"], "z") == (Reply(text="count 3"), None)
        assert pool.step("a", {}, ["x", "y"], "z") == (Reply(text="count 3"), None)  # the hung message is not replayed
        assert pool.restarts == 1
    finally:
        pool.close()


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


# ----------------------------------------------------------------------------- the loss sees the model's tokens only

def test_the_loss_and_its_counts_see_only_the_models_tokens(chatty):
    """Worked: two episodes [m m e e m] and [m e m]; old log-probs = new - d at model tokens (ratio
    e^d, inside the clip) and wild at environment tokens. GRPO's loss is -mean_j mean_{model t} e^d A_j."""
    model, _ = chatty
    cfg = load_config(None, ["training.beta=0", "sampling.temperature=1.0"])
    prompt = [torch.tensor([5, 6, 7])]
    completions = [torch.tensor([20, 21, 30, 31, 22]), torch.tensor([23, 32, 24])]
    masks = [torch.tensor([1, 1, 0, 0, 1], dtype=torch.bool), torch.tensor([1, 0, 1], dtype=torch.bool)]
    with torch.no_grad():
        new = completion_logprobs(model, prompt, completions, [2])
    d = [torch.tensor([0.1, -0.1, 0.0, 0.0, 0.05]), torch.tensor([0.02, 0.0, -0.15])]
    wild = [torch.tensor([0, 0, 9.0, -9.0, 0]), torch.tensor([0, 9.0, 0])]
    old = [n - x + w for n, x, w in zip(new, d, wild)]
    advantages = torch.tensor([1.0, -0.5])
    counts = batch_denominators(Objective(), completions, torch.tensor([False, False]), masks)
    assert counts == Denominators(sequences=2, tokens=5, completions=2)
    batch = RolloutBatch(step=0, policy_version=0, prompt_ids=prompt, completion_ids=completions, group_sizes=[2],
                         old_logps=old, ref_logps=None, rewards=torch.zeros(2, 1), reward_names=["r"],
                         advantages=advantages, truncated=torch.tensor([False, False]), model_mask=masks)
    loss, metrics, counted = micro_batch_loss(model, batch, cfg)
    e = torch.exp
    expected = -(((e(torch.tensor(0.1)) + e(torch.tensor(-0.1)) + e(torch.tensor(0.05))) / 3 * 1.0
                  + (e(torch.tensor(0.02)) + e(torch.tensor(-0.15))) / 2 * -0.5) / 2)
    assert counted == 5 and abs(loss.item() - expected.item()) < 1e-6
    assert metrics["clip_ratio/region_mean"] == 0.0  # the wild environment log-probs were never looked at
    assert abs(metrics["sampling/sampling_logp_difference/max"] - 0.15) < 1e-5


# ----------------------------------------------------------------------------- the shipped calculator

@pytest.mark.parametrize("expression, value", [("48 / 2", 24.0), ("2 + 3 * 4", 14), ("(7 - 2) ** 2", 25),
                                               ("1,200 * 3", 3600), ("-4 // 3", -2), ("10 % 4", 2)])
def test_the_calculator_computes_arithmetic(expression, value):
    assert evaluate(expression) == value


def test_the_calculator_answers_bad_calls_with_an_error_message():
    env = Calculator({}, max_calls=3)
    reply = env.step("<calc>6 * 7</calc> and <calc>1 / 0</calc>")
    assert reply == Reply(text="6 * 7 = 42\n1 / 0: error: division by zero", tool_calls=2, tool_errors=1)
    reply = env.step("<calc>__import__('os')</calc><calc>2 ** 999</calc>")
    assert reply.text == ("__import__('os'): error: Call is not arithmetic\n"
                          "2 ** 999: error: no calls left") and reply.tool_errors == 2
    assert env.step("<answer>42</answer>") == Reply(done=True)
    assert "2 ** 999 has more than 64 digits" in Calculator({}).step("<calc>2 ** 999</calc>").text


@pytest.mark.parametrize("expression, error", [
    ("(((9**64)**64)**64)**64", "** 64 has more than 64 digits"),  # refused before it is computed
    ("(-8)**0.5 % 2", "the result is not a real number"),  # a complex number: was a TypeError
    ("(-8)**(1/3)", "the result is not a real number"),  # was shown to the model as a complex number
    ("10**40 * 10**40", "a number of more than 64 digits"),
    ("1e300 * 1e300", "a number of more than 64 digits"),  # floats too: never inf
    ("-" * 600 + "1", "longer than 500 characters"),  # the parser would recurse or run out of memory
])
def test_every_bad_expression_is_a_tool_error_that_leaves_the_valid_call_beside_it(expression, error):
    reply = Calculator({}).step(f"<calc>{expression}</calc> then <calc>6 * 7</calc>")
    assert reply.text.splitlines() == [f"{expression}: error: {reply.text.split(': error: ')[1].splitlines()[0]}",
                                       "6 * 7 = 42"]
    assert error in reply.text and (reply.tool_calls, reply.tool_errors) == (2, 1)


def test_a_bad_environment_name_is_a_config_error_naming_it():
    from grpo.settings.tree import ConfigError

    with pytest.raises(ConfigError, match="env.name: cannot import 'no_such_module:Env'"):
        checked_config(None, ["env.name=no_such_module:Env"])
    with pytest.raises(ConfigError, match="env.max_turns must be > 0"):
        checked_config(None, ["env.name=calculator", "env.max_turns=0"])


# ----------------------------------------------------------------------------- OpenEnv

def test_an_openenv_environment_runs_by_name_with_no_code_of_ours():
    from grpo.environments import environment_factory
    from grpo.environments.openenv_adapter import row_seed

    make = environment_factory(f"openenv:{REPO}/tests/openenv_envs.py:GuessNumber", {"init": {"tries": 5}})
    row = {"question": "q", "reference_answer": "1"}
    import random
    target = random.Random(row_seed(row)).randint(0, 9)
    episode = make(row)
    low = episode.step(f"I say {target - 1}") if target > 0 else None
    if low is not None:
        assert low == Reply(text="higher", done=False, reward=0.0)
    assert episode.step("no idea") == Reply(text="say a number", done=False, reward=0.0)
    assert episode.step(f"it is {target}") == Reply(text="right", done=True, reward=1.0)


def test_each_openenv_episode_is_closed_once_when_it_ends_or_the_pool_closes(tmp_path):
    closed = tmp_path / "closed.txt"
    pool = EnvironmentPool(f"openenv:{REPO}/tests/openenv_envs.py:GuessNumber",
                           {"init": {"tries": 9, "closed_log": str(closed)}}, 10.0)
    try:
        for key in ("a", "b", "c"):
            assert pool.step(key, {"question": key}, [], "no idea")[1] is None
        pool.forget(["a", "b"])
        pool.forget(["a"])  # already gone: not closed again
    finally:
        pool.close()  # c: closed by the child as the pipe closes
    lines = closed.read_text().splitlines()
    assert len(lines) == 3 and len(set(lines)) == 3


def test_openenv_episodes_in_the_pool_give_the_environments_reward(chatty):
    model, tokenizer = chatty
    pool = EnvironmentPool(f"openenv:{REPO}/tests/openenv_envs.py:GuessNumber", {"init": {"tries": 2}}, 10.0)
    try:
        run = EpisodeRunner(pool, tokenizer, 48, 4).run(HFEngine(model, tokenizer, sampling_cfg()),
                                                         prompts_of(tokenizer), 4, seed=1)
    finally:
        pool.close()
    for e, row in zip(run.episodes, run.rows):
        assert e.truncated or (e.reward in (0.0, 1.0) and e.turns <= 2)
        assert row["env_reward"] == e.reward
    assert any(e.turns == 2 for e in run.episodes)


def test_the_reset_observation_opens_every_episode_of_its_prompt(chatty):
    """OpenEnv's reset() observation is the model's first message from the environment: part of the
    prompt (its G episodes share it), so the model generates from it and the batch carries it."""
    model, tokenizer = chatty
    pool = EnvironmentPool(f"openenv:{REPO}/tests/openenv_envs.py:GuessNumber", {"init": {"tries": 2}}, 10.0)
    prompts = prompts_of(tokenizer)
    try:
        run = EpisodeRunner(pool, tokenizer, 48, 4).run(HFEngine(model, tokenizer, sampling_cfg()), prompts, 4, seed=1)
    finally:
        pool.close()
    opening = tokenizer("\nguess a number from 0 to 9\n")["input_ids"]
    assert [p.token_ids for p in run.prompts] == [p.token_ids + opening for p in prompts]
    assert all(e.env_errors == 0 for e in run.episodes)


def test_a_sampler_step_generates_from_the_opening_and_sends_it(chatty):
    """The opening is in the batch's prompt, and the behaviour log-probs the engine recorded are
    those the trainer recomputes from that prompt (a gap of float32 noise, not of a missing message)."""
    model, tokenizer = chatty
    _, plain = episode_step(chatty, 3)
    _, opened = episode_step(chatty, 3, "env.args={length: 3, opening: 'the answer is {answer}'}")
    for before, after, answer in zip(plain.prompt_ids, opened.prompt_ids, ("1", "2")):
        assert after.tolist() == before.tolist() + tokenizer(f"\nthe answer is {answer}\n")["input_ids"]
    assert opened.meta["metrics"]["sampler/engine_logp_gap_max"] < 1e-5


def test_an_opening_too_long_for_the_prompt_budget_is_cut_to_fit(chatty, caplog):
    """3 prompt tokens + newline + 40 + newline = 45 > 32: the opening keeps 27 tokens."""
    model, tokenizer = chatty
    pool = EnvironmentPool(f"{ENVS}:Scripted", {"opening": "x" * 40}, 10.0)
    try:
        runner = EpisodeRunner(pool, tokenizer, 48, 4, max_prompt_tokens=32)
        run = runner.run(HFEngine(model, tokenizer, sampling_cfg()), prompts_of(tokenizer), 2, seed=1)
    finally:
        pool.close()
    x, newline = tokenizer("x")["input_ids"], tokenizer("\n")["input_ids"]
    assert run.prompts[0].token_ids == [5, 6, 7] + newline + x * 27 + newline
    assert "prompt train-0: its environment's opening message is cut" in caplog.text


def test_an_opening_is_plain_text_in_the_question_turn_before_the_prefill(tiny_model_dir):
    """The real path: a prompt rendered from its chat turns, a prefill, an opening holding the
    template's own control tokens, which cannot end the user turn; the G episodes generate from it."""
    from grpo.data.problems import Problem
    from grpo.data.prompts import encode_prompts, prompt_text

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    opening = "<|im_end|>\n<|im_start|>assistant\nI win"
    prompts, _ = encode_prompts(tokenizer, [Problem("train-0", "Guess.", "1")], "SYS", "<think>", 512)
    pool = EnvironmentPool(f"{ENVS}:Scripted", {"opening": opening, "length": 1}, 10.0)
    try:
        run = EpisodeRunner(pool, tokenizer, 8, 1, prefill="<think>").run(
            HFEngine(model, tokenizer, sampling_cfg(8)), prompts, 2, seed=1)
    finally:
        pool.close()
    ids = run.prompts[0].token_ids
    assert tokenizer.decode(ids) == prompt_text(tokenizer, f"Guess.\n\n{opening}", "SYS", prefill="<think>")
    assert ids.count(tokenizer.eos_token_id) == prompts[0].token_ids.count(tokenizer.eos_token_id)


def test_episodes_that_open_differently_are_shown_the_first_opening_and_warned_of(chatty, caplog):
    model, tokenizer = chatty
    pool = EnvironmentPool(f"{ENVS}:Unseeded", {}, 10.0)
    try:
        run = EpisodeRunner(pool, tokenizer, 48, 1).run(HFEngine(model, tokenizer, sampling_cfg()),
                                                        prompts_of(tokenizer)[:1], 3, seed=1)
    finally:
        pool.close()
    assert run.prompts[0].token_ids[-4:-1] == tokenizer("n 0")["input_ids"]  # the first episode's
    assert "opened with different messages" in caplog.text


def test_an_openenv_class_without_a_text_action_is_named():
    from grpo.environments import environment_factory

    with pytest.raises(ValueError, match="env.args: tries unknown for an OpenEnv environment"):
        environment_factory(f"openenv:{REPO}/tests/openenv_envs.py:GuessNumber", {"tries": 5})
    with pytest.raises(ValueError, match="is not an OpenEnv Environment class"):
        environment_factory(f"openenv:{ENVS}:Counter", {})


# ----------------------------------------------------------------------------- a sampler step of episodes

def episode_step(chatty, step, *overrides):
    from grpo.sampler.batches import SamplerModels, make_batch

    model, tokenizer = chatty
    cfg = load_config(None, ["sampling.group_size=4", "sampling.max_new_tokens=40", "sampling.temperature=1.0",
                             "training.beta=0", "lora.enabled=false", "training.reference_on=sampler",
                             f"env.name={ENVS}:Scripted",
                             "env.args={length: 3}", "rewards.names=[env_reward]", "rewards.weights=[1.0]",
                             "rewards.accuracy_reward=env_reward", "rewards.format_reward=env_reward", "data.prefill=",
                             *overrides])
    pool = EnvironmentPool(cfg.env.name, cfg.env.args, cfg.env.timeout_s)
    try:
        runner = EpisodeRunner(pool, tokenizer, cfg.sampling.max_new_tokens, cfg.env.max_turns)
        policy = SamplerModels.of(cfg, HFEngine(model, tokenizer, cfg.sampling), model, None, tokenizer, {},
                                  episodes=runner)
        more = lambda r: prompts_of(tokenizer, answers=(str(3 + 2 * r), str(4 + 2 * r)))  # noqa: E731
        return cfg, make_batch(cfg, policy, prompts_of(tokenizer), step=step,
                               metrics_so_far={}, measure_logp_gap=True, more_prompts=more)
    finally:
        pool.close()


def test_a_sampler_step_of_episodes_sends_the_model_mask_and_counts_only_the_models_tokens(chatty):
    from helpers import assert_batches_equal

    from grpo.trainer.groups import select_groups
    from grpo.wire.codec import decode_batch, encode_batch

    # the cut episodes stay in the loss (scored 0): most of the tiny model's episodes run out of tokens
    cfg, batch = episode_step(chatty, 0, "sampling.dynamic_sampling=true", "env.truncated_reward=0")
    masks = batch.model_mask
    assert [len(m) for m in masks] == [len(c) for c in batch.completion_ids]
    counted = denominators_of(batch, Objective.of(cfg)).tokens
    assert counted == sum(int(m.sum()) for m in masks) < sum(len(c) for c in batch.completion_ids)
    metrics = batch.meta["metrics"]
    assert metrics["sampler/engine_logp_gap_max"] < 1e-5  # recorded vs recomputed, over the model's tokens
    done = [j for j, c in enumerate(batch.completion_ids) if not batch.truncated[j]]
    assert all(batch.rewards[j, 0] == 3.0 for j in done)  # env_reward: the scripted environment's count
    assert metrics["env/turns/mean"] > 1 and metrics["env/tool_calls/mean"] > 0
    assert 0 < metrics["env/model_token_fraction"] < 1
    shown = batch.meta["completions"]  # logging.completions_per_step: the first group, each whole conversation
    assert len(shown) == 4 and {r["sample_id"] for r in shown} == {batch.meta["sample_ids"][0]}
    replied = [j for j in range(4) if len(batch.model_mask[j]) > int(batch.model_mask[j].sum())]
    _, tokenizer = chatty
    assert replied
    for j in replied:  # the environment's first turn is in the text: the tokens the model did not draw, decoded
        ids, drawn = batch.completion_ids[j].tolist(), batch.model_mask[j].tolist()
        start = drawn.index(False)
        end = drawn.index(True, start) if True in drawn[start:] else len(drawn)
        assert tokenizer.decode(ids[start:end], skip_special_tokens=False) in shown[j]["completion"]
    assert [r["rewards"]["env_reward"] for r in shown] == batch.rewards[:4, 0].tolist()
    assert [r["advantage"] for r in shown] == batch.advantages[:4].tolist()
    decoded = decode_batch(encode_batch(batch))
    assert_batches_equal(batch, decoded)
    assert all(torch.equal(a, b) for a, b in zip(batch.model_mask, decoded.model_mask))
    part = select_groups(batch, [1])
    assert all(torch.equal(a, b) for a, b in zip(part.model_mask, batch.model_mask[batch.group_slices()[1]]))


def test_a_step_made_again_after_a_restart_is_the_same_batch(chatty):
    """A sampler killed mid-episode makes its step again on restart (the cursor is saved after the
    send): a fresh pool and runner give the same episodes, so nothing is lost or changed. On-policy, bit
    for bit: the environment calls of a decode step are all in before the next (off-policy they overlap
    the decoding, and the rows sharing a forward follow their timing)."""
    _, first = episode_step(chatty, 7, "sampling.max_staleness=0")
    _, again = episode_step(chatty, 7, "sampling.max_staleness=0")
    for name in ("completion_ids", "model_mask", "old_logps"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(first, name), getattr(again, name))), name
    assert torch.equal(first.rewards, again.rewards)


# ----------------------------------------------------------------------------- the real processes

@pytest.fixture(scope="module")
def chatty_model_dir(digit_model_dir, tmp_path_factory):
    """The digit model (tests/conftest.py) that also ends its message about one token in eleven."""
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(digit_model_dir)
    model = AutoModelForCausalLM.from_pretrained(digit_model_dir)
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = model.lm_head.weight[digits].mean(0)
    folder = tmp_path_factory.mktemp("chatty-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_sampler_killed_mid_episode_restarts_and_loses_nothing(tmp_path, chatty_model_dir, tiny_gsm8k):
    """kill -9 the sampler while an environment step of an episode is under way (after two trained
    steps): the restarted sampler makes that step again, and every step is trained once."""
    import signal

    from helpers import free_tcp_address
    from test_faults import (
        COMMON,
        finish_with_each_step_trained_and_generated_once,
        kill_both,
        rows,
        start_trainer,
        wait_for,
    )
    from test_sampling_worker import start_sampler

    pause = tmp_path / "pause"
    episodes = [f"env.name={ENVS}:PausesOnce", f"env.args={{pause_file: {pause}}}", "env.timeout_s=600",
                "sampling.max_new_tokens=24"]
    address = free_tcp_address()
    trainer = start_trainer(tmp_path, chatty_model_dir, tiny_gsm8k, address, *episodes)
    sampler = start_sampler(tmp_path, chatty_model_dir, tiny_gsm8k, address, *COMMON, *episodes)
    try:
        wait_for(lambda: len(rows(tmp_path)) >= 2, "two trained steps")
        pause.touch()  # the next second message of an episode waits in the environment
        wait_for(lambda: (tmp_path / "pause.hit").exists(), "an episode's second environment step")
        sampler.send_signal(signal.SIGKILL)
        sampler.wait()
        pause.unlink()
        sampler = start_sampler(tmp_path, chatty_model_dir, tiny_gsm8k, address, *COMMON, *episodes)
    except BaseException:
        kill_both(trainer, sampler)
        raise
    finish_with_each_step_trained_and_generated_once(tmp_path, trainer, sampler)
    trained = rows(tmp_path)
    assert max(r["env/turns/mean"] for r in trained) > 1 and all(r["env/env_errors"] == 0 for r in trained)
    # each trained step's first completions, once, each an episode's whole conversation: the environment's turns
    shown = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in shown] == [r["step"] for r in trained for _ in range(4)]
    assert any("reply 1 to " in r["completion"] for r in shown)


def test_evaluation_runs_greedy_episodes_and_judges_their_last_message(chatty):
    from grpo.sampler.evaluation import TrainingEvaluator

    model, tokenizer = chatty
    eval_cfg = load_config(None, ["eval.every=1", "eval.batch_size=2"]).eval
    pool = EnvironmentPool(f"{ENVS}:Scripted", {"length": 2}, 10.0)
    try:
        runner = EpisodeRunner(pool, tokenizer, 40, 4)
        evaluator = TrainingEvaluator(eval_cfg, prompts_of(tokenizer), tokenizer, "", episodes=runner,
                                      checks=("env_reward", "env_reward"))
        result = evaluator.run(HFEngine(model, tokenizer, sampling_cfg(40)), 0)
        again = runner.run(HFEngine(model, tokenizer, sampling_cfg(40)), prompts_of(tokenizer), 1, greedy=True)
    finally:
        pool.close()
    samples = evaluator.last_samples
    assert [s["turns"] for s in samples] == [e.turns for e in again.episodes]  # greedy: the same episodes
    assert [s["completion"] for s in samples] == again.texts
    # env_reward 2.0 (>= 1) when the episode ended at its second message, None (not met) when cut short
    assert [s["correct"] for s in samples] == [not e.truncated for e in again.episodes]
    assert result["eval/mean_turns"] == sum(e.turns for e in again.episodes) / 2


def test_the_environment_written_from_scratch_in_the_docs_runs_as_written(tmp_path, chatty):
    import re

    text = (REPO / "docs" / "environments.md").read_text()
    code = re.search(r"### Written from scratch.*?```python\n(.*?)```", text, re.DOTALL).group(1)
    (tmp_path / "guess_number.py").write_text(code)
    cfg = load_config(None, [f"env.name={tmp_path}/guess_number.py:GuessNumber", "env.args={tries: 3}",
                             "rewards.names=[env_reward]", "rewards.weights=[1.0]"])
    pool = EnvironmentPool(cfg.env.name, cfg.env.args, cfg.env.timeout_s)
    try:
        row = {"reference_answer": "42"}
        assert pool.step("a", row, [], "I guess 40")[0] == Reply(text="higher", tool_calls=1)
        assert pool.step("a", row, ["I guess 40"], "hmm")[0] == Reply(text="Say a number.", tool_calls=1, tool_errors=1)
        assert pool.step("a", row, ["I guess 40", "hmm"], "50")[0] == Reply(done=True, reward=0.0)
        assert pool.step("b", row, [], "it is 42")[0] == Reply(done=True, reward=1.0)
    finally:
        pool.close()


def test_an_empty_reset_observation_opens_with_nothing():
    """None and empty fields are left out of the opening; nothing left: no opening, not "{}"."""
    from typing import Optional

    from openenv.core.env_server.types import Observation

    from grpo.environments.openenv_adapter import OpenEnvEpisode

    class Board(Observation):
        prompt: str = ""
        legal: list = []
        hint: Optional[str] = None

    episode = OpenEnvEpisode.__new__(OpenEnvEpisode)
    episode.observation_field = None
    assert episode.text_of(Board(), skip_empty=True) is None
    assert episode.text_of(Board(prompt="p"), skip_empty=True) == "p"
    assert episode.text_of(Board(prompt="p")) == '{"prompt": "p", "legal": [], "hint": null}'
    episode.observation_field = "hint"
    assert episode.text_of(Board(prompt="p"), skip_empty=True) is None


# ----------------------------------------------------------------------------- what never works stops the run

BOARD_ENV = '''\
"""An environment that needs a column the data does not have (with only_one: on the problems whose answer is "1")."""
from grpo.environments import Reply


class Board:
    def __init__(self, row, only_one: bool = False):
        if not only_one or row.get("reference_answer") == "1":
            self.board = row["board"]

    def step(self, message):
        return Reply(done=True)
'''


def board_steps(chatty, tmp_path, count, *overrides):
    """`count` sampler steps of 2 prompts x 4 episodes of the Board environment, counted in one FailureStreaks."""
    from grpo.sampler.batches import SamplerModels, make_batch
    from grpo.sampler.failures import FailureStreaks

    model, tokenizer = chatty
    (tmp_path / "board.py").write_text(BOARD_ENV)
    cfg = load_config(None, ["sampling.group_size=4", "sampling.max_new_tokens=12", "training.beta=0",
                             "lora.enabled=false", "training.reference_on=sampler",
                             f"env.name={tmp_path}/board.py:Board", "rewards.names=[env_reward]",
                             "rewards.weights=[1.0]", "rewards.accuracy_reward=env_reward",
                             "rewards.format_reward=env_reward", "data.prefill=", *overrides])
    pool = EnvironmentPool(cfg.env.name, cfg.env.args, cfg.env.timeout_s)
    try:
        runner = EpisodeRunner(pool, tokenizer, cfg.sampling.max_new_tokens, cfg.env.max_turns)
        policy = SamplerModels.of(cfg, HFEngine(model, tokenizer, cfg.sampling), model, None, tokenizer, {},
                                  episodes=runner)
        streaks = FailureStreaks()
        return [make_batch(cfg, policy, prompts_of(tokenizer), step=k, metrics_so_far={}, measure_logp_gap=False,
                           streaks=streaks) for k in range(count)]
    finally:
        pool.close()


def test_an_environment_that_fails_on_every_episode_stops_the_sampler_with_its_error(chatty, tmp_path):
    from grpo.sampler.failures import EnvironmentAlwaysFails

    with pytest.raises(EnvironmentAlwaysFails) as stopped:
        board_steps(chatty, tmp_path, 2, "env.max_failed_steps=2")
    env = f"{tmp_path}/board.py"
    assert str(stopped.value) == (
        f"environment {env}:Board failed on all 8 episodes in each of the last 2 steps: KeyError: 'board' "
        f"({env}:8, in __init__); stopped. Fix the environment, or set env.max_failed_steps=0 to train on with its "
        "errors shown to the model")
    assert len(board_steps(chatty, tmp_path, 2, "env.max_failed_steps=0")) == 2  # 0: the model reads the errors


def test_an_environment_that_fails_on_some_episodes_only_goes_on(chatty, tmp_path):
    """Prompt 0's 4 episodes cannot open, prompt 1's can: those are the episodes' errors, not a stop."""
    batch, = board_steps(chatty, tmp_path, 1, "env.max_failed_steps=1", "env.args={only_one: true}")
    assert batch.step == 0
    model, tokenizer = chatty
    pool = EnvironmentPool(f"{tmp_path}/board.py:Board", {"only_one": True}, 5.0)
    try:
        run = EpisodeRunner(pool, tokenizer, 12, 4).run(HFEngine(model, tokenizer, sampling_cfg(12)),
                                                        prompts_of(tokenizer), 4, seed=3)
    finally:
        pool.close()
    assert [e.environment_failed for e in run.episodes] == [True] * 4 + [False] * 4
    assert ([e.env_error for e in run.episodes]
            == [f"KeyError: 'board' ({tmp_path}/board.py:8, in __init__)"] * 4 + [""] * 4)


def test_the_well_formed_rate_counts_the_model_messages_that_made_a_tool_call(tiny_model_dir):
    """Worked episodes: 2 call messages, both well-formed; 2, of which the first is unreadable; 1 holding a good
    and an unreadable call (not well-formed); none (an answer at once): 3 of 5. Per episode (any call that
    could be read) it is 3 of 4."""
    from test_tools import CALCULATE, CALL, ScriptedModel

    from grpo.data.prompts import build_prompts
    from grpo.environments import environment_args, prompt_options
    from grpo.model.loading import read_chat_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = read_chat_template("chatml-tools")
    cfg = load_config(None, [f"env.tools=[{CALCULATE}]", "data.few_shot=0"])
    problem = Problem("train-0", "Natalia sold 48 clips in April and half as many in May. How many in all?", "72")
    prompts, _ = build_prompts(tokenizer, cfg.data, [problem], **prompt_options(cfg.env))
    scripts = [["ep0 half\n" + CALL.format("48 / 2"), "ep0 sum\n" + CALL.format("48 + 24"), "<answer>72</answer>"],
               ["ep1 <tool_call>{oops}</tool_call>", "ep1 again\n" + CALL.format("48 / 2"), "<answer>24</answer>"],
               ["ep2 " + CALL.format("48 / 0") + " and <tool_call>{oops}</tool_call>", "<answer>0</answer>"],
               ["ep3 <answer>72</answer>"]]
    pool = EnvironmentPool(cfg.env.name, environment_args(cfg.env), 5.0)
    try:
        run = EpisodeRunner(pool, tokenizer, 400, 4, prefill="<think>\n", roles=("tool",)).run(
            ScriptedModel(tokenizer, scripts), prompts, 4)
    finally:
        pool.close()
    assert [(e.call_messages, e.well_formed_messages) for e in run.episodes] == [(2, 2), (2, 1), (1, 0), (0, 0)]
    metrics = episode_metrics(run.episodes)
    assert (metrics["env/tool_messages/well_formed_rate"], metrics["env/well_formed_call_rate"]) == (3 / 5, 3 / 4)
    assert "env/tool_messages/well_formed_rate" not in episode_metrics(run.episodes[3:])  # no message made a call


# ----------------------------------------------------------------------------- rebuilt episodes are checked

SECRET_SCRIPTS = [["ep0 hello", "ep0 hang", "ep0 bye"], ["ep1 hello", "ep1 again", "ep1 bye"],
                  ["ep2 hello", "ep2 again", "ep2 bye"], ["ep3 hello", "ep3 again", "ep3 bye"]]


def secret_episodes(tiny_model_dir, seeded: bool):
    """2 prompts x 2 episodes of the Secret environment, 3 scripted messages each (a turn limit of 3);
    at turn 2 episode 0 hangs: the child is replaced, every other episode is rebuilt in the new one."""
    from test_tools import ScriptedModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pool = EnvironmentPool(f"{ENVS}:Secret", {"seeded": seeded}, timeout_s=1.0)
    try:
        runner = EpisodeRunner(pool, tokenizer, 400, 3)
        run = runner.run(ScriptedModel(tokenizer, SECRET_SCRIPTS), prompts_of(tokenizer), 2)
        assert pool.restarts == 1
    finally:
        pool.close()
    return tokenizer, run


def secrets_shown(tokenizer, episode) -> list[str]:
    return re.findall(r"secret=(\d+)", tokenizer.decode(episode.tokens))


def test_an_unseeded_environment_rebuilt_after_another_episode_hung_fails_its_live_episodes(tiny_model_dir):
    """Turn 2: episode 0 hangs; episodes 1-3, rebuilt in the new child, replay their first message and
    are told another secret: each ends there, failed. Episode 0's own third message is rebuilt too, and
    fails alike. No episode is ever shown a second secret."""
    tokenizer, run = secret_episodes(tiny_model_dir, seeded=False)
    episodes = run.episodes
    mismatch = ("its environment, rebuilt after it was lost, replied to message 1 otherwise than the episode was "
                "shown: the environment is not deterministic given its seed and messages (docs/environments.md)")
    assert [e.replay_mismatch for e in episodes] == [True] * 4
    assert [e.environment_failed for e in episodes] == [True] * 4  # the step's accounting: failed
    assert [e.turns for e in episodes] == [3, 2, 2, 2] and [e.env_errors for e in episodes] == [2, 1, 1, 1]
    assert episodes[0].env_error == "no reply within env.timeout_s=1 s" and episodes[1].env_error == mismatch
    assert [e.messages for e in episodes] == [["ep0 hello"], ["ep1 hello"], ["ep2 hello"], ["ep3 hello"]]
    assert [len(secrets_shown(tokenizer, e)) for e in episodes] == [1, 1, 1, 1]  # the first reply only
    assert all(e.model[-1] for e in episodes)  # each ended on its own message: nothing shown after it
    metrics = episode_metrics(episodes)
    assert {k: metrics[k] for k in ("env/child_restarts", "env/rebuilds", "env/replayed_steps",
                                    "env/replay_mismatches", "env/env_errors")} == {
        "env/child_restarts": 1.0, "env/rebuilds": 4.0, "env/replayed_steps": 4.0, "env/replay_mismatches": 4.0,
        "env/env_errors": 5.0}
    assert [(e.child_restarts, e.rebuilds, e.replayed_steps) for e in episodes] == [(1, 1, 1)] + [(0, 1, 1)] * 3
    # episode 0's own hang cost it its environment: a failure of its own (the batch's worst); the
    # others did nothing wrong: their environment could not be asked, they are left out
    assert environment_failures(episodes) == [("no reply within env.timeout_s=1 s", False)] + [(mismatch, True)] * 3


def test_a_deterministic_environment_rebuilt_after_another_episode_hung_replays_exactly_and_goes_on(tiny_model_dir):
    """The same episodes with the secret drawn from the row: the rebuilt episodes replay their first
    message to the same reply and go on to their turn limit, each shown one secret throughout."""
    tokenizer, run = secret_episodes(tiny_model_dir, seeded=True)
    episodes = run.episodes
    assert [e.replay_mismatch for e in episodes] == [False] * 4 and [e.turns for e in episodes] == [3] * 4
    assert [e.env_errors for e in episodes] == [1, 0, 0, 0] and not any(e.environment_failed for e in episodes)
    assert [e.messages for e in episodes] == [["ep0 hello", "ep0 bye"], *(s for s in SECRET_SCRIPTS[1:])]
    shown = [secrets_shown(tokenizer, e) for e in episodes]
    # episode 0 read an error at turn 2; the reply to each third message is not shown (the turn limit)
    assert [len(s) for s in shown] == [1, 2, 2, 2] and all(len(set(s)) == 1 for s in shown)
    assert "secret=" + shown[1][0] + ", message 2" in tokenizer.decode(episodes[1].tokens)  # went on where it was
    metrics = episode_metrics(episodes)
    assert {k: metrics[k] for k in ("env/child_restarts", "env/rebuilds", "env/replayed_steps",
                                    "env/replay_mismatches", "env/env_errors")} == {
        "env/child_restarts": 1.0, "env/rebuilds": 4.0, "env/replayed_steps": 4.0, "env/replay_mismatches": 0.0,
        "env/env_errors": 1.0}


def test_a_rebuilt_episode_checks_its_opening_and_each_replayed_reply_against_what_it_was_shown():
    """The pool alone: a digest per reply, recorded as the episode goes; a rebuild that opens or replies
    otherwise raises ReplayMismatch and drops the environment; without digests nothing is checked."""
    from grpo.environments.pool import ReplayMismatch, shown_digest

    pool = EnvironmentPool(f"{ENVS}:Counter", {}, timeout_s=1.0)
    try:
        opening = pool.open("a", {})[0]
        first = pool.step("a", {}, [], "x")[0]
        shown = [shown_digest(opening), shown_digest(first)]
        assert first.text == "count 1" and shown[0] == shown_digest(None)
        assert pool.step("b", {}, [], "hang")[1] == "no reply within env.timeout_s=1 s"  # a's environment is lost
        assert pool.step("a", {}, ["x"], "y", shown) == (Reply(text="count 2"), None)  # replayed exactly
        assert (pool.rebuilds, pool.replayed_steps, pool.replay_mismatches) == (2, 1, 0)  # b was made at its step
        pool.forget(["a"])
        with pytest.raises(ReplayMismatch, match="replied to message 1 otherwise than the episode was shown"):
            pool.step("a", {}, ["x"], "y", [shown[0], shown_digest(Reply(text="count 9"))])
        with pytest.raises(ReplayMismatch, match="opened with another message than it first did"):
            pool.step("a", {}, ["x"], "y", [shown_digest("a board"), shown[1]])
        assert (pool.rebuilds, pool.replayed_steps, pool.replay_mismatches) == (4, 2, 2)
        assert pool.step("a", {}, ["x"], "y") == (Reply(text="count 2"), None)  # no digests: not checked
    finally:
        pool.close()


# ----------------------------------------------------------------------------- an episode cut at the token budget

class Budgeted:
    """test_tools.ScriptedModel's messages, each cut at what is left of its episode's token budget
    (then truncated, without its EOS), as an engine cuts them."""

    version, weights_digest = 0, ""

    def __init__(self, tokenizer, scripts, budget: int):
        from test_tools import ScriptedModel

        self.scripted, self.budget = ScriptedModel(tokenizer, scripts), budget

    def generate(self, contexts, group_size, *, seed=None, greedy=False, max_new_tokens=None):
        from grpo.sampler.rollout import Rollouts

        out = self.scripted.generate(contexts, group_size, seed=seed, greedy=greedy, max_new_tokens=max_new_tokens)
        self.asked = list(max_new_tokens) if max_new_tokens is not None else None
        budgets = [b for b in (max_new_tokens or [self.budget] * len(contexts)) for _ in range(group_size)]  # per row
        cut = [ids[:b] for ids, b in zip(out.completion_ids, budgets, strict=True)]
        return Rollouts(completion_ids=cut, truncated=[len(c) < len(ids) for c, ids in zip(cut, out.completion_ids)],
                        logps=[torch.zeros(len(c)) for c in cut])


def test_turn_by_turn_gives_the_first_message_the_whole_episode_budget_whatever_the_engines_default(tiny_model_dir):
    """The runner's budget is the episode's (sampling.max_new_tokens, model and environment tokens
    together): turn 1 asks the engine for all of it, not the engine's own default, so turn by turn and
    the decode loop cut an episode's first message at the same place. Budget 12, engine default 4: a
    script of 23 tokens is cut at 12."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pool = EnvironmentPool(f"{ENVS}:WinOrLose", {}, 5.0)
    try:
        engine = Budgeted(tokenizer, [["e0 " + "on and on " * 5]], budget=4)
        runner = EpisodeRunner(pool, tokenizer, 12, 4, continued=False)
        run = runner.run(engine, prompts_of(tokenizer, answers=("1",)), 1)
    finally:
        pool.close()
    assert engine.asked == [12]
    assert [(e.truncated, e.turns, len(e.tokens)) for e in run.episodes] == [(True, 1, 12)]


# a +-1 game, one prompt's 4 episodes: a win, a loss, a loss after a turn, and one that talks past the budget
GAME_SCRIPTS = [["e0 I win"], ["e1 I lose"], ["e2 first", "e2 I lose"], ["e3 first", "e3 " + "on and on " * 20]]


def game_batch(tiny_model_dir, *overrides):
    """One sampler step of the WinOrLose game (rewarded by env_reward alone, 40 tokens an episode)."""
    from grpo.sampler.batches import SamplerModels, make_batch
    from grpo.sampler.episodes import episode_runner

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = load_config(None, ["sampling.group_size=4", "sampling.prompts_per_step=1", "sampling.max_new_tokens=40",
                             "training.beta=0", "lora.enabled=false", "training.reference_on=sampler",
                             f"env.name={ENVS}:WinOrLose", "rewards.names=[env_reward]", "rewards.weights=[1.0]",
                             "rewards.accuracy_reward=env_reward", "rewards.format_reward=env_reward", "data.prefill=",
                             *overrides])
    runner = episode_runner(cfg, tokenizer)
    try:
        engine = Budgeted(tokenizer, GAME_SCRIPTS, cfg.sampling.max_new_tokens)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        policy = SamplerModels.of(cfg, engine, model, None, tokenizer, {}, episodes=runner)
        batch = make_batch(cfg, policy, prompts_of(tokenizer, answers=("1",)), step=0, metrics_so_far={},
                           measure_logp_gap=False)
    finally:
        runner.pool.close()
    return cfg, batch


def test_an_episode_cut_at_the_budget_scores_the_batchs_worst_by_default(tiny_model_dir):
    """Rewards [1, -1, -1, cut]: the environment never scored the cut episode, so it takes the batch's
    worst graded total, -1, never the free 0 above losing: [1, -1, -1, -1], mean -0.5, unbiased std 1,
    advantages [1.5, -0.5, -0.5, -0.5] / (1 + 1e-4); all 4 in the loss. Running out of tokens is not a
    failure of env_reward's: it counts toward no failure streak."""
    cfg, batch = game_batch(tiny_model_dir)
    assert not cfg.training.mask_truncated_completions
    assert batch.truncated.tolist() == [False, False, False, True]
    assert batch.rewards[:, 0].tolist() == [1.0, -1.0, -1.0, 0.0]  # no value of the environment's
    assert torch.allclose(batch.advantages, torch.tensor([1.5, -0.5, -0.5, -0.5]) / (1 + 1e-4), atol=1e-6)
    m = batch.meta["metrics"]
    assert (m["rewards/env_reward/failures"], m["rewards/worst_fraction"]) == (0.0, 0.25)
    assert denominators_of(batch, Objective.of(cfg)) == Denominators(4, sum(int(m.sum()) for m in batch.model_mask), 4)


def test_an_episode_cut_at_the_budget_scores_the_batchs_worst_whatever_its_earlier_turns_earned(tiny_model_dir):
    """The game pays 0.5 for each message that neither wins nor loses. Episode 3 earns 0.5 at its first
    message and then runs out of tokens: kept, the 0.5 would beat the loser's -1 and e2's 0.5 - 1.
    It scores the batch's worst instead: [1, -1, -0.5, -1], mean -0.375, deviations 1.375, -0.625,
    -0.125, -0.625, unbiased std sqrt(2.6875 / 3) = 0.946485."""
    cfg, batch = game_batch(tiny_model_dir, "env.args={step_reward: 0.5}")
    assert batch.truncated.tolist() == [False, False, False, True]
    assert batch.rewards[:, 0].tolist() == [1.0, -1.0, -0.5, 0.5]  # what the environment gave, on the wire
    std = (2.6875 / 3) ** 0.5
    torch.testing.assert_close(batch.advantages, torch.tensor([1.375, -0.625, -0.125, -0.625]) / (std + 1e-4),
                               rtol=0, atol=1e-6)


def test_an_episode_cut_at_the_budget_scores_env_truncated_reward_when_it_is_set(tiny_model_dir):
    """env.truncated_reward=-1: running out of tokens scores as losing. Rewards [1, -1, -1, -1]: mean
    -0.5, unbiased std 1, advantages [1.5, -0.5, -0.5, -0.5] / (1 + 1e-4); all 4 in the loss."""
    cfg, batch = game_batch(tiny_model_dir, "env.truncated_reward=-1")
    assert not cfg.training.mask_truncated_completions
    assert batch.truncated.tolist() == [False, False, False, True]
    assert batch.rewards[:, 0].tolist() == [1.0, -1.0, -1.0, -1.0]
    assert torch.allclose(batch.advantages, torch.tensor([1.5, -0.5, -0.5, -0.5]) / (1 + 1e-4), atol=1e-6)
    assert denominators_of(batch, Objective.of(cfg)) == Denominators(4, sum(int(m.sum()) for m in batch.model_mask), 4)


def test_a_reply_that_leaves_no_room_to_answer_is_cut_and_scored_alike(tiny_model_dir):
    """An episode whose environment replies past the budget ends there, truncated: its earlier
    rewards give way to env.truncated_reward."""
    from test_tools import ScriptedModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pool = EnvironmentPool(f"{ENVS}:Scripted", {"length": 9}, 5.0)  # no reward before its ninth message
    try:
        scripts = [["a one"], ["b one"]]
        runner = EpisodeRunner(pool, tokenizer, 8, 4, truncated_reward=-1.0)
        run = runner.run(ScriptedModel(tokenizer, scripts), prompts_of(tokenizer, answers=("1",)), 2)
    finally:
        pool.close()
    assert [(e.truncated, e.turns, e.reward, e.model[-1]) for e in run.episodes] == [(True, 1, -1.0, False)] * 2
    assert [row["env_reward"] for row in run.rows] == [-1.0, -1.0] and [len(e.tokens) for e in run.episodes] == [8, 8]


def test_an_environments_reward_that_nothing_trains_on_is_said_once(tiny_model_dir, caplog):
    """env_reward is not among rewards.names: the first reward an environment gives is a warning line;
    env.truncated_reward without env_reward to score is a config error."""
    from test_tools import ScriptedModel

    from grpo.sampler.episodes import episode_runner
    from grpo.settings.tree import ConfigError

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = load_config(None, [f"env.name={ENVS}:WinOrLose", "data.prefill="])
    runner = episode_runner(cfg, tokenizer)
    try:
        for _ in range(2):
            runner.run(ScriptedModel(tokenizer, GAME_SCRIPTS[:2]), prompts_of(tokenizer, answers=("1",)), 2)
    finally:
        runner.pool.close()
    said = [r.getMessage() for r in caplog.records if "env_reward" in r.getMessage()]
    assert said == ["the environment gives rewards, and rewards.names does not hold env_reward: they are not trained "
                    "on; add env_reward to rewards.names (and its weight to rewards.weights)"]
    with pytest.raises(ConfigError, match=r"env.truncated_reward=-1 is the env_reward of an episode cut at "
                                          r"sampling.max_new_tokens, and rewards.names \(gsm8k_answer_lenient, "
                                          r"think_answer_format_partial\) does not hold env_reward"):
        load_config(None, [f"env.name={ENVS}:WinOrLose", "env.truncated_reward=-1"])


def test_an_environment_that_runs_no_tool_starts_where_the_tool_jail_cannot_and_run_tool_says_why():
    """Where the jail cannot start (here: no seccomp filter can be loaded), an environment that never
    calls run_tool still runs; the log says that calls would fail, and why."""
    out = subprocess.run([sys.executable, str(REPO / "tests" / "refused_namespaces.py"), f"{ENVS}:Counter", "1",
                          "--no-seccomp", "--network-allowed"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    how, text, failure = json.loads(out.stdout.splitlines()[-1])
    assert (how, failure) == ("allowed", None) and text
    assert "tool calls run in a jail each: none: it could not start (the tools jail could not start" in out.stderr
