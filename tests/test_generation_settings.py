"""sampling.min_p, sampling.repetition_penalty and sampling.stop on the HF engine (both decode loops),
with the recorded log-prob's definition unchanged: the full, unpenalised softmax(logits / T), which
the trainer recomputes. The vLLM engine's side: tests/test_vllm_engine.py and its arguments below."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.config import ConfigError, SamplingConfig, load_config
from grpo.model.logprobs import completion_logprobs
from grpo.sampler.rollout.decoding import StopStrings, TokenSampler
from grpo.sampler.rollout.hf_engine import HFEngine
from grpo.sampler.rollout.vllm_arguments import VllmUnavailable, engine_arguments


def test_min_p_never_draws_below_its_share_of_the_likeliest_and_records_the_full_softmax():
    """softmax([4, 3, 0, -5]) = [0.7214, 0.2654, 0.0132, 0.0001]; min_p 0.2 keeps tokens above
    0.2 x 0.7214 = 0.144: 0 and 1, renormalised to [0.731, 0.269]."""
    logits = torch.tensor([[4.0, 3.0, 0.0, -5.0]])
    sampler = TokenSampler(1.0, min_p=0.2)
    drawn = [sampler.draw(logits, torch.tensor([[u]], dtype=torch.float64)).item() for u in (0.5, 0.72, 0.74, 0.9999)]
    assert drawn == [0, 0, 1, 1]
    full = torch.log_softmax(logits, -1)[0]
    assert [x.item() for x in sampler.logps] == [full[0].item(), full[0].item(), full[1].item(), full[1].item()]


def test_the_repetition_penalty_draws_from_the_penalised_logits_and_records_the_policys_log_prob():
    """Logits [2, 1, -1], tokens 0 and 2 seen, penalty 2: [1, 1, -2] (a positive logit halved, a
    negative one doubled), probabilities [0.4878, 0.4878, 0.0243]; recorded: log_softmax([2, 1, -1])."""
    logits, seen = torch.tensor([[2.0, 1.0, -1.0]]), torch.tensor([[True, False, True]])
    sampler = TokenSampler(1.0, repetition_penalty=2.0)
    penalised = torch.softmax(torch.tensor([1.0, 1.0, -2.0]), -1).cumsum(-1)
    assert penalised[0] == pytest.approx(0.4878, abs=1e-4)
    drawn = [sampler.draw(logits, torch.tensor([[u]], dtype=torch.float64), seen).item() for u in (0.48, 0.5, 0.98)]
    assert drawn == [0, 1, 2]
    full = torch.log_softmax(logits, -1)[0]
    assert [x.item() for x in sampler.logps] == [full[0].item(), full[1].item(), full[2].item()]
    assert TokenSampler(1.0, repetition_penalty=2.0, greedy=True).draw(logits, seen=seen).item() == 0  # plain argmax


@pytest.fixture(scope="module")
def digits(digit_model_dir):
    """The model that samples only digit tokens (nearly uniformly), with the real SmolLM2 tokenizer."""
    return AutoModelForCausalLM.from_pretrained(digit_model_dir).eval(), AutoTokenizer.from_pretrained(digit_model_dir)


PROMPTS = [[504, 314, 30, 2], [504, 314, 31, 32, 2], [504, 314, 2]]


def generated(engine, blocks: bool, **kwargs):
    generate = engine.generate_in_blocks if blocks else engine.generate
    return generate(PROMPTS, 3, seed=5, **kwargs)


@pytest.mark.parametrize("blocks", [False, True])
def test_a_stop_string_ends_each_completion_at_the_token_that_completes_it(digits, blocks):
    """The same seed with and without sampling.stop: each completion is the unstopped one up to the first
    token after which its text holds the stop string, that token kept, not truncated; the log-probs
    recorded for those tokens are the same."""
    model, tokenizer = digits
    free = generated(HFEngine(model, tokenizer, SamplingConfig(max_new_tokens=24, temperature=1.0)), blocks)
    stop = tokenizer.decode(free.completion_ids[0][5:7])  # two digits the first completion has
    stopped = generated(HFEngine(model, tokenizer, SamplingConfig(max_new_tokens=24, temperature=1.0, stop=[stop])),
                        blocks)
    ended = 0
    for whole, logps, cut, logps_cut, truncated in zip(free.completion_ids, free.logps, stopped.completion_ids,
                                                       stopped.logps, stopped.truncated):
        ends = [j + 1 for j in range(len(whole)) if stop in tokenizer.decode(whole[:j + 1])]
        length = ends[0] if ends else len(whole)
        assert torch.equal(cut, whole[:length]) and torch.equal(logps_cut, logps[:length])
        assert truncated == (not ends and len(whole) == 24)
        ended += bool(ends)
    assert ended >= 1 and stop in tokenizer.decode(stopped.completion_ids[0])


@pytest.mark.parametrize("blocks", [False, True])
def test_the_repetition_penalty_shapes_the_draw_and_the_recorded_log_probs_stay_the_trainers(digits, blocks):
    """The digit model's logits are ~56 on every digit: a penalty of 2 halves a seen digit's, so a row
    draws each digit its prompt and completion do not hold yet before any other (e^-28 against); the
    log-probs recorded are those the trainer recomputes, the unpenalised ones."""
    model, tokenizer = digits
    engine = HFEngine(model, tokenizer, SamplingConfig(max_new_tokens=10, temperature=1.0, repetition_penalty=2.0,
                                                       min_p=0.05))
    rollouts = generated(engine, blocks)
    digit_ids = set(tokenizer.convert_tokens_to_ids(list("0123456789")))
    for i, tokens in enumerate(rollouts.completion_ids):
        fresh = 10 - len(digit_ids & set(PROMPTS[i // 3]))
        assert len(set(tokens[:fresh].tolist())) == fresh, tokens  # no digit twice, none of the prompt's
        assert not set(tokens[:fresh].tolist()) & set(PROMPTS[i // 3])
    with torch.no_grad():
        recomputed = completion_logprobs(model, [torch.tensor(p) for p in PROMPTS], rollouts.completion_ids,
                                         [3, 3, 3], temperature=1.0)
    for recorded, again in zip(rollouts.logps, recomputed):  # logits of ~56: one float32 ulp is 3.8e-6, and the
        # decode loop's cached attention and the recompute's sum in other orders (a few ulps; penalised: ~28 apart)
        torch.testing.assert_close(recorded, again, rtol=0, atol=2e-5)
    assert max(abs(x) for r in rollouts.logps for x in r.tolist()) < math.log(20)  # ~uniform over ten digits


def test_stop_strings_are_read_from_the_completions_text_only():
    class Letters:
        def decode(self, tokens, skip_special_tokens=False):
            return "".join(chr(t) for t in tokens)

    stops = StopStrings(Letters(), ["</answer>"])
    assert not stops.hit([ord(c) for c in "<answer>4</answ"]) and stops.hit([ord(c) for c in "<answer>4</answer>"])
    assert not StopStrings(Letters(), []) and not StopStrings(Letters(), []).hit([1, 2])


def test_what_the_vllm_engine_records_otherwise_needs_the_recompute_and_stop_strings_need_no_episodes():
    for setting in ("sampling.min_p=0.1", "sampling.repetition_penalty=1.2"):
        cfg = load_config(None, ["sampling.engine=vllm", setting])
        name = setting.split("=")[0].split(".")[1]
        with pytest.raises(VllmUnavailable, match=f"the distribution {name} made, the trainer computes them over "
                                                  r"the full softmax\(logits / T\): use sampling.old_logps=recompute"):
            engine_arguments(cfg, cuda=False, available_bytes=64 * 2**30)
        assert engine_arguments(load_config(None, ["sampling.engine=vllm", setting, "sampling.old_logps=recompute"]),
                                cuda=False, available_bytes=64 * 2**30)["logprobs_mode"] == "processed_logprobs"
    with pytest.raises(ConfigError, match="sampling.stop ends a completion, and env.name=calculator makes episodes"):
        load_config(None, ["sampling.stop=['</answer>']", "env.name=calculator"])
    with pytest.raises(ConfigError, match=r"sampling.repetition_penalty must be > 0 \(1 = off\); got 0.0"):
        load_config(None, ["sampling.repetition_penalty=0"])


@pytest.mark.parametrize("setting", ["sampling.min_p=0.1", "sampling.repetition_penalty=1.2",
                                     "sampling.stop=['</answer>']", "lora.use_dora=true", "lora.use_rslora=true",
                                     "lora.modules_to_save=[lm_head]", "lora.target_modules=all-linear"])
def test_a_batch_made_with_other_generation_or_lora_settings_is_refused_naming_the_setting(setting):
    """Each batch records the settings that decide what was sampled and how the sampler's copy scores
    it (grpo/wire/behaviour.py); a trainer with other ones refuses the batch before training on it."""
    from grpo.settings.tree import get_key
    from grpo.wire.behaviour import BEHAVIOUR_KEYS, BehaviourMismatch, check_behaviour

    def recorded(*overrides):
        cfg = load_config(None, list(overrides))
        return {key: get_key(cfg, key) for key in BEHAVIOUR_KEYS}

    check_behaviour(recorded(setting), recorded(setting), sampler=0, step=1)
    key = setting.split("=")[0]
    with pytest.raises(BehaviourMismatch, match=f"{key}: the sampler used .*, this trainer has"):
        check_behaviour(recorded(setting), recorded(), sampler=0, step=1)
    # a batch spooled before the setting existed does not record it: its sampler ran as the default does
    older = {k: v for k, v in recorded().items() if k != key}
    check_behaviour(older, recorded(), sampler=0, step=1)
    with pytest.raises(BehaviourMismatch, match=f"{key}: the sampler used .*, this trainer has"):
        check_behaviour(older, recorded(setting), sampler=0, step=1)
