"""Agent sessions as episodes (grpo/agent/runner.py): the real `openai` SDK as the harness, over loopback, against
the HF engine with a tiny model and SmolLM2's tokenizer and chat template. The rows must be exactly what the engine
was fed and sampled: the prompt the first request's render, the model's tokens with their behaviour log-probs
(equal to a recompute), every token the harness or the template wrote masked out."""

import asyncio
import dataclasses
import time

import openai
import pytest
import torch
from episode_helpers import sampling_cfg
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.agent.history import as_text
from grpo.agent.tokens import render_ids
from grpo.config import load_config
from grpo.data.problems import Problem
from grpo.data.prompts import Prompt
from grpo.model.logprobs import completion_logprobs
from grpo.sampler.rollout.hf_engine import HFEngine

QUESTION = "What is 3 plus 4?"


@pytest.fixture(scope="module")
def chatty_agent(chatty_model_dir):
    """(model, tokenizer, engine) of the digit model that ends its message about one token in eleven."""
    model = AutoModelForCausalLM.from_pretrained(chatty_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(chatty_model_dir)
    return model, tokenizer


def prompts(tokenizer, count=2):
    """Dataset prompts (the runner replaces each with its sessions' first render)."""
    return [Prompt(Problem(f"train-{i}", QUESTION, str(7 + i)), tokenizer(QUESTION)["input_ids"]) for i in range(count)]


def runner_of(tokenizer, entrypoint, *overrides, max_new_tokens=40):
    from grpo.agent.runner import AgentRunner

    cfg = load_config(None, ["agent.entrypoint=unused:fn", "data.prefill=", "agent.idle_timeout_s=10",
                             "agent.session_timeout_s=60", *overrides])
    return AgentRunner(cfg.agent, tokenizer, max_new_tokens, 256, "policy", entrypoint=entrypoint)


def client(base_url, key):
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)


def recomputed(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The model's log-prob of each completion token after the prompt and the completion before it (temperature 1)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].double()
    return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def single_turn(row, base_url, key):
    reply = client(base_url, key).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["question"]}])
    return 1.0 if row["reference_answer"] in (reply.choices[0].message.content or "") else 0.0


def test_a_single_turn_session_is_the_first_requests_render_then_the_sampled_tokens_with_their_logps(chatty_agent):
    model, tokenizer = chatty_agent
    runner = runner_of(tokenizer, single_turn)
    try:
        run = runner.run(HFEngine(model, tokenizer, sampling_cfg(40)), prompts(tokenizer), 3, seed=5)
    finally:
        runner.close()
    shown = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                          add_generation_prompt=True)
    expected_prompt = tokenizer(shown, add_special_tokens=False)["input_ids"]
    assert [p.token_ids for p in run.prompts] == [expected_prompt] * 2
    for j, e in enumerate(run.episodes):
        assert e.turns == 1 and e.model == [True] * len(e.tokens) and e.env_errors == 0
        assert torch.allclose(torch.tensor(e.logps, dtype=torch.float64), recomputed(model, expected_prompt, e.tokens),
                              atol=1e-4)
        text = tokenizer.decode(e.tokens, skip_special_tokens=True)
        assert run.texts[j] == text
        assert run.rows[j]["env_reward"] == (1.0 if run.rows[j]["reference_answer"] in text else 0.0)
    assert runner.sessions._sessions == {}  # every session forgotten with the step


def test_the_endpoint_samples_the_same_tokens_as_the_engine_for_the_same_prompt_and_seed(chatty_agent):
    model, tokenizer = chatty_agent
    runner = runner_of(tokenizer, single_turn)
    engine = HFEngine(model, tokenizer, sampling_cfg(40))
    try:
        run = runner.run(engine, prompts(tokenizer), 3, seed=11)
    finally:
        runner.close()
    direct = engine.generate([p.token_ids for p in run.prompts], 3, seed=11, max_new_tokens=[40, 40])
    assert [c.tolist() for c in run.rollouts.completion_ids] == [c.tolist() for c in direct.completion_ids]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(run.rollouts.logps, direct.logps))


def conversation(turns: int):
    """A multi-turn harness: after each reply it sends the whole history with a new user message; async."""
    async def agent(row, base_url, key):
        api = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
        messages = [{"role": "system", "content": "Answer with digits."}, {"role": "user", "content": row["question"]}]
        for k in range(turns):
            reply = await api.chat.completions.create(model="policy", messages=messages)
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            if reply.choices[0].finish_reason == "length":
                break
            messages.append({"role": "user", "content": f"Again, {k}."})
        await api.close()
        agent.histories.append(messages)
        return 0.5
    agent.histories = []
    return agent


