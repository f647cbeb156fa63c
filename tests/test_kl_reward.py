"""The KL in the reward (training.kl_in=reward, grpo/objective/kl_reward.py): the penalty on worked numbers,
a sampler step that subtracts it from each score before the advantages, the trainer's recompute of it
(a forged column refused), and a loss without the KL term."""

import dataclasses
import math

import pytest
import torch
from conftest import tiny_model
from engine_helpers import DigitTokenizer, FakeEngine, config, prompts

from grpo.model.logprobs import completion_logprobs
from grpo.objective import Objective, policy_loss
from grpo.objective.advantages import estimate_advantages
from grpo.objective.kl_reward import NAME, kl_penalties
from grpo.sampler.batches import SamplerModels, make_batch
from grpo.trainer.advantage_check import check_advantages
from grpo.wire.behaviour import BehaviourMismatch

LN = math.log


# sampled log-probs [ln 0.5, ln 0.25, ln 0.2], reference [ln 0.25, ln 0.25, ln 0.4]: d = ref - sampled =
# [-ln 2, 0, ln 2]; k1 = -d sums to 0; k3 = exp(d) - d - 1 = [0.5 + ln 2 - 1, 0, 2 - ln 2 - 1] sums to 0.5;
# k2 = d^2 / 2 sums to ln(2)^2. The third token an environment's (model mask False): k3 over the first two is
# ln 2 - 0.5.
@pytest.mark.parametrize("estimator, mask, expected", [
    ("k1", None, 0.0),
    ("k3", None, 0.5),
    ("k2", None, LN(2) ** 2),
    ("k3", [True, True, False], LN(2) - 0.5),
])
def test_the_penalty_is_minus_beta_times_the_completions_summed_kl(estimator, mask, expected):
    sampled = [torch.tensor([LN(0.5), LN(0.25), LN(0.2)]), torch.tensor([LN(0.3)])]
    ref = [torch.tensor([LN(0.25), LN(0.25), LN(0.4)]), torch.tensor([LN(0.3)])]
    masks = None if mask is None else [torch.tensor(mask), torch.tensor([True])]
    penalty = kl_penalties(sampled, ref, masks, beta=0.1, estimator=estimator)
    torch.testing.assert_close(penalty, torch.tensor([-0.1 * expected, 0.0]))


def test_a_sampler_step_subtracts_the_kl_from_each_score_and_the_trainer_recomputes_it():
    """Full fine-tune, the reference a frozen copy (here another random model, so that the KL is not 0):
    the batch's last reward column is -beta x each completion's summed k1 between the engine's log-probs
    and the reference's; the totals include it; the advantages are GRPO's of those totals; the logged
    `reward` is the rewards' alone."""
    cfg = config("training.beta=0.5", "training.kl_in=reward", "training.kl_estimator=k1", "lora.enabled=false",
                 "training.reference_on=sampler")
    reference = tiny_model(seed=4)
    policy = SamplerModels.of(cfg, FakeEngine(), tiny_model(), reference, DigitTokenizer(), {})
    batch = make_batch(cfg, policy, prompts(), step=1, metrics_so_far={}, measure_logp_gap=False)
    assert batch.reward_names == ["gsm8k_answer_lenient", NAME]
    with torch.no_grad():
        ref = [completion_logprobs(reference, [batch.prompt_ids[j // 2]], [c], [1], shared_prefix=False,
                                   temperature=cfg.sampling.temperature)[0] for j, c in enumerate(batch.completion_ids)]
    sampled = FakeEngine().generate([[0], [0]], 2).logps
    expected = torch.stack([-0.5 * (s - r).sum() for r, s in zip(ref, sampled)])  # [N], k1 = log pi - log pi_ref
    torch.testing.assert_close(batch.rewards[:, 1], expected, rtol=1e-5, atol=1e-6)
    # the answer reward: completions "7" and "8" against answers 7 and 8
    torch.testing.assert_close(batch.totals, torch.tensor([1.0, -1.0, -1.0, 1.0]) + expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(batch.advantages, estimate_advantages("grpo", batch.totals, 2, scale="group",
                                                             scored=batch.scored))
    metrics = batch.meta["metrics"]
    assert metrics["reward"] == 0.0 and metrics["rewards/kl_penalty/mean"] == pytest.approx(float(expected.mean()))
    check_advantages(batch, cfg)  # the trainer's recompute agrees
    forged = batch.rewards.clone()
    forged[0, 1] = 0.0  # a sampler that left its KL out of one score
    with pytest.raises(BehaviourMismatch, match="sample 0's KL penalty 0 is not -training.beta x its summed KL"):
        check_advantages(dataclasses.replace(batch, rewards=forged), cfg)
    with pytest.raises(BehaviourMismatch, match=r"the rewards \['gsm8k_answer_lenient', 'kl_penalty'\], this run's "
                                                r"are \['gsm8k_answer_lenient'\]"):
        check_advantages(batch, config("training.beta=0.5", "training.kl_estimator=k1", "lora.enabled=false",
                                       "training.reference_on=sampler"))


def test_with_the_kl_in_the_reward_the_loss_has_no_kl_term_but_reports_it():
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(3, 4, generator=g)
    old, ref = logps + 0.1, logps - 0.2
    adv, mask = torch.tensor([1.0, -0.5, 0.3]), torch.ones(3, 4, dtype=torch.bool)
    in_reward, metrics = policy_loss(Objective(beta=0.3, kl_in="reward"), logps, old, adv, mask, ref_logps=ref)
    without, _ = policy_loss(Objective(beta=0.0), logps, old, adv, mask)
    in_loss, loss_metrics = policy_loss(Objective(beta=0.3), logps, old, adv, mask, ref_logps=ref)
    assert in_reward.item() == without.item() != in_loss.item()
    assert metrics["kl"] == loss_metrics["kl"] == pytest.approx(math.exp(-0.2) + 0.2 - 1, rel=1e-5)
