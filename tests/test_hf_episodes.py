"""Episodes in one decode loop on the HF engine (grpo/sampler/rollout/hf_episodes.py) against a slow
reference: each episode alone, each turn `generate` on its whole context (re-prefilled), torch's
generator seeded with the turn's seed. Scripted environments in the real child-process pool, tiny
random Llama and Qwen2 models, episodes that end at different turns and lengths."""

import pytest
import torch

from conftest import REPO, tiny_model
from data.problems import Problem
from data.prompts import Prompt
from grpo.config import load_config
from grpo.environments.pool import EnvironmentPool
from grpo.sampler.episodes import EpisodeRunner
from grpo.sampler.rollout.hf_engine import HFEngine
from grpo.sampler.rollout.hf_episodes import episode_loop, episode_seed
from test_episodes import CharTokenizer
from test_episodes import chatty_model as chatty

ENVS = str(REPO / "tests" / "scripted_envs.py")
# not bit for bit: a message's KV comes from forwards of other shapes than the reference's one
# prefill of the whole context (a token at a time beside other rows, a reply fed with them), and the
# CPU matmul kernels block by their row count: the same token's keys ~1 ulp apart, the log-probs a
# few float32 ulps of their size. Relative, as float32 is: at |logp| >= 8 one ulp is already 9.5e-7.
LOGP_TOLERANCE = 1e-6  # times max(1, |logp|): ~8 ulps