def test_a_multi_turn_session_is_one_row_whose_context_is_the_conversations_render(chatty_agent):
    model, tokenizer = chatty_agent
    agent = conversation(3)
    runner = runner_of(tokenizer, agent, "agent.max_turns=3", max_new_tokens=120)
    try:
        run = runner.run(HFEngine(model, tokenizer, sampling_cfg(120)), prompts(tokenizer, 1), 4, seed=2)
    finally:
        runner.close()
    prompt = run.prompts[0].token_ids
    # the conversations as the harness holds them at the end, rendered whole by the template (the user message it
    # added after the last turn was never sent)
    renders = [tokenizer(tokenizer.apply_chat_template(h if h[-1]["role"] == "assistant" else h[:-1], tokenize=False),
                         add_special_tokens=False)["input_ids"] for h in agent.histories]
    assert len(renders) == 4 and max(e.turns for e in run.episodes) == 3
    for e in run.episodes:
        assert e.reward == 0.5 and e.env_errors == 0 and not e.breaks
        # the row is the template's render of the whole conversation: each assistant turn as sampled, then the
        # template's tokens and the harness's message (context, masked); the render adds a newline after the last
        row = prompt + e.tokens
        assert sum(r[:len(row)] == row and len(r) == len(row) + 1 for r in renders) >= 1
        assert e.continued == {"clean": e.turns - 1}
        drawn = [t for t, m in zip(e.tokens, e.model) if m]
        assert sum(e.model) == len(drawn) and len(drawn) > 0
        assert torch.allclose(torch.tensor([x for x, m in zip(e.logps, e.model) if m], dtype=torch.float64),
                              recomputed(model, prompt, e.tokens)[torch.tensor(e.model)], atol=1e-4)
        assert all(x == 0.0 for x, m in zip(e.logps, e.model) if not m)


def test_a_weight_load_mid_session_gives_each_sampled_token_its_versions_log_prob(chatty_agent, tmp_path):
    """sampling.in_flight_updates on the HF engine: a version published while sessions run (some waiting on their
    harness) is loaded between two decode steps, every cached column computed again under it; each sampled token
    records the version that drew it and has that version's log-prob given the conversation before it; the
    harness's and the template's tokens carry no version."""
    import copy

    from helpers import new_version_loader

    model, tokenizer = chatty_agent
    model = copy.deepcopy(model)  # the module's model stays as it is: the load below changes this one
    old, newer, polling = new_version_loader(tmp_path, model, at_poll=12)
    engine = polling(HFEngine(model, tokenizer, sampling_cfg(120)))
    runner = runner_of(tokenizer, conversation(3), "agent.max_turns=3", max_new_tokens=120)
    try:
        run = runner.run(engine, prompts(tokenizer, 1), 4, seed=2)
    finally:
        runner.close()
    prompt, versions = run.prompts[0].token_ids, run.rollouts.token_versions
    assert any((v == 0).any() and (v == 1).any() for v in versions)  # sessions that span the load
    for e, v, m in zip(run.episodes, versions, run.rollouts.model_masks, strict=True):
        assert torch.equal(v < 0, ~m) and e.turns > 1
        for version, weights in ((0, old), (1, newer)):
            at = v == version
            assert torch.allclose(torch.tensor(e.logps, dtype=torch.float64)[at],
                                  recomputed(weights, prompt, e.tokens)[at], atol=1e-5)


def run_agent(chatty_agent, fn, *overrides, group=2, max_new_tokens=40, seed=1):
    model, tokenizer = chatty_agent
    runner = runner_of(tokenizer, fn, *overrides, max_new_tokens=max_new_tokens)
    try:
        return runner.run(HFEngine(model, tokenizer, sampling_cfg(max_new_tokens)), prompts(tokenizer, 1), group,
                          seed=seed)
    finally:
        runner.close()


def test_a_harness_that_sends_nothing_fails_its_samples_and_none_of_their_tokens_is_trained(chatty_agent):
    run = run_agent(chatty_agent, lambda row, base_url, key: None)
    assert all(e.environment_failed and e.env_error == "the agent returned without a request" for e in run.episodes)
    assert all(not any(e.model) for e in run.episodes)  # nobody read those turns


def test_a_harness_that_raises_after_its_turn_fails_its_sample_and_keeps_the_turn_it_received(chatty_agent):
    def raising(row, base_url, key):
        single_turn(row, base_url, key)
        raise RuntimeError("tool crashed")

    run = run_agent(chatty_agent, raising)
    assert all(e.environment_failed and e.env_error == "the agent raised RuntimeError: tool crashed"
               for e in run.episodes)
    assert all(all(e.model) and e.turns == 1 for e in run.episodes)  # scored the batch's worst, and trained


def rows_of(e) -> list[tuple[list[int], list[bool], list[float]]]:
    """A sample's rows, each (tokens, model mask, recorded log-probs), split where a new row begins."""
    bounds = [0, *e.row_starts, len(e.tokens)]
    return [(e.tokens[a:b], e.model[a:b], e.logps[a:b]) for a, b in zip(bounds, bounds[1:])]


def assert_rows_are_what_the_engine_read(model, run, group):
    """Each sampled token's recorded log-prob is the model's after the prompt and its own row alone (the rows before
    it are not its context), every other token is context (masked, log-prob 0), and the batch's log-prob pass, the
    rows as segments, reads the same, shared prefix or not."""
    prompt = run.prompts[0].token_ids
    for e in run.episodes:
        for tokens, mask, logps in rows_of(e):
            assert all(x == 0.0 for x, m in zip(logps, mask) if not m)
            if any(mask):
                assert torch.allclose(torch.tensor([x for x, m in zip(logps, mask) if m], dtype=torch.float64),
                                      recomputed(model, prompt, tokens)[torch.tensor(mask)], atol=1e-4)
    for shared_prefix in (True, False):
        batch = completion_logprobs(model, [torch.tensor(prompt)], run.rollouts.completion_ids, [group],
                                    segments=run.rollouts.segments, shared_prefix=shared_prefix)
        for read, recorded, mask in zip(batch, run.rollouts.logps, run.rollouts.model_masks):
            assert torch.allclose(read[mask], recorded[mask], atol=1e-4)


