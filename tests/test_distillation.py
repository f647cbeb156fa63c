"""On-policy distillation: the teacher's per-token signal on worked numbers and against a slow per-token loop
(values and gradients, whole and in micro-batches), the teacher's recorded log-probs against a recompute,
and a teacher whose tokenizer is not the model's refused by name."""

import math
import zlib

import pytest
import torch
from conftest import tiny_model
from engine_helpers import DigitTokenizer, FakeEngine, config, prompts
from test_losses import random_batch, slow_surrogate

from grpo.common.sources import ModelError
from grpo.config import load_config
from grpo.model.loading import add_lora, load_teacher, tokenizer_difference
from grpo.model.logprobs import completion_logprobs
from grpo.objective import Denominators, Objective, policy_loss
from grpo.objective.distillation import reverse_kl, token_advantages

LN = math.log


# behaviour (what sampled) and teacher log-probs of two completions, 3 and 2 tokens (the last of row 1 padding):
#   teacher - behaviour = [[ln 0.5 - ln 0.25, ln 0.2 - ln 0.4, 0], [ln 0.9 - ln 0.3, ln 0.1 - ln 0.1, pad]]
#                       = [[ln 2, -ln 2, 0], [ln 3, 0, 0]]
BEHAVIOUR = torch.tensor([[LN(0.25), LN(0.4), LN(0.5)], [LN(0.3), LN(0.1), -math.inf]])
TEACHER = torch.tensor([[LN(0.5), LN(0.2), LN(0.5)], [LN(0.9), LN(0.1), -math.inf]])
MASK = torch.tensor([[True, True, True], [True, True, False]])


def test_each_tokens_advantage_is_coef_times_the_teacher_less_the_sampled_log_prob():
    signal = token_advantages(torch.tensor([1.0, -2.0]), TEACHER, BEHAVIOUR, MASK, coef=0.5, with_rewards=False)
    torch.testing.assert_close(signal, torch.tensor([[0.5 * LN(2), -0.5 * LN(2), 0.0], [0.5 * LN(3), 0.0, 0.0]]))
    # with the rewards: each sample's advantage added to every one of its tokens
    both = token_advantages(torch.tensor([1.0, -2.0]), TEACHER, BEHAVIOUR, MASK, coef=0.5, with_rewards=True)
    torch.testing.assert_close(both[MASK], (signal + torch.tensor([[1.0], [-2.0]]))[MASK])
    # no teacher: the sample's advantage, broadcast
    assert torch.equal(token_advantages(torch.tensor([1.0, -2.0]), None, BEHAVIOUR, MASK, 0.0, False),
                       torch.tensor([[1.0], [-2.0]]))
    with pytest.raises(ValueError, match="carries no teacher log-probs"):
        token_advantages(torch.tensor([1.0, -2.0]), None, BEHAVIOUR, MASK, coef=1.0, with_rewards=False)
    # the reverse KL's estimate: mean of sampled - teacher over the 5 tokens = (-ln 2 + ln 2 + 0 - ln 3 + 0) / 5
    assert reverse_kl(TEACHER, BEHAVIOUR, MASK) == pytest.approx(-LN(3) / 5)


def test_on_policy_the_gradient_is_the_teachers_signal_times_grad_log_pi():
    """At r = 1 every token's gradient is -coef (teacher - sampled) / (its completion's tokens x completions):
    grpo aggregation, 2 completions; d loss / d log pi of row 0 token 0 = -0.5 ln 2 / (3 x 2)."""
    logps = torch.where(MASK, BEHAVIOUR, 0.0).requires_grad_(True)
    objective = Objective(distill_coef=0.5)
    loss, metrics = policy_loss(objective, logps, logps.detach(), torch.tensor([1.0, -2.0]), MASK,
                                teacher_logps=TEACHER)
    (grad,) = torch.autograd.grad(loss, logps)
    expected = -torch.tensor([[0.5 * LN(2) / 6, -0.5 * LN(2) / 6, 0.0], [0.5 * LN(3) / 4, 0.0, 0.0]])
    torch.testing.assert_close(grad, expected)
    # the loss's value: -(sum of the token advantages per completion / its tokens) / completions
    assert loss.item() == pytest.approx(-(0.0 / 3 + 0.5 * LN(3) / 2) / 2, abs=1e-7)
    assert metrics["distill/reverse_kl"] == pytest.approx(-LN(3) / 5)


def teacher_batch(seed):
    logps, old, adv, mask, ref = random_batch(seed)
    g = torch.Generator().manual_seed(seed + 1)
    teacher = old + torch.randn(old.shape, generator=g) * 0.5
    return logps, old, adv, mask, ref, teacher