class OneAtATime:
    """The reference: each episode alone, each turn `generate` on its whole context (every earlier
    turn prefilled again), seeded with the seed the decode loop gives that episode's turn."""

    def __init__(self, engine: HFEngine):
        self.engine = engine

    def run_episodes(self, prompts, group_size, on_turn, budget, *, seed=None, greedy=False):
        for j in range(len(prompts) * group_size):
            context, used, turn = list(prompts[j // group_size]), 0, 0
            while True:
                if not greedy:
                    torch.manual_seed(episode_seed(seed, j, turn))
                out = self.engine.generate([context], 1, greedy=greedy, max_new_tokens=[budget - used])
                ids = out.completion_ids[0]
                reply = on_turn(j, ids, out.logps[0], bool(out.truncated[0]))
                if reply is None:
                    break
                context += ids.tolist() + reply
                used, turn = used + len(ids) + len(reply), turn + 1


def prompts(lengths=(5, 8)):
    """Prompts of these lengths (different ones: left padding in the prefill)."""
    return [Prompt(Problem(f"train-{i}", f"What is {i} plus 0?", str(i)), [5 + (i + t) % 90 for t in range(length)])
            for i, length in enumerate(lengths)]


def run(model, engine_of=lambda engine: engine, *, greedy=False, batch=64, max_new_tokens=80, lengths=(5, 8),
        length=4, continued=True):
    """Prompts of `lengths` x 4 episodes of the Scripted environment (done at message `length`, at most 4 turns)."""
    cfg = load_config(None, [f"sampling.max_new_tokens={max_new_tokens}", "sampling.temperature=1.0",
                             f"sampling.generation_batch_size={batch}"]).sampling
    pool = EnvironmentPool(f"{ENVS}:Scripted", {"length": length}, 5.0)
    try:
        runner = EpisodeRunner(pool, CharTokenizer(), max_new_tokens, 4, continued=continued)
        engine = engine_of(HFEngine(model, CharTokenizer(), cfg))
        return runner.run(engine, prompts(lengths), 4, seed=11, greedy=greedy)
    finally:
        pool.close()


def assert_same_episodes(kept, again):
    gap = 0.0
    for a, b in zip(kept.rollouts.completion_ids, again.rollouts.completion_ids, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(kept.rollouts.model_masks, again.rollouts.model_masks, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(kept.rollouts.logps, again.rollouts.logps, strict=True):
        gap = max(gap, ((a - b).abs() / b.abs().clamp(min=1)).max().item() if len(a) else 0.0)
    assert gap <= LOGP_TOLERANCE, gap
    assert [e.turns for e in kept.episodes] == [e.turns for e in again.episodes]
    assert [e.truncated for e in kept.episodes] == [e.truncated for e in again.episodes]
    return gap


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
# all episodes in one batch; chunks of 3 rows; one prompt a block, one row a chunk; a one-token prompt beside a
# 4-token one; only one-token prompts (nothing prefilled: the cache grows from empty)
@pytest.mark.parametrize("batch, lengths", [(64, (5, 8)), (3, (5, 8, 6)), (1, (5, 8)), (3, (1, 4)), (64, (1, 1))])
def test_episodes_in_one_loop_draw_the_tokens_and_log_probs_of_each_alone_re_prefilled(kind, batch, lengths):
    """Under a seed, turn for turn, the episodes ending at different turns (done, at the turn limit, at the budget)."""
    model = chatty(kind)
    continued, alone = run(model, batch=batch, lengths=lengths), run(model, OneAtATime, batch=batch, lengths=lengths)
    assert_same_episodes(continued, alone)
    turns = {e.turns for e in continued.episodes}
    assert len(turns) >= 2 and max(turns) >= 3, turns  # ragged: some episodes went on after others ended


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_episodes_in_one_loop_equal_each_alone(kind):
    model = chatty(kind)
    assert_same_episodes(run(model, greedy=True, batch=5), run(model, OneAtATime, greedy=True, batch=5))


def test_the_seed_of_each_episodes_turn_is_its_own():
    seeds = {episode_seed(s, j, t) for s in (1, 2) for j in range(8) for t in range(4)}
    assert len(seeds) == 64


def forward_widths(model, lengths, **kwargs) -> list[tuple[int, int]]:
    """(rows, tokens fed) of each forward of a run of episodes."""
    shapes = []
    handle = model.register_forward_pre_hook(lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                             with_kwargs=True)
    try:
        run(model, lengths=lengths, **kwargs)
    finally:
        handle.remove()
    return shapes


def test_later_turns_feed_only_the_reply_and_the_prompt_is_prefilled_once():
    """The one forward wider than a reply is the prefill of the two prompts (40 and 43 tokens, one row
    each); turn by turn, each later turn reads its prompt again."""
    model = chatty("llama")
    continued, by_turn = forward_widths(model, (40, 43)), forward_widths(model, (40, 43), continued=False)
    assert continued[0] == (2, 42)  # the longer prompt but its last token
    assert max(width for _, width in continued[1:]) < 40, continued  # "\nreply 1 to 'abc'\n" and the message's end
    assert sum(width > 40 for _, width in by_turn) >= 2  # the re-prefilled later turns
    assert sum(r * w for r, w in continued) < sum(r * w for r, w in by_turn)


def test_ended_episodes_leave_the_batch():
    """8 episodes start in one batch; the rows fed shrink as episodes end, to one live row at the end."""
    rows = [r for r, _ in forward_widths(chatty("llama"), (5, 8))[1:]]
    assert rows[0] == 8 and rows == sorted(rows, reverse=True) and rows[-1] < 8


def test_a_model_with_sliding_window_layers_goes_turn_by_turn():
    """A sliding window's cache drops old positions, which the masked columns of a continued batch would count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                         max_window_layers=0, eos_token_id=1, pad_token_id=0)
    model = Qwen2ForCausalLM(config).eval()
    assert episode_loop(HFEngine(model, CharTokenizer(), load_config(None, []).sampling)) is None
    assert episode_loop(HFEngine(tiny_model("llama"), CharTokenizer(), load_config(None, []).sampling)) is not None
    by_turn, default = run(model, continued=False, max_new_tokens=24), run(model, max_new_tokens=24)
    for a, b in zip(by_turn.rollouts.completion_ids, default.rollouts.completion_ids, strict=True):
        assert torch.equal(a, b)  # the same path: one stream per turn, not per episode


def test_masked_columns_are_squeezed_out_without_changing_a_token(monkeypatch):
    """With the squeeze at every masked column (MIN_SQUEEZE 1, any share), the cache never holds a column
    masked in every row's view beyond its own, and the episodes are the reference's."""
    import grpo.sampler.rollout.hf_episodes as loop

    widths = []
    squeeze = loop.EpisodeBlock._squeeze

    def watched(self):
        squeeze(self)
        widths.append((self.mask.shape[1], int(self.mask.sum(-1).max()) if self.rows else 0))

    monkeypatch.setattr(loop, "MIN_SQUEEZE", 1)
    monkeypatch.setattr(loop, "COMPACT_FRACTION", 0.0)
    monkeypatch.setattr(loop.EpisodeBlock, "_squeeze", watched)
    model = chatty("llama")
    assert_same_episodes(run(model), run(model, OneAtATime))
    assert all(width == needed for width, needed in widths if needed), widths  # squeezed to the widest row