@pytest.mark.parametrize("continuous", [True, False], ids=["one-loop", "turn-by-turn"])
def test_a_harness_that_edits_our_turn_goes_on_in_a_new_row_read_after_the_prompt_alone(chatty_agent, continuous):
    """The harness rewrites the model's answer before its next user turn: what the model reads next is not what it
    wrote, so the sample goes on in a row of its own, the fresh render of the edited conversation (on the HF
    engine's one loop, and turn by turn)."""
    model, tokenizer = chatty_agent
    edited = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "I think it is 12."},
              {"role": "user", "content": "Sure?"}]

    def editing(row, base_url, key):
        api = client(base_url, key)
        reply = api.chat.completions.create(model="policy", messages=edited[:1])
        if reply.choices[0].finish_reason == "stop":
            api.chat.completions.create(model="policy", messages=edited)
        return 1.0

    run = run_limited(chatty_agent, editing, continuous, turns=2, seed=1)[0]
    prompt = run.prompts[0].token_ids
    fresh = render_ids(tokenizer, edited)
    two_rows = [e for e in run.episodes if e.row_starts]
    assert two_rows and run.rollouts.segments is not None
    for e in two_rows:
        assert e.turns == 2 and e.new_rows == {"assistant_changed": 1} and e.continued == {"new_row": 1}
        assert not e.breaks and not e.environment_failed
        (first, first_mask, _), (second, second_mask, _) = rows_of(e)
        assert all(first_mask)  # the first turn, as sampled
        context = len(fresh) - len(prompt)  # the edited conversation's render after the prompt, masked
        assert prompt + second[:context] == fresh and not any(second_mask[:context]) and all(second_mask[context:])
        assert e.segments().tolist() == [0] * len(first) + [1] * len(second)
    assert_rows_are_what_the_engine_read(model, run, 3)


def test_a_step_of_sessions_with_new_rows_goes_over_the_wire_and_the_trainer_reads_each_row_as_sampled(
        tiny_model_dir):
    """make_batch with sessions that start new rows (a random tiny model, turns cut at the request's max_tokens):
    the batch carries the rows (segments), the sampler's recompute and then the trainer's forward (GSPO: one ratio
    per session, over all its rows) read each sampled token in the context it was drawn in, within float32
    rounding of the engine's recorded log-probs; read as one row, the later rows' tokens are far off."""
    from helpers import assert_batches_equal

    from grpo.sampler.batches import SamplerModels, make_batch
    from grpo.trainer.training_step import micro_batch_loss
    from grpo.wire.codec import decode_batch, encode_batch

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def editing(row, base_url, key):
        api = client(base_url, key)
        question = [{"role": "user", "content": row["question"]}]
        reply = api.chat.completions.create(model="policy", messages=question, max_tokens=6)
        reply = api.chat.completions.create(model="policy", max_tokens=6, messages=[
            *question, {"role": "assistant", "content": "Maybe 12."}, {"role": "user", "content": "Sure?"}])
        return float(len(reply.choices[0].message.content or "") % 2)

    cfg = load_config(None, ["agent.entrypoint=unused:fn", "data.prefill=", "agent.idle_timeout_s=10",
                             "agent.session_timeout_s=60", "sampling.group_size=3", "sampling.max_new_tokens=80",
                             "sampling.temperature=1.0", "training.beta=0", "lora.enabled=false",
                             "training.reference_on=sampler", "rewards.names=[env_reward]", "rewards.weights=[1.0]",
                             "training.use_gspo=true", "rewards.accuracy_reward=env_reward",
                             "rewards.format_reward=env_reward"])
    runner = runner_of(tokenizer, editing, max_new_tokens=80)
    try:
        policy = SamplerModels.of(cfg, HFEngine(model, tokenizer, cfg.sampling), model, None, tokenizer, {},
                                  episodes=runner)
        batch = make_batch(cfg, policy, prompts(tokenizer, 2), step=0, metrics_so_far={}, measure_logp_gap=True)
    finally:
        runner.close()
    metrics = batch.meta["metrics"]
    assert [int(s[-1]) for s in batch.segments] == [1] * 6  # every session: two rows of 6 sampled tokens each
    assert metrics["agent/rows_per_session"] == 2 and metrics["agent/new_row/assistant_changed"] == 6
    assert [int(m.sum()) for m in batch.model_mask] == [12] * 6
    assert metrics["sampler/engine_logp_gap_max"] < 1e-4  # float32, |logp| ~ 11 (a vocabulary of 49,152)
    decoded = decode_batch(encode_batch(batch))
    assert_batches_equal(batch, decoded)
    _, trained, _ = micro_batch_loss(model, decoded, cfg)
    assert trained["sampling/sampling_logp_difference/max"] < 1e-4
    _, unsplit, _ = micro_batch_loss(model, dataclasses.replace(decoded, segments=None), cfg)
    assert unsplit["sampling/sampling_logp_difference/max"] > 1e-2