@pytest.mark.parametrize("loss", ["ppo_clip", "cispo", "sapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("with_rewards", [False, True])
def test_the_loss_with_a_teacher_equals_the_slow_loop_values_and_gradients(loss, level, with_rewards):
    logps, old, adv, mask, ref, teacher = teacher_batch(zlib.crc32(f"{loss}/{level}/{with_rewards}".encode()) % 1000)
    objective = Objective(level=level, clip_low=0.1, clip_high=0.15, beta=0.05, loss=loss, aggregation="dapo",
                          distill_coef=0.7, distill_with_rewards=with_rewards, sapo_temperatures=(0.9, 1.2))
    tokens = int(mask.sum())
    whole, _ = policy_loss(objective, logps, old, adv, mask, ref_logps=ref, teacher_logps=teacher,
                           denominators=Denominators(7, tokens, 7))
    (grad,) = torch.autograd.grad(whole, logps)
    total = torch.zeros(())
    for i in range(logps.shape[0]):
        steps = [t for t in range(logps.shape[1]) if mask[i, t]]
        mean_log_ratio = sum(logps[i, t] - old[i, t] for t in steps) / len(steps)
        for t in steps:
            r = torch.exp(mean_log_ratio if level == "sequence" else logps[i, t] - old[i, t])
            a = 0.7 * (teacher[i, t] - old[i, t]) + (adv[i] if with_rewards else 0.0)
            d = ref[i, t] - logps[i, t]
            total = total + (slow_surrogate(loss, r, torch.clamp(r, 0.9, 1.15), a, logps[i, t], (0.9, 1.2))
                             + 0.05 * (torch.exp(d) - d - 1)) / tokens
    (slow_grad,) = torch.autograd.grad(total, logps)
    torch.testing.assert_close(whole, total, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, slow_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("aggregation", ["grpo", "dapo", "dr_grpo"])
def test_micro_batch_pieces_with_a_teacher_sum_to_the_whole(aggregation):
    logps, old, adv, mask, ref, teacher = teacher_batch(seed=5)
    objective = Objective(aggregation=aggregation, distill_coef=0.3, distill_with_rewards=True,
                          max_completion_length=8)
    counts = Denominators(7, int(mask.sum()), 7)
    whole, _ = policy_loss(objective, logps, old, adv, mask, teacher_logps=teacher, denominators=counts)
    (whole_grad,) = torch.autograd.grad(whole, logps)
    pieces = sum(policy_loss(objective, logps[rows], old[rows], adv[rows], mask[rows], teacher_logps=teacher[rows],
                             denominators=counts)[0] for rows in (slice(0, 3), slice(3, 4), slice(4, 7)))
    (pieces_grad,) = torch.autograd.grad(pieces, logps)
    torch.testing.assert_close(pieces, whole, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(pieces_grad, whole_grad, rtol=1e-6, atol=1e-8)


def test_the_sampler_ships_the_teachers_log_probs_of_each_sampled_token():
    """make_batch scores the completions under the teacher with the shared-prefix forward; each equals the
    teacher's forward over that one prompt and completion alone."""
    from grpo.sampler.batches import SamplerModels, make_batch

    cfg = config("distill.teacher=teacher-folder", "training.beta=0")
    teacher = tiny_model(seed=3)
    policy = SamplerModels.of(cfg, FakeEngine(), add_lora(tiny_model(), cfg.lora).eval(), None, DigitTokenizer(), {},
                              teacher=teacher)
    batch = make_batch(cfg, policy, prompts(), step=1, metrics_so_far={}, measure_logp_gap=False)
    assert batch.teacher_logps is not None and len(batch.teacher_logps) == len(batch.completion_ids) == 4
    with torch.no_grad():
        for j, completion in enumerate(batch.completion_ids):
            alone = completion_logprobs(teacher, [batch.prompt_ids[j // 2]], [completion], [1],
                                        temperature=cfg.sampling.temperature, shared_prefix=False)[0]
            torch.testing.assert_close(batch.teacher_logps[j], alone.float(), rtol=0, atol=1e-5)
    # without a teacher the batch carries none
    plain = SamplerModels.of(config(), FakeEngine(), policy.model, None, DigitTokenizer(), {})
    assert make_batch(config(), plain, prompts(), step=1, metrics_so_far={}, measure_logp_gap=False
                      ).teacher_logps is None


@pytest.fixture(scope="module")
def other_tokenizer_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a tokenizer that has one token more."""
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("other-tokenizer")
    shutil.copytree(tiny_model_dir, folder, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens(["<extra-token>"])
    tokenizer.save_pretrained(folder)
    return folder


def test_a_teacher_with_another_tokenizer_is_refused_by_name(tiny_model_dir, other_tokenizer_dir):
    from transformers import AutoTokenizer

    mine, other = (AutoTokenizer.from_pretrained(d) for d in (tiny_model_dir, other_tokenizer_dir))
    assert tokenizer_difference(mine, AutoTokenizer.from_pretrained(tiny_model_dir)) == ""
    assert tokenizer_difference(mine, other) == f"its vocabulary has {len(mine) + 1} tokens, the model's {len(mine)}"
    cfg = load_config(None, [f"model.name_or_path={tiny_model_dir}", f"distill.teacher={other_tokenizer_dir}"])
    with pytest.raises(ModelError, match="does not share the tokenizer of model.name_or_path=.*vocabulary has"):
        load_teacher(cfg, mine)
    same = load_config(None, [f"model.name_or_path={tiny_model_dir}", f"distill.teacher={tiny_model_dir}"])
    assert not load_teacher(same, mine).training