def test_an_earlier_request_sent_again_is_refused_never_a_second_sample_of_its_turn(chatty_agent):
    """A harness that, after two turns, sends its first turn's request again (a re-roll of that turn, to keep the
    better answer): the model already read that conversation and sampled after it, so the request is refused by
    name, and the sample keeps the two turns it had."""
    refused = []

    def rerolling(row, base_url, key):
        api = client(base_url, key)
        first = [{"role": "user", "content": row["question"]}]
        reply = api.chat.completions.create(model="policy", messages=first)
        second = [*first, reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
        if reply.choices[0].finish_reason == "stop":
            api.chat.completions.create(model="policy", messages=second)
            try:
                api.chat.completions.create(model="policy", messages=first)
            except openai.BadRequestError as error:
                refused.append(error.body["code"])
        return 1.0

    run = run_agent(chatty_agent, rerolling, "agent.max_turns=3", group=3, max_new_tokens=80)
    two = [e for e in run.episodes if e.turns == 2]
    assert two and refused == ["repeated"] * len(two)
    assert all(e.breaks == {"repeated": 1} and not e.row_starts and not e.environment_failed for e in two)


# Qwen3's rule for thinking: an assistant turn before the last user message is shown without its <think> block
QWEN3_STYLE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}{%- set content = m.content -%}"
    "{%- if m.role == 'assistant' and '</think>' in content and loop.index0 < ns.last_query -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') -%}{%- endif -%}"
    "{{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}")


def test_a_template_that_drops_earlier_thinking_goes_on_in_a_new_row_each_token_trained_once(chatty_model_dir):
    """A Qwen3-style template: the harness begins the model's second turn with a <think> block; after the next user
    message the template no longer shows it, so the third turn is sampled in a new row, from the fresh render."""
    model = AutoModelForCausalLM.from_pretrained(chatty_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(chatty_model_dir)
    tokenizer.chat_template = QWEN3_STYLE
    thinking = "<think>\nLet me check.\n</think>\n\n"
    sent = []

    def thinker(row, base_url, key):
        api = client(base_url, key)
        messages = [{"role": "user", "content": row["question"]}]
        for k, prefill in enumerate(("", thinking, "")):
            begun = [{"role": "assistant", "content": prefill}] if prefill else []
            reply = api.chat.completions.create(model="policy", messages=messages + begun, extra_body={
                "continue_final_message": bool(prefill), "add_generation_prompt": not prefill})
            if reply.choices[0].finish_reason != "stop" or k == 2:
                break
            messages += [{"role": "assistant", "content": prefill + reply.choices[0].message.content},
                         {"role": "user", "content": ("Think again.", "Sure?")[k]}]
            sent.append(list(messages))
        return 1.0

    run = run_agent((model, tokenizer), thinker, "agent.max_turns=3", group=3, max_new_tokens=120)
    prompt = run.prompts[0].token_ids
    three = [e for e in run.episodes if e.turns == 3]
    assert three
    for e in three:
        assert e.continued == {"clean": 1, "new_row": 1} and e.new_rows == {"template_drops": 1} and not e.breaks
        (first, first_mask, _), (second, second_mask, _) = rows_of(e)
        # the new row: the last request's render (its thinking gone) after the prompt, then the third turn
        context = second_mask.index(True)
        assert any(prompt + second[:context] == render_ids(tokenizer, m) for m in sent if len(m) == 5)
        assert all(second_mask[context:]) and "<think>" in tokenizer.decode(first)
        assert "<think>" not in tokenizer.decode(second)
        # each sampled token in one row only: the second row holds no draw of the first's
        assert sum(e.model) == sum(first_mask) + sum(second_mask) == len(e.drawn)
    assert_rows_are_what_the_engine_read(model, run, 3)


def back_and_forth(histories: list, turns: int = 2, as_parts: bool = False):
    """A harness that answers each turn with a user message, sending our message back as it came (or as OpenAI's
    list of text parts); `histories` gets each conversation as the model saw it."""
    def agent(row, base_url, key):
        api = client(base_url, key)
        messages = [{"role": "user", "content": row["question"]}]
        for k in range(turns):
            reply = api.chat.completions.create(model="policy", messages=messages)
            content = reply.choices[0].message.content
            histories.append(messages + [{"role": "assistant", "content": content}])
            if reply.choices[0].finish_reason == "length":
                break
            sent = [{"type": "text", "text": content}] if as_parts else content
            messages = messages + [{"role": "assistant", "content": sent}, {"role": "user", "content": f"Again, {k}."}]
        return 1.0
    return agent


def test_content_sent_back_as_text_parts_is_the_same_conversation_and_continues_clean(chatty_agent):
    model, tokenizer = chatty_agent
    histories = []
    run = run_agent(chatty_agent, back_and_forth(histories, as_parts=True), "agent.max_turns=2", group=3,
                    max_new_tokens=80)
    renders = [tokenizer(tokenizer.apply_chat_template(as_text(h), tokenize=False),
                         add_special_tokens=False)["input_ids"] for h in histories]
    two_turns = [e for e in run.episodes if e.turns == 2]
    assert two_turns
    for e in two_turns:
        assert e.continued == {"clean": 1} and not e.breaks
        row = run.prompts[0].token_ids + e.tokens
        assert any(r[:len(row)] == row and len(r) == len(row) + 1 for r in renders)


# SmolLM2's template, but its assistant turns end with <|endoftext|> where the model ends them with <|im_end|>: a
# fresh render never extends the sampled row, and every turn still shows: the row goes on by the reply rule
OTHER_TURN_END = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']}}"
                  "{% if message['role'] == 'assistant' %}{{'<|endoftext|>'}}{% else %}{{'<|im_end|>'}}{% endif %}"
                  "{{'\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")


def test_a_template_that_writes_our_turn_otherwise_continues_by_the_reply_rule_exactly_as_fed(chatty_model_dir):
    model = AutoModelForCausalLM.from_pretrained(chatty_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(chatty_model_dir)
    tokenizer.chat_template = OTHER_TURN_END
    histories = []
    run = run_agent((model, tokenizer), back_and_forth(histories), "agent.max_turns=2", group=3, max_new_tokens=80)
    prompt = run.prompts[0].token_ids
    two_turns = [e for e in run.episodes if e.turns == 2]
    assert two_turns
    reply = tokenizer("<|endoftext|>\n<|im_start|>user\nAgain, 0.<|im_end|>\n<|im_start|>assistant\n",
                      add_special_tokens=False)["input_ids"]
    for e in two_turns:
        assert e.continued == {"equivalent": 1} and not e.breaks
        first = e.model.index(False)
        assert e.tokens[first:first + len(reply)] == reply and not any(e.model[first:first + len(reply)])
        assert all(e.model[first + len(reply):])
        # the log-probs recorded are the model's on this very row: it is what the engine was fed
        assert torch.allclose(torch.tensor([x for x, m in zip(e.logps, e.model) if m], dtype=torch.float64),
                              recomputed(model, prompt, e.tokens)[torch.tensor(e.model)], atol=1e-4)


def test_two_agents_sharing_one_session_get_one_turn_and_a_conflict(chatty_agent):
    """The second request is sent while the first is being sampled (the model's first forward waits for it to be
    answered), so it always meets a request in flight."""
    import threading

    model = chatty_agent[0]
    outcomes, sampling, second_answered = [], threading.Event(), threading.Event()

    def hold_the_first_forward(module, args):
        if not sampling.is_set():
            sampling.set()
            second_answered.wait(30)

    def doubled(row, base_url, key):
        def ask(after=None):
            if after is not None:
                assert after.wait(30), "the first request was never sampled"
            try:
                single_turn(row, base_url, key)
                outcomes.append("turn")
            except openai.ConflictError as error:
                outcomes.append(error.body["message"])
            finally:
                if after is not None:
                    second_answered.set()
        threads = [threading.Thread(target=ask), threading.Thread(target=ask, args=(sampling,))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return 1.0

    hook = model.register_forward_pre_hook(hold_the_first_forward)
    try:
        run = run_agent(chatty_agent, doubled, group=1)
    finally:
        hook.remove()
    assert outcomes[1] == "turn" and "one request at a time" in outcomes[0]
    assert run.episodes[0].turns == 1 and all(run.episodes[0].model)


def test_with_max_sessions_a_step_goes_in_waves_of_whole_groups_the_first_as_it_would_alone(chatty_agent):
    import threading

    model, tokenizer = chatty_agent
    lock, open_now, most = threading.Lock(), [0], [0]

    def counted(row, base_url, key):
        with lock:
            open_now[0] += 1
            most[0] = max(most[0], open_now[0])
        try:
            return single_turn(row, base_url, key)
        finally:
            with lock:
                open_now[0] -= 1

    def step(*overrides):
        runner = runner_of(tokenizer, counted, *overrides)
        try:
            return runner.run(HFEngine(model, tokenizer, sampling_cfg(40)), prompts(tokenizer, 3), 2, seed=9)
        finally:
            runner.close()

    waves = step("agent.max_sessions=3", "sampling.group_size=2")  # 3 // 2: one group a wave
    assert most[0] == 2
    most[0] = 0
    at_once = step()
    assert most[0] == 6
    assert len(waves.episodes) == 6 and all(e.turns == 1 and all(e.model) for e in waves.episodes)
    assert [r["reference_answer"] for r in waves.rows] == ["7", "7", "8", "8", "9", "9"]
    ids = [c.tolist() for c in waves.rollouts.completion_ids]
    # the first wave draws as the whole step would (the same seed, the same sequences); each later one its own
    assert ids[:2] == [c.tolist() for c in at_once.rollouts.completion_ids][:2]
    assert ids[2:4] != ids[:2] and ids[4:] != ids[:2] and ids[4:] != ids[2:4]
    for j, e in enumerate(waves.episodes):
        assert torch.allclose(torch.tensor(e.logps, dtype=torch.float64),
                              recomputed(model, waves.prompts[j // 2].token_ids, e.tokens), atol=1e-4)


def test_an_async_harness_that_never_returns_is_cancelled_at_its_session_time(chatty_agent):
    model, tokenizer = chatty_agent

    async def stuck(row, base_url, key):
        await asyncio.to_thread(single_turn, row, base_url, key)
        await asyncio.sleep(3600)

    # time enough for the first request on a busy machine (else it fails as one that sent none)
    runner = runner_of(tokenizer, stuck, "agent.session_timeout_s=12", "agent.idle_timeout_s=12")
    try:
        run = runner.run(HFEngine(model, tokenizer, sampling_cfg(12)), prompts(tokenizer, 1), 2, seed=1)
    finally:
        runner.close()
    assert all(e.environment_failed and "did not return within agent.session_timeout_s=12" in e.env_error
               for e in run.episodes), [e.env_error for e in run.episodes]
    assert all(all(e.model) for e in run.episodes)  # its turn was received: trained, scored the batch's worst


def test_a_turn_begun_by_the_harness_is_continued_and_the_rewards_read_the_whole_message(chatty_agent):
    """vLLM's continue_final_message: the request ends with an assistant message the model goes on with. The
    response carries what the model wrote; the next request repeats the whole message, and the rewards score it."""
    model, tokenizer = chatty_agent
    replies = []

    def begun(row, base_url, key):
        api = client(base_url, key)
        messages = [{"role": "user", "content": row["question"]}]
        for k in range(2):
            reply = api.chat.completions.create(
                model="policy", messages=[*messages, {"role": "assistant", "content": "<think>\n"}],
                extra_body={"continue_final_message": True, "add_generation_prompt": False})
            replies.append(reply.choices[0].message.content)
            if reply.choices[0].finish_reason == "length":
                break
            messages += [{"role": "assistant", "content": "<think>\n" + reply.choices[0].message.content},
                         {"role": "user", "content": f"Again, {k}."}]
        return 1.0

    run = run_agent(chatty_agent, begun, "agent.max_turns=2", group=3, max_new_tokens=80)
    begun_render = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "<think>\n"}], tokenize=False,
        continue_final_message=True)
    assert run.prompts[0].token_ids == tokenizer(begun_render, add_special_tokens=False)["input_ids"]
    assert begun_render.endswith("<|im_start|>assistant\n<think>\n")
    first_turns = [tokenizer.decode(e.tokens[:e.model.index(False) if False in e.model else len(e.tokens)],
                                    skip_special_tokens=True) for e in run.episodes]
    assert all(text in replies for text in first_turns)  # the response holds the model's text alone
    assert any(e.turns == 2 for e in run.episodes)
    for j, e in enumerate(run.episodes):
        assert not e.breaks and not e.environment_failed and sum(e.continued.values()) == e.turns - 1
        assert run.texts[j].startswith("<think>\n")  # what the rewards score: the whole assistant message


def test_a_stream_whose_client_hung_up_is_never_trained_and_its_session_ends(chatty_agent):
    import http.client
    import json
    import socket
    from urllib.parse import urlparse

    def hangs_up(row, base_url, key):
        url = urlparse(base_url)
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
        body = json.dumps({"model": "policy", "stream": True, "messages": [{"role": "user", "content": "Hi"}]})
        connection.request("POST", f"{url.path}/chat/completions", body,
                           {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        response = connection.getresponse()  # the stream's headers come at once, before the turn
        assert response.status == 200
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
        return 1.0

    run = run_agent(chatty_agent, hangs_up, group=2)
    for e in run.episodes:
        assert e.turns == 1 and e.undelivered == 1 and not any(e.model)  # sampled, never received: not trained


def test_a_retried_request_gets_the_turn_its_first_try_never_received_and_that_turn_is_trained_once(chatty_agent):
    """The SDK's retry of a request whose stream broke (x-stainless-retry-count, the same body) is answered with the
    turn sampled for the first try: nothing is sampled twice, the turn counts as received, the session goes on."""
    import http.client
    import json
    import socket
    from urllib.parse import urlparse

    said = []

    def retries(row, base_url, key):
        url = urlparse(base_url)
        body = json.dumps({"model": "policy", "stream": True, "messages": [{"role": "user", "content": "Hi"}]})
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        with socket.create_connection((url.hostname, url.port), timeout=10) as first:  # breaks before the turn
            first.sendall((f"POST {url.path}/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
                          + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + f"\r\n{body}").encode())
            assert first.recv(12) == b"HTTP/1.1 200"  # the stream's headers come at once, before the turn
            first.shutdown(socket.SHUT_RDWR)
        time.sleep(0.5)
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
        connection.request("POST", f"{url.path}/chat/completions", body, {**headers, "x-stainless-retry-count": "1"})
        response = connection.getresponse()
        events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
        text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                       if json.loads(e)["choices"])
        said.append(text)
        follow = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": text},
                  {"role": "user", "content": "Again"}]
        client(base_url, key).chat.completions.create(model="policy", messages=follow)
        return 1.0

    run = run_agent(chatty_agent, retries, group=2)
    _, tokenizer = chatty_agent
    assert len(said) == len(run.episodes) == 2, [e.env_error for e in run.episodes]
    firsts = []
    for e in run.episodes:  # the harnesses' threads said theirs in either order
        assert e.turns == 2 and e.undelivered == 0 and not e.environment_failed
        first = e.tokens[:e.model.index(False)]  # the first turn: sampled once, received by the retry, trained
        firsts.append(tokenizer.decode(first, skip_special_tokens=True))
        assert sum(e.model) > len(first)  # and the second turn after it
    assert sorted(firsts) == sorted(said)


def test_harnesses_that_misbehave_fail_alone_and_the_step_goes_on(chatty_agent):
    """One session's harness sends a history nested past any parser, one stops its interpreter, one rewrites the
    row it was given: each fails (or is refused) alone, the others' rows and the rewards' rows are untouched."""
    deep = "[" * 5000 + "]" * 5000

    def varied(row, base_url, key):
        api = client(base_url, key)
        row["prompt_turns"].append({"role": "user", "content": "injected"})  # its own copy
        row["question"] = "changed"
        messages = [{"role": "user", "content": QUESTION}]
        reply = api.chat.completions.create(model="policy", messages=messages)
        kind = varied.kinds.pop()
        if kind == "deep":
            messages += [{"role": "assistant", "content": reply.choices[0].message.content,
                          "tool_calls": [{"id": "c", "type": "function",
                                          "function": {"name": "f", "arguments": deep}}]},
                         {"role": "tool", "tool_call_id": "c", "content": "1"}]
            try:
                api.chat.completions.create(model="policy", messages=messages)
            except openai.BadRequestError as error:
                varied.refused.append(error.body["code"])
            return 1.0
        if kind == "exit":
            raise SystemExit(3)
        return 1.0
    varied.kinds, varied.refused = ["deep", "exit", "fine"], []

    run = run_agent(chatty_agent, varied, group=3)
    # the deep one's call is not ours: its sample goes on in a new row (or is cut where the history leaves no room)
    assert varied.refused in ([], ["context_length_exceeded"])
    assert sorted(e.env_error for e in run.episodes) == ["", "", "the agent raised SystemExit: 3"]
    assert sorted(e.turns for e in run.episodes) == [1, 1, 1 + (not varied.refused)]
    assert [e.new_rows for e in run.episodes if e.turns == 2] == ([{"assistant_changed": 1}] if not varied.refused
                                                                  else [])
    assert all("question" not in row and row["prompt_turns"] == [] for row in run.rows)  # the rewards' rows


def test_past_max_turns_a_session_is_cut_and_those_that_open_otherwise_than_their_group_are_left_out(chatty_agent):
    import itertools

    count = itertools.count()

    def chatty_harness(row, base_url, key):
        """The first of its group to open is kept; each opens with a system prompt of its own."""
        api = client(base_url, key)
        messages = [{"role": "system", "content": f"You are agent {next(count)}."},
                    {"role": "user", "content": row["question"]}]
        try:
            for _ in range(3):
                reply = api.chat.completions.create(model="policy", messages=messages)
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "Go on."}]
        except openai.BadRequestError as error:
            return {"max_turns": 0.5, "group_prompt": None}.get(error.body["code"], 0.0)
        return 1.0

    run = run_agent(chatty_agent, chatty_harness, "agent.max_turns=2", group=3, max_new_tokens=200)
    cut = [e for e in run.episodes if e.turns == 2]
    assert cut and all(e.truncated and e.breaks == {"max_turns": 1} for e in cut)  # cut at the limit
    left_out = [e for e in run.episodes if e.open_failed]
    assert len(left_out) == 2 and all(e.breaks == {"group_prompt": 1} and not any(e.model) for e in left_out)


def test_turn_by_turn_every_session_waits_for_its_own_harness_only(chatty_agent):
    """Continuous batching off: each round's turns go to all harnesses at once. The harnesses meet at a barrier
    after their first turn, which only a round answered all at once lets them pass (one at a time, the first
    harness would wait there for turns not yet handed out)."""
    import threading

    model, tokenizer = chatty_agent
    met = threading.Barrier(6, timeout=30)

    def meeting(row, base_url, key):
        api = client(base_url, key)
        messages = [{"role": "user", "content": row["question"]}]
        for k in range(2):
            reply = api.chat.completions.create(model="policy", messages=messages)
            if k == 0:
                met.wait()
            if reply.choices[0].finish_reason == "length":
                break
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
        return 1.0

    runner = runner_of(tokenizer, meeting, "agent.max_turns=2", max_new_tokens=80)
    engine = HFEngine(model, tokenizer, load_config(None, ["sampling.max_new_tokens=80", "sampling.temperature=1.0",
                                                           "sampling.continuous_batching=false"]).sampling)
    try:
        run = runner.run(engine, prompts(tokenizer, 2), 3, seed=4)
    finally:
        runner.close()
    assert [e.env_error for e in run.episodes] == [""] * 6 and any(e.turns == 2 for e in run.episodes)
    prompt = run.prompts[0].token_ids
    for e in run.episodes[:3]:
        assert not e.breaks and torch.allclose(
            torch.tensor([x for x, m in zip(e.logps, e.model) if m], dtype=torch.float64),
            recomputed(model, prompt, e.tokens)[torch.tensor(e.model)], atol=1e-4)


def asking(requests: list[dict]):
    """A harness that sends `requests` in turn (each a request's own settings), each with the conversation so far and
    a user message after each answer; what each answer was, in `.replies`: (its session's key, turn, the reply)."""
    def harness(row, base_url, key):
        api = client(base_url, key)
        messages = [{"role": "user", "content": row["question"]}]
        for k, settings in enumerate(requests):
            reply = api.chat.completions.create(model="policy", messages=messages, **settings)
            harness.replies.append((key, k, reply))
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
        return 1.0
    harness.replies = []
    return harness


def run_limited(chatty_agent, harness, continuous: bool, turns: int, seed: int):
    """(the run, its engine): one prompt's 3 sessions of `harness`, up to `turns` turns within 80 tokens, on the one
    loop or turn by turn."""
    model, tokenizer = chatty_agent
    overrides = ["sampling.max_new_tokens=80", "sampling.temperature=1.0",
                 f"sampling.continuous_batching={str(continuous).lower()}"]
    engine = HFEngine(model, tokenizer, load_config(None, overrides).sampling)
    runner = runner_of(tokenizer, harness, f"agent.max_turns={turns}", max_new_tokens=80)
    try:
        return runner.run(engine, prompts(tokenizer, 1), 3, seed=seed), engine
    finally:
        runner.close()


@pytest.mark.parametrize("continuous", [True, False], ids=["one-loop", "turn-by-turn"])
def test_a_requests_max_tokens_caps_its_answer_and_the_session_goes_on_from_the_cut_turn(chatty_agent, continuous):
    """max_tokens=3, then max_completion_tokens=2: each answer within its cap, one cut there ends with "length"
    and the session goes on (cut at its cap, not the budget: not truncated); the first answers are the first
    tokens of what the engine draws uncapped under the same seed; the row continues clean from the cut turn (the
    template's end of turn after it is context), every sampled token's log-prob equal to a recompute."""
    model, tokenizer = chatty_agent
    capped = asking([{"max_tokens": 3}, {"max_completion_tokens": 2}, {"max_tokens": 2}])
    run, engine = run_limited(chatty_agent, capped, continuous, turns=3, seed=6)
    seen = [(key, k, r.choices[0].finish_reason, r.usage.completion_tokens) for key, k, r in capped.replies]
    assert len(seen) == 9 and all(n <= (3, 2, 2)[k] for _, k, _, n in seen)
    assert all(n == (3, 2, 2)[k] if reason == "length" else reason == "stop" for _, k, reason, n in seen)
    assert sum(reason == "length" for _, _, reason, _ in seen) >= 5
    prompt = run.prompts[0].token_ids
    uncapped = engine.generate([prompt], 3, seed=6, max_new_tokens=[80])
    for j, e in enumerate(run.episodes):
        assert e.turns == 3 and not e.truncated and not e.breaks and e.env_error == ""
        assert set(e.continued) <= {"clean", "equivalent"} and sum(e.continued.values()) == 2
        drawn = [t for t, m in zip(e.tokens, e.model) if m]
        assert len(drawn) <= 7
        head = e.tokens[:e.model.index(False)] if False in e.model else e.tokens
        assert head == uncapped.completion_ids[j].tolist()[:len(head)] and 1 <= len(head) <= 3
        assert torch.allclose(torch.tensor([x for x, m in zip(e.logps, e.model) if m], dtype=torch.float64),
                              recomputed(model, prompt, e.tokens)[torch.tensor(e.model)], atol=1e-4)


@pytest.mark.parametrize("continuous", [True, False], ids=["one-loop", "turn-by-turn"])
def test_a_requests_stop_ends_its_answer_at_the_token_that_completes_it_and_the_text_stops_before(chatty_agent,
                                                                                                continuous):
    """stop=["7"]: each answer is what the engine draws under the same seed up to the token that completes "7"
    (the first turn checked against an uncapped draw), its text returned without it ("stop"); the session goes on
    from the row's own tokens (the harness's copy of the turn lacks the stop string: the reply rule continues it),
    every sampled token's log-prob equal to a recompute."""
    model, tokenizer = chatty_agent
    stopping = asking([{"stop": ["7"]}] * 2)
    run, engine = run_limited(chatty_agent, stopping, continuous, turns=2, seed=8)
    seen = [(k, r.choices[0].finish_reason, r.choices[0].message.content) for _, k, r in stopping.replies]
    assert len(seen) == 6 and all("7" not in (text or "") for _, _, text in seen)
    prompt = run.prompts[0].token_ids
    uncapped = engine.generate([prompt], 3, seed=8, max_new_tokens=[80])
    stopped = 0
    for j, e in enumerate(run.episodes):
        assert e.turns == 2 and not e.breaks and e.env_error == ""
        first = e.tokens[:e.model.index(False)]
        drawn = uncapped.completion_ids[j].tolist()
        text = tokenizer.decode(drawn, skip_special_tokens=True)
        if "7" in text:  # cut at the token that completes the first "7"
            n = next(n for n in range(1, len(drawn) + 1) if "7" in tokenizer.decode(drawn[:n]))
            assert first == drawn[:n]
            stopped += 1
        else:
            assert first == drawn
        assert torch.allclose(torch.tensor([x for x, m in zip(e.logps, e.model) if m], dtype=torch.float64),
                              recomputed(model, prompt, e.tokens)[torch.tensor(e.model)], atol=1e-4)
    assert stopped >= 1 and sum(reason == "stop" for _, reason, _ in seen) == 6
