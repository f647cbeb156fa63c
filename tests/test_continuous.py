"""Episodes in one decode loop on the HF engine (grpo/sampler/rollout/continuous.py) against a slow
reference: each episode alone, each turn `generate` on its whole context (re-prefilled), torch's
generator seeded with the turn's seed. Scripted environments in the real child-process pool, tiny
random Llama, Qwen2, DeepSeek-V3 (MLA) and MPT (ALiBi) models, episodes that end at different turns
and lengths, in float32 and in float64 (where the loop's log-probs are the reference's to the bit)."""

import functools
import time

import pytest
import torch
from conftest import REPO, tiny_model
from episode_helpers import CharTokenizer
from episode_helpers import chatty_model as chatty
from helpers import new_version_loader

from grpo.config import load_config
from grpo.data.problems import Problem
from grpo.data.prompts import Prompt
from grpo.environments.lanes import Lanes
from grpo.environments.pool import EnvironmentPool
from grpo.sampler.episodes import EpisodeRunner
from grpo.sampler.rollout.continuous import ContinuousLoop, episode_loop, run_episodes
from grpo.sampler.rollout.hf_engine import HFEngine
from grpo.sampler.rollout.loop_cache import masked_gap
from grpo.sampler.rollout.sequences import NewRow, episode_seed

ENVS = str(REPO / "tests" / "scripted_envs.py")
# not bit for bit: a message's KV comes from forwards of other shapes than the reference's one
# prefill of the whole context (a token at a time beside other rows, a reply fed with them), and the
# CPU matmul kernels block by their row count: the same token's keys ~1 ulp apart, the log-probs a
# few float32 ulps of their size. Relative, as float32 is: at |logp| >= 8 one ulp is already 9.5e-7.
LOGP_TOLERANCE = 1e-6  # times max(1, |logp|): ~8 ulps
# float64: the same shapes' differences sit ~1e-16 below the float32 the log-probs are recorded in: none left
TOLERANCE = {torch.float32: LOGP_TOLERANCE, torch.float64: 0.0}


def chatty_in(kind: str, dtype: torch.dtype):
    return chatty(kind).to(dtype)


class OneAtATime:
    """The reference: each episode alone, each turn `generate` on its whole context (every earlier
    turn prefilled again), seeded with the seed the decode loop gives that episode's turn."""

    def __init__(self, engine: HFEngine):
        self.engine = engine

    def run_episodes(self, prompts, group_size, on_turn, budget, *, seed=None, greedy=False, executor=None):
        for j in range(len(prompts) * group_size):
            context, used, turn = list(prompts[j // group_size]), 0, 0
            while True:
                if not greedy:
                    torch.manual_seed(episode_seed(seed, j, turn))
                out = self.engine.generate_in_blocks([context], 1, greedy=greedy, max_new_tokens=[budget - used])
                ids = out.completion_ids[0]
                reply = on_turn(j, ids, out.logps[0], bool(out.truncated[0]))
                if reply is None:
                    break
                # a NewRow: the context starts again after the prompt
                context = list(prompts[j // group_size]) + reply if isinstance(reply, NewRow) else \
                    context + ids.tolist() + reply
                used, turn = used + len(ids) + len(reply), turn + 1


def prompts(lengths=(5, 8)):
    """Prompts of these lengths (different ones: left padding in the prefill)."""
    return [Prompt(Problem(f"train-{i}", f"What is {i} plus 0?", str(i)), [5 + (i + t) % 90 for t in range(length)])
            for i, length in enumerate(lengths)]


def run(model, engine_of=lambda engine: engine, *, greedy=False, batch=64, max_new_tokens=80, lengths=(5, 8),
        length=4, continued=True, feed=16, env="Scripted", batching=True, lanes=1, staleness=1, penalty=1.0,
        **env_args):
    """Prompts of `lengths` x 4 episodes of the Scripted environment (done at message `length`, at most 4 turns),
    replies fed at most `feed` tokens a step (0: at once); `batching=False`: blocks, the environment called
    inside the loop (forwards whose shapes do not follow the environment's timing); `lanes` environment
    calls at once (grpo/environments/lanes.py), overlapping the decoding unless `staleness` is 0."""
    cfg = load_config(None, [f"sampling.max_new_tokens={max_new_tokens}", "sampling.temperature=1.0",
                             f"sampling.generation_batch_size={batch}", f"sampling.continuous_batching={batching}",
                             f"sampling.episode_feed_tokens={feed}", f"sampling.max_staleness={staleness}",
                             f"sampling.repetition_penalty={penalty}"]).sampling
    pool = lanes if isinstance(lanes, Lanes) else Lanes(
        lambda first: EnvironmentPool(f"{ENVS}:{env}", {"length": length, **env_args}, 5.0), lanes)
    try:
        runner = EpisodeRunner(pool, CharTokenizer(), max_new_tokens, 4, continued=continued)
        engine = engine_of(HFEngine(model, CharTokenizer(), cfg))
        return runner.run(engine, prompts(lengths), 4, seed=11, greedy=greedy)
    finally:
        pool.close()


def assert_same_episodes(kept, again, tolerance=LOGP_TOLERANCE):
    """The same tokens, masks, turns and cuts; log-probs within `tolerance` x max(1, |logp|)."""
    gap = 0.0
    for a, b in zip(kept.rollouts.completion_ids, again.rollouts.completion_ids, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(kept.rollouts.model_masks, again.rollouts.model_masks, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(kept.rollouts.logps, again.rollouts.logps, strict=True):
        gap = max(gap, ((a - b).abs() / b.abs().clamp(min=1)).max().item() if len(a) else 0.0)
    assert gap <= tolerance, gap
    assert [e.turns for e in kept.episodes] == [e.turns for e in again.episodes]
    assert [e.truncated for e in kept.episodes] == [e.truncated for e in again.episodes]
    return gap


# all episodes in one batch (each architecture in each precision); chunks of 3 rows; one prompt a block, one row
# a chunk; a one-token prompt beside a 4-token one; only one-token prompts (nothing prefilled: the cache grows
# from empty): each of these in both architectures, one in float32 and the other in float64
LAYOUTS = [(64, (5, 8)), (3, (5, 8, 6)), (1, (5, 8)), (3, (1, 4)), (64, (1, 1))]
DTYPES = {"float32": torch.float32, "float64": torch.float64}
EPISODE_CASES = sorted({(kind, 64, (5, 8), dtype) for kind in ("llama", "qwen2") for dtype in DTYPES}
                       | {(kind, batch, lengths, ("float32", "float64")[(i + (kind == "qwen2")) % 2])
                          for i, (batch, lengths) in enumerate(LAYOUTS[1:]) for kind in ("llama", "qwen2")})


@pytest.mark.parametrize("kind, batch, lengths, dtype", EPISODE_CASES,
                         ids=[f"{k}-{b}-{'.'.join(map(str, n))}-{d}" for k, b, n, d in EPISODE_CASES])
def test_episodes_in_one_loop_draw_the_tokens_and_log_probs_of_each_alone_re_prefilled(kind, batch, lengths, dtype):
    """Under a seed, turn for turn, the episodes ending at different turns (done, at the turn limit, at the budget)."""
    dtype = DTYPES[dtype]
    model = chatty_in(kind, dtype)
    continued, alone = run(model, batch=batch, lengths=lengths), run(model, OneAtATime, batch=batch, lengths=lengths)
    assert_same_episodes(continued, alone, TOLERANCE[dtype])
    turns = {e.turns for e in continued.episodes}
    assert len(turns) >= 2 and max(turns) >= 3, turns  # ragged: some episodes went on after others ended


@pytest.mark.parametrize("batch, feed", [(64, 16), (3, 16), (3, 2)])
def test_with_a_repetition_penalty_episodes_in_one_loop_draw_what_each_draws_alone(batch, feed):
    """The loop keeps each row's seen tokens with the batch (built at a regroup, then each step's feed set in):
    through regroups, replies fed in pieces and parked rows, each draw is the one-at-a-time reference's, whose
    seen tokens are read from the whole context each time."""
    model = chatty_in("llama", torch.float64)
    continued = run(model, batch=batch, feed=feed, penalty=1.5)
    assert_same_episodes(continued, run(model, OneAtATime, batch=batch, penalty=1.5), TOLERANCE[torch.float64])
    assert [c.tolist() for c in continued.rollouts.completion_ids] != [
        c.tolist() for c in run(model, batch=batch, feed=feed).rollouts.completion_ids]  # the penalty drew otherwise


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_greedy_episodes_in_one_loop_equal_each_alone(kind, dtype):
    model = chatty_in(kind, dtype)
    assert_same_episodes(run(model, greedy=True, batch=5), run(model, OneAtATime, greedy=True, batch=5),
                         TOLERANCE[dtype])


class TimedLanes(Lanes):
    """Lanes that record when each environment step started and ended."""

    def __init__(self, make, count):
        super().__init__(make, count)
        self.steps = []

    def call(self, key, method, *args, **kwargs):
        start = time.perf_counter()
        try:
            return super().call(key, method, *args, **kwargs)
        finally:
            if method == "step":
                self.steps.append((start, time.perf_counter()))


def most_at_once(intervals) -> int:
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = most = 0
    for _, change in edges:
        running += change
        most = max(most, running)
    return most


@pytest.mark.parametrize("staleness, batch", [(1, 3), (0, 8)], ids=["overlapped", "on-policy"])
def test_episodes_of_a_slow_environment_call_it_at_once_and_draw_what_each_draws_alone(staleness, batch):
    """8 episodes of an environment taking 0.2 s a step, 4 lanes: the calls of different episodes run at
    once, and every episode is the reference's: the same tokens, log-probs to float32 rounding.
    Off-policy, 3 rows decoding: a row waiting on its environment leaves the batch and joins again when
    its reply is in. On-policy, 8 rows: waiting rows stay, their replies taken two at a time or when
    nothing else decodes."""
    model = chatty("llama")
    lanes = TimedLanes(lambda first: EnvironmentPool(f"{ENVS}:Slow", {"length": 3, "delay": 0.2}, 5.0), 4)
    got = run(model, batch=batch, lanes=lanes, staleness=staleness)
    assert_same_episodes(got, run(model, OneAtATime, length=3))
    assert len(lanes.steps) > 8  # a step per message the environment took: some episodes went on
    assert most_at_once(lanes.steps) >= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_completions_refilled_into_a_small_batch_draw_what_each_draws_alone(dtype):
    """3 prompts x 4 completions, limits 30, 12 and 20, 3 rows at a time: as rows end the next completions
    take their slots, and each completion is `generate` on its prompt alone, seeded with its own seed
    (tokens, cuts; log-probs to float32 rounding, to the bit in float64). Fewer decode steps than in blocks,
    each running as many rows or more."""
    model = chatty_in("qwen2", dtype)
    cfg = load_config(None, ["sampling.max_new_tokens=30", "sampling.temperature=1.0",
                             "sampling.generation_batch_size=3"]).sampling
    engine = HFEngine(model, CharTokenizer(), cfg)
    ids, limits = [p.token_ids for p in prompts((5, 8, 1))], [30, 12, 20]
    got = engine.generate(ids, 4, seed=11, max_new_tokens=limits)
    continuous = engine.decode_rows.take()
    for j in range(12):
        torch.manual_seed(episode_seed(11, j, 0))
        alone = engine.generate_in_blocks([ids[j // 4]], 1, max_new_tokens=[limits[j // 4]])
        assert torch.equal(got.completion_ids[j], alone.completion_ids[0]) and got.truncated[j] == alone.truncated[0]
        gap = ((got.logps[j] - alone.logps[0]).abs() / alone.logps[0].abs().clamp(min=1)).max().item()
        assert gap <= TOLERANCE[dtype], gap
    assert any(got.truncated) and not all(got.truncated)
    engine.decode_rows.take()
    engine.generate_in_blocks(ids, 4, seed=11, max_new_tokens=limits)
    blocks = engine.decode_rows.take()
    assert continuous["sampler/decode_steps"] < blocks["sampler/decode_steps"]
    assert continuous["sampler/live_rows_per_decode_step"] >= blocks["sampler/live_rows_per_decode_step"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_the_next_calls_completions_fill_the_rows_a_call_leaves_free_and_are_what_it_would_draw(dtype):
    """generate(A, then=B) starts B's completions in the rows A's leave at its end; a greedy call between
    (an evaluation) leaves them; generate(B) finds them started and finishes them in fewer decode steps
    than from scratch. A's and B's completions are those of each call made alone (tokens, cuts;
    log-probs to float32 rounding, to the bit in float64)."""
    from grpo.sampler.rollout.sequences import NextCall

    model = chatty_in("qwen2", dtype)
    cfg = load_config(None, ["sampling.max_new_tokens=30", "sampling.temperature=1.0",
                             "sampling.generation_batch_size=4"]).sampling
    engine = HFEngine(model, CharTokenizer(), cfg)
    a, b = [p.token_ids for p in prompts((5, 8))], [p.token_ids for p in prompts((6, 1, 7))]
    alone_a, alone_b = engine.generate(a, 4, seed=11), engine.generate(b, 4, seed=12)
    engine.decode_rows.take()
    engine.generate(b, 4, seed=12)
    from_scratch = engine.decode_rows.take()["sampler/decode_steps"]

    got_a = engine.generate(a, 4, seed=11, then=NextCall(b, 4, 12))
    started = sum(s.call is engine.carried.call for s in engine.carried.loop.rows)
    assert started > 0 and engine.carried.call.pending == 12
    engine.generate(a[:1], 2, greedy=True)  # an evaluation between the steps
    assert engine.carried is not None
    engine.decode_rows.take()
    got_b = engine.generate(b, 4, seed=12)
    assert engine.carried is None and engine.decode_rows.take()["sampler/decode_steps"] < from_scratch
    for got, alone in ((got_a, alone_a), (got_b, alone_b)):
        for j in range(len(alone.completion_ids)):
            assert (torch.equal(got.completion_ids[j], alone.completion_ids[j])
                    and got.truncated[j] == alone.truncated[j])
            gap = ((got.logps[j] - alone.logps[j]).abs() / alone.logps[j].abs().clamp(min=1)).max().item()
            assert gap <= TOLERANCE[dtype], gap


def test_new_weights_drop_the_started_completions_and_they_are_made_again_with_them(tmp_path):
    """generate(A, then=B), then a published version loaded: B is made from scratch with the new weights
    (the tokens of B generated alone by a model that holds them), not from rows the old ones started."""
    import copy

    from grpo.sampler.rollout.sequences import NextCall
    from grpo.weights.folder import publish, verify

    model = chatty_in("llama", torch.float32)
    cfg = load_config(None, ["sampling.max_new_tokens=20", "sampling.temperature=1.0",
                             "sampling.generation_batch_size=4"]).sampling
    engine = HFEngine(model, CharTokenizer(), cfg)
    a, b = [p.token_ids for p in prompts((5, 8))], [p.token_ids for p in prompts((6, 7))]
    engine.generate(a, 4, seed=1, then=NextCall(b, 4, 2))
    assert sum(s.call is engine.carried.call for s in engine.carried.loop.rows) > 0
    newer = copy.deepcopy(model)
    with torch.no_grad():
        newer.lm_head.weight.mul_(1.5)
    folder = publish(newer, tmp_path, 1, 1)
    engine.load_weights(folder, verify(folder), 1)
    assert engine.carried is None and engine.version == 1
    got = engine.generate(b, 4, seed=2)
    alone = HFEngine(newer, CharTokenizer(), cfg).generate(b, 4, seed=2)
    before = HFEngine(copy.deepcopy(newer).requires_grad_(False), CharTokenizer(), cfg)
    with torch.no_grad():
        before.model.lm_head.weight.div_(1.5)  # the old weights again
    old = before.generate(b, 4, seed=2)
    assert [c.tolist() for c in got.completion_ids] == [c.tolist() for c in alone.completion_ids]
    assert [c.tolist() for c in got.completion_ids] != [c.tolist() for c in old.completion_ids]


def test_a_call_other_than_the_one_announced_drops_the_started_completions():
    from grpo.sampler.rollout.sequences import NextCall

    model = chatty_in("llama", torch.float32)
    engine = HFEngine(model, CharTokenizer(), load_config(None, ["sampling.max_new_tokens=20",
                                                                  "sampling.generation_batch_size=4"]).sampling)
    a = [p.token_ids for p in prompts((5, 8))]
    engine.generate(a, 4, seed=1, then=NextCall(a, 4, 2))
    assert engine.carried is not None
    engine.generate(a, 4, seed=3, then=NextCall(a, 4, 4))  # not seed 2: made from scratch, a new one carried
    assert engine.carried.call.seed == 4
    engine.generate(a, 4, seed=5)  # sampled, not the one announced
    assert engine.carried is None


def test_the_seed_of_each_episodes_turn_is_its_own():
    seeds = {episode_seed(s, j, t) for s in (1, 2) for j in range(8) for t in range(4)}
    assert len(seeds) == 64


def forward_widths(model, lengths, **kwargs) -> list[tuple[int, int]]:
    """(rows, tokens fed) of each forward of a run of episodes (after the model's masked-gap probe)."""
    assert episode_loop(HFEngine(model, CharTokenizer(), load_config(None, []).sampling)) is not None
    shapes = []
    handle = model.register_forward_pre_hook(lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                             with_kwargs=True)
    try:
        run(model, lengths=lengths, batching=False, **kwargs)
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


def test_in_flight_updates_on_a_model_that_decodes_in_blocks_are_said_once_and_not_asked(caplog):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                         max_window_layers=0, eos_token_id=1, pad_token_id=0)
    engine = HFEngine(Qwen2ForCausalLM(config).eval(), CharTokenizer(),
                      load_config(None, ["sampling.max_new_tokens=6"]).sampling)
    asked = []
    engine.poll_weights = lambda: asked.append(1) or False
    with caplog.at_level("WARNING", logger="grpo.sampler.rollout.hf_engine"):
        for _ in range(2):
            engine.generate([p.token_ids for p in prompts((5,))], 2, seed=1)
    assert asked == [] and engine.poll_weights is None
    assert [r.getMessage() for r in caplog.records] == [
        "sampling.in_flight_updates: this model decodes in blocks (its attention depends on where a cached column "
        "sits: ALiBi, sliding windows), so new weights load between steps only"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_masked_columns_are_squeezed_out_without_changing_a_token(monkeypatch, dtype):
    """With the squeeze at every masked column (MIN_SQUEEZE 1, any share), the cache never holds a column
    masked in every row's view beyond its own, and the episodes are the reference's."""
    import grpo.sampler.rollout.continuous as loop

    widths = []
    squeeze = loop.ContinuousLoop._squeeze

    def watched(self):
        squeeze(self)
        widths.append((self.mask.shape[1], int(self.mask.sum(-1).max()) if self.rows else 0))

    monkeypatch.setattr(loop, "MIN_SQUEEZE", 1)
    monkeypatch.setattr(loop, "COMPACT_FRACTION", 0.0)
    monkeypatch.setattr(loop.ContinuousLoop, "_squeeze", watched)
    model = chatty_in("llama", dtype)
    assert_same_episodes(run(model), run(model, OneAtATime), TOLERANCE[dtype])
    assert all(width == needed for width, needed in widths if needed), widths  # squeezed to the widest row


# ----------------------------------------------------------------------------- long replies, a few tokens a step

@pytest.mark.parametrize("feed", [1, 8, 0], ids=["feed1", "feed8", "whole"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_long_replies_fed_a_few_tokens_a_step_give_each_episodes_tokens_alone(feed, dtype):
    """Replies of 91 tokens fed 1 or 8 a step, or at once: the episodes are the reference's."""
    model = chatty_in("llama", dtype)
    long = dict(env="LongReplies", words=30, max_new_tokens=400)
    assert_same_episodes(run(model, feed=feed, **long), run(model, OneAtATime, **long), TOLERANCE[dtype])


def fed_per_forward(model, **kwargs) -> list[tuple[int, list[int]]]:
    """Each forward of a run of episodes after the prefill: its width and the tokens each row fed (the
    last columns of its attention mask that are set)."""
    assert episode_loop(HFEngine(model, CharTokenizer(), load_config(None, []).sampling)) is not None
    steps = []

    def record(_, args, kwargs):
        width = kwargs["input_ids"].shape[1]
        steps.append((width, kwargs["attention_mask"][:, -width:].sum(-1).tolist()))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        run(model, batching=False, **kwargs)
    finally:
        handle.remove()
    return steps[1:]


def test_a_long_reply_no_longer_widens_the_step_of_every_other_episode():
    """Prompt 0's episodes get replies of 91 tokens, prompt 1's "ok". Fed at once, a row decoding one token
    runs in a step 92 wide (the message's last token and the reply); fed at most 8 a step, no such step is
    wider than 8, and a wider one masks no live row's column: every row in it feeds its whole width."""
    model = chatty("llama")
    long = dict(env="LongReplies", words=30, only="0", max_new_tokens=400)
    at_once, capped = fed_per_forward(model, feed=0, **long), fed_per_forward(model, feed=8, **long)
    assert max(width for width, fed in at_once if 1 in fed) == 92
    assert max(width for width, fed in capped if 1 in fed) == 8
    assert all(set(fed) <= {0, width} for width, fed in capped if width > 8)  # 0: a row that waits to leave
    computed = [sum(width * len(fed) for width, fed in steps) for steps in (at_once, capped)]
    assert computed[1] < computed[0] / 2, computed  # token-rows of the forwards, masked ones included


# ----------------------------------------------------------------------------- which models continue

def with_chatty_head(model):
    """The head of `chatty_model`: logits of order 1 that favour EOS (~11% a token)."""
    head = torch.nn.Linear(32, 101, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.get_output_embeddings().weight * 10)
        head.bias.zero_()
        head.bias[1] = 2.5
    model.lm_head = head
    return model.eval()


def tiny_mpt():
    """A random 2-layer MPT: ALiBi, attention biased by the distance between columns."""
    from transformers import MptConfig, MptForCausalLM

    torch.manual_seed(0)
    config = MptConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=101, max_seq_len=512, pad_token_id=0,
                       eos_token_id=1)
    return with_chatty_head(MptForCausalLM(config))


def tiny_mla(dtype=torch.float32):
    """A random 2-layer DeepSeek-V3 (dense): multi-head latent attention, whose cached keys and values
    differ in head size."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                              q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                              max_position_embeddings=512, eos_token_id=1, pad_token_id=0, bos_token_id=2,
                              tie_word_embeddings=False, attn_implementation="sdpa")
    return with_chatty_head(DeepseekV3ForCausalLM(config)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_the_probe_tells_alibi_from_rotary_positions(dtype):
    """Masked columns between cached ones move MPT's log-probs by 0.51 on this tiny random model (ALiBi; in
    float64 its padded forward is NaN: inf), and Llama's, Qwen2's and DeepSeek-V3's by rounding at most: the
    probe's two layouts have the same shapes."""
    assert masked_gap(tiny_mpt().to(dtype)) > 0.5
    # the same shapes on another CPU's kernels can round apart (3e-8 seen in float32): far within the tolerance
    rounding = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float64: 1e-12}[dtype]
    for model in (tiny_model("llama", dtype=dtype), tiny_model("qwen2", dtype=dtype), tiny_mla(dtype)):
        assert masked_gap(model) <= rounding


class ForcedLoop:
    """The one-loop path on any model, the probe skipped."""

    def __init__(self, engine: HFEngine):
        self.run_episodes = functools.partial(run_episodes, engine)


def test_a_model_whose_attention_depends_on_a_columns_place_goes_turn_by_turn():
    """On MPT the loop's episodes are not the ones each generates alone (ALiBi counts the masked columns
    as distance): its episodes go turn by turn, the path that is right for it."""
    model = tiny_mpt()
    assert episode_loop(HFEngine(model, CharTokenizer(), load_config(None, []).sampling)) is None
    assert_same_episodes(run(model), run(model, continued=False), 0.0)
    forced, alone = run(model, ForcedLoop), run(model, OneAtATime)
    same = sum(torch.equal(a, b) for a, b in zip(forced.rollouts.completion_ids, alone.rollouts.completion_ids))
    gaps = [(a[:len(b)] - b[:len(a)]).abs().max().item() for a, b in zip(forced.rollouts.logps, alone.rollouts.logps)]
    assert same < 8 and max(gaps) > 1e-2, (same, gaps)


def test_the_probe_runs_once_per_model(monkeypatch):
    import grpo.sampler.rollout.loop_cache as probe

    calls = []
    monkeypatch.setattr(probe, "masked_gap", lambda model: calls.append(model) or 0.0)
    model, cfg = tiny_model("llama"), load_config(None, []).sampling
    assert all(episode_loop(HFEngine(model, CharTokenizer(), cfg)) is not None for _ in range(3))
    assert calls == [model]


@pytest.mark.parametrize("batch, lengths", [(64, (5, 8)), (64, (1, 1))], ids=["prefilled", "one-token-prompts"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_episodes_of_a_model_whose_keys_and_values_differ_in_size(monkeypatch, batch, lengths, dtype):
    """DeepSeek-V3's multi-head latent attention caches keys of 16 and values of 8 per position: repeated
    to the rows after the prefill (in place) or grown from one-token prompts, and squeezed at every masked
    column, the episodes are the reference's."""
    from transformers import DynamicCache

    import grpo.sampler.rollout.continuous as loop

    model = tiny_mla(dtype)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=True)
    assert (cache.layers[0].keys.shape[-1], cache.layers[0].values.shape[-1]) == (16, 8)
    monkeypatch.setattr(loop, "MIN_SQUEEZE", 1)
    monkeypatch.setattr(loop, "COMPACT_FRACTION", 0.0)
    continued = run(model, batch=batch, lengths=lengths)
    assert_same_episodes(continued, run(model, OneAtATime, batch=batch, lengths=lengths), TOLERANCE[dtype])
    assert max(e.turns for e in continued.episodes) >= 3


# ----------------------------------------------------------------------------- the cache, the budget

def test_a_long_reply_grows_the_cache_once_with_room_after_it():
    """After 200 positions at once, the buffer holds GROWTH (64) free positions: the next token is written
    in place, not into a buffer copied again."""
    from transformers.cache_utils import DynamicLayer

    from grpo.sampler.rollout.decoding import InPlaceLayer

    prefill = DynamicLayer()
    keys, values = torch.randn(2, 1, 3, 16), torch.randn(2, 1, 3, 16)
    prefill.update(keys, values)
    layer = InPlaceLayer.repeated(prefill, 2)
    assert layer.key_buffer.shape == layer.value_buffer.shape == (4, 1, 67, 16)
    reply = torch.randn(4, 1, 200, 16), torch.randn(4, 1, 200, 16)
    layer.update(*reply)
    buffer = layer.key_buffer
    assert buffer.shape[2] == 203 + 64
    token = torch.randn(4, 1, 1, 16), torch.randn(4, 1, 1, 16)
    layer.update(*token)
    assert layer.key_buffer is buffer and layer.keys.shape[2] == 204
    assert torch.equal(layer.keys, torch.cat([keys.repeat_interleave(2, 0), reply[0], token[0]], dim=2))
    assert torch.equal(layer.values, torch.cat([values.repeat_interleave(2, 0), reply[1], token[1]], dim=2))


def test_the_loop_refuses_a_reply_that_leaves_no_room_in_the_budget():
    """The budget of 30 tokens is the loop's own to keep: a reply that fills what the message left is an
    error, never a message drawn past it; a budget below one token too."""
    engine = HFEngine(chatty("llama"), CharTokenizer(), load_config(None, ["sampling.temperature=1.0"]).sampling)
    seen = []

    def fills(j, ids, logps, truncated):  # the whole budget, then the episode ends (at its 4th message)
        seen.append(len(ids))
        return [5] * (30 - len(ids)) if len(seen) < 4 else None

    with pytest.raises(ValueError, match=r"leaves no room for another message within the episode's budget of 30 "
                                         r"tokens \(30 used with it\)"):
        run_episodes(engine, [[5, 6, 7]], 2, fills, 30, seed=3)
    assert seen and seen[0] < 30
    with pytest.raises(ValueError, match="budget must be at least 1; got 0"):
        run_episodes(engine, [[5, 6, 7]], 2, fills, 0, seed=3)


# ----------------------------------------------------------------------------- a new row: the context starts again

def restarting(records: dict, delay: float = 0.0):
    """on_turn: a reply after the first message; after the second, odd episodes start their context again (a NewRow:
    the prompt, then 4 tokens), even ones get a reply; none after the fourth. `records`: each message, per episode."""
    def on_turn(j, ids, logps, truncated):
        records.setdefault(j, []).append((ids.tolist(), logps))
        time.sleep(delay)
        turn = len(records[j]) - 1
        if truncated or turn == 3:
            return None
        if turn == 1 and j % 2:
            return NewRow([20 + j, 21, 22, 23])
        return [30, 31 + j % 3]
    return on_turn


@pytest.mark.parametrize("lengths, delay, penalty, dtype", [
    ((5, 8), 0.0, 1.0, torch.float64), ((1, 4), 0.0, 1.3, torch.float32), ((5, 8), 0.05, 1.0, torch.float32)],
    ids=["in-batch-float64", "one-token-prompt-penalty", "parked"])
def test_a_new_row_goes_on_from_the_prompt_alone_as_a_sequence_with_that_context(monkeypatch, lengths, delay, penalty,
                                                                               dtype):
    """An episode whose reply is a NewRow draws its next messages as the reference does from the prompt and that
    reply alone (the same tokens under the seed, log-probs to float32 rounding, to the bit in float64): its row in
    the batch rewound to the prompt (its later columns masked), or, parked out of the batch while its environment
    took 50 ms, its KV cut to the prompt's; with one-token prompts nothing is cached to keep."""
    from concurrent.futures import ThreadPoolExecutor

    from grpo.sampler.rollout.loop_cache import LoopCache

    rewound = []
    rewind = LoopCache._rewind
    monkeypatch.setattr(LoopCache, "_rewind", lambda loop, s: (rewound.append(s.in_batch), rewind(loop, s)))
    cfg = load_config(None, ["sampling.temperature=1.0", "sampling.generation_batch_size=3",
                             f"sampling.repetition_penalty={penalty}"]).sampling
    engine = HFEngine(chatty_in("llama", dtype), CharTokenizer(), cfg)
    ids = [p.token_ids for p in prompts(lengths)]
    got, alone = {}, {}
    with ThreadPoolExecutor(4) as executor:
        run_episodes(engine, ids, 4, restarting(got, delay), 80, seed=11, executor=executor if delay else None)
    OneAtATime(engine).run_episodes(ids, 4, restarting(alone), 80, seed=11)
    assert got.keys() == alone.keys()
    for j in got:
        assert [m for m, _ in got[j]] == [m for m, _ in alone[j]]
        for (_, a), (_, b) in zip(got[j], alone[j]):
            assert ((a - b).abs() / b.abs().clamp(min=1)).max().item() <= TOLERANCE[dtype]
    restarted = [j for j in got if j % 2 and len(got[j]) >= 3]
    assert restarted and len(rewound) == len(restarted)
    assert (False in rewound) if delay else all(rewound)  # parked while its environment ran, or in the batch


# ----------------------------------------------------------------------------- an EOS drawn at the message limit

def messages_of(engine, budget: int) -> dict:
    """episode -> its messages (tokens, cut) under `budget`: a 3-token reply after the first (when it
    fits), none after the second. On the loop and on the reference alike."""
    out = {}

    def on_turn(j, ids, logps, truncated):
        out.setdefault(j, []).append((ids.tolist(), truncated, logps.tolist()))
        used = sum(len(m[0]) for m in out[j]) + 3 * (len(out[j]) - 1)
        return [5, 6, 7] if len(out[j]) == 1 and not truncated and used + 3 < budget else None

    engine.run_episodes([[5, 6, 7], [8, 9]], 2, on_turn, budget, seed=3)
    return out


def test_an_eos_drawn_at_the_message_limit_ends_the_message_uncut():
    """With room for 60 tokens, episode 0 writes messages of L1 = 7 and L2 = 12 tokens, each ended by EOS. With a
    budget of exactly L1 (then L1 + 3 + L2), its first (then second) message draws EOS as the last token it
    may: a whole message, not a cut one; one token less and it is cut before its EOS. The loop and the
    reference agree on every message of every episode (float64: log-probs to the bit)."""
    model = chatty_in("llama", torch.float64)
    engine = HFEngine(model, CharTokenizer(), load_config(None, ["sampling.temperature=1.0"]).sampling)
    loop, alone = ForcedLoop(engine), OneAtATime(engine)
    free = messages_of(loop, 60)[0]
    (first, cut1, _), (second, cut2, _) = free
    assert (len(first), len(second)) == (7, 12) and first[-1] == second[-1] == 1 and not cut1 and not cut2
    for budget, turn in ((len(first), 0), (len(first) + 3 + len(second), 1)):
        for room, cut in ((budget, False), (budget - 1, True)):
            got = messages_of(loop, room)
            assert got == messages_of(alone, room)
            ids, truncated, _ = got[0][turn]
            assert truncated is cut and ids == free[turn][0][:room - budget + len(free[turn][0])]


def _in_flight_run(tmp_path, dtype, kv: str, then=None):
    """3 prompts x 4 completions of up to 24 tokens, 6 rows at a time; after the 8th decode step a new version
    (new_version_loader) is loaded between two decode steps. Returns the rollouts, the prompts, the two models,
    the loop's metrics and the engine."""
    model = chatty_in("llama", dtype)
    old, newer, polling = new_version_loader(tmp_path, model, at_poll=9)
    cfg = load_config(None, ["sampling.max_new_tokens=24", "sampling.temperature=1.0",
                             "sampling.generation_batch_size=6", f"sampling.in_flight_kv={kv}"]).sampling
    engine = polling(HFEngine(model, CharTokenizer(), cfg))
    ids = [p.token_ids for p in prompts((5, 8, 3))]
    got = engine.generate(ids, 4, seed=7, then=then)
    return got, ids, old, newer, engine.decode_rows.take(), engine


@pytest.mark.parametrize("dtype, batch", [(torch.float32, 64), (torch.float64, 3)],
                         ids=["float32-one-batch", "float64-parked"])
def test_in_flight_weights_mid_episode_give_each_model_token_its_versions_log_prob(tmp_path, monkeypatch, dtype,
                                                                                   batch):
    """Episodes with a version loaded between two decode steps (sampling.in_flight_kv=recompute, the environment's
    calls in flight then too; with 3 rows and an environment taking 0.2 s a step, episodes parked out of the batch
    waiting on it): each token the model drew records the version that drew it and that version's log-prob given
    the whole episode before it, the environment's replies included (float32 rounding; float64 within two float32
    ulps); the environment's tokens carry no version."""
    from grpo.model.logprobs import completion_logprobs
    from grpo.sampler.rollout.loop_cache import LoopCache

    parked, recompute, load = [], LoopCache._recompute_kv, ContinuousLoop._load_new_weights

    def parked_now(loop) -> int:
        return sum(not s.in_batch and s.kv is not None for s in (*loop.returned, *loop.calls.values()))

    def counted(loop):
        parked.append(parked_now(loop))
        recompute(loop)
    now = []  # the sequences parked before this poll
    monkeypatch.setattr(LoopCache, "_recompute_kv", counted)
    monkeypatch.setattr(ContinuousLoop, "_load_new_weights", lambda loop: now.append(parked_now(loop)) or load(loop))
    model = chatty_in("llama", dtype)
    old, newer, polling = new_version_loader(tmp_path, model, at_poll=12, also=lambda: now[-1] > 0 or batch == 64)
    slow = {} if batch == 64 else {"env": "Slow", "delay": 0.2, "lanes": 4, "length": 3}
    with torch.no_grad():
        got = run(model, polling, batch=batch, **slow)
        ids = [torch.tensor(p.token_ids) for p in got.prompts]
        recomputed = {v: completion_logprobs(m, ids, got.rollouts.completion_ids, [4] * len(ids), temperature=1.0)
                      for v, m in ((0, old), (1, newer))}
    assert len(parked) == 1 and (parked[0] > 0 or not slow)
    versions, masks = got.rollouts.token_versions, got.rollouts.model_masks
    assert all(torch.equal(v < 0, ~m) for v, m in zip(versions, masks, strict=True))
    spanning = [j for j, v in enumerate(versions) if (v == 0).any() and (v == 1).any()]
    assert spanning and any(not masks[j][(versions[j] >= 0).nonzero()[0]:].all() for j in spanning)  # across a reply
    gaps = torch.cat([((logps - recomputed[v][j]).abs() / recomputed[v][j].abs().clamp(min=1))[versions[j] == v]
                      for j, logps in enumerate(got.rollouts.logps) for v in (0, 1)])
    assert len(gaps) == sum(int(m.sum()) for m in masks)
    assert gaps.max().item() <= {torch.float32: LOGP_TOLERANCE, torch.float64: 2.5e-7}[dtype], gaps.max().item()


def _own_version_gaps(got, ids, models):
    """Each token's recorded log-prob against its own version's, recomputed from its whole prefix at once."""
    from grpo.model.logprobs import completion_logprobs

    recomputed = {v: completion_logprobs(m, [torch.tensor(p) for p in ids], got.completion_ids, [4] * len(ids),
                                         temperature=1.0) for v, m in models.items()}
    gaps = []
    for j, (logps, versions) in enumerate(zip(got.logps, got.token_versions)):
        for v, theirs in recomputed.items():
            at = versions == v
            gaps.append(((logps - theirs[j]).abs() / theirs[j].abs().clamp(min=1))[at])
    return torch.cat(gaps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_in_flight_weights_give_each_token_the_log_prob_of_its_own_version_given_its_whole_prefix(tmp_path, dtype):
    """A version loaded between two decode steps with sampling.in_flight_kv=recompute: every cached column is
    computed again under it, so every recorded log-prob is its token's under the version that drew it
    given its whole prefix, as the trainer's forward computes it (float32 rounding; in float64 within two
    float32 ulps: the recorded float32 against the trainer's float32, rounded on another path);
    completions that span both versions record each token's version, and the load is counted."""
    with torch.no_grad():
        got, ids, old, newer, metrics, _ = _in_flight_run(tmp_path, dtype, "recompute")
        gaps = _own_version_gaps(got, ids, {0: old, 1: newer})
    versions = [v.tolist() for v in got.token_versions]
    assert any(0 in v and 1 in v for v in versions)  # some completions span the load
    assert all(v == sorted(v) for v in versions) and sum(map(len, versions)) == len(gaps)
    assert metrics["sampler/in_flight_loads"] == 1.0 and metrics["timing/kv_recompute_s"] > 0
    assert metrics["timing/in_flight_load_s"] > 0  # the load itself, every row waiting
    assert gaps.max().item() <= {torch.float32: LOGP_TOLERANCE, torch.float64: 2.5e-7}[dtype], gaps.max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_a_recompute_in_forwards_of_a_few_rows_gives_each_token_its_versions_log_prob(tmp_path, monkeypatch, dtype):
    """With RECOMPUTE_TOKENS at 40 the recompute is a forward per one to three sequences, shortest first; every
    recorded log-prob is still its own version's given its whole prefix (float32 rounding; float64 within two
    float32 ulps, as in one forward)."""
    import grpo.sampler.rollout.loop_cache as loop_cache

    lengths = []  # of each forward's sequences, as they were recomputed
    monkeypatch.setattr(loop_cache, "RECOMPUTE_TOKENS", 40)
    real = loop_cache.recompute_chunks

    def chunks_seen(holding):
        chunks = real(holding)
        lengths.extend([len(s.history) for s in chunk] for chunk in chunks)
        return chunks
    monkeypatch.setattr(loop_cache, "recompute_chunks", chunks_seen)
    with torch.no_grad():
        got, ids, old, newer, _, _ = _in_flight_run(tmp_path, dtype, "recompute")
        gaps = _own_version_gaps(got, ids, {0: old, 1: newer})
    assert len(lengths) >= 3 and all(len(c) * max(c) <= 40 or len(c) == 1 for c in lengths)
    assert sum(lengths, []) == sorted(sum(lengths, []))
    assert gaps.max().item() <= {torch.float32: LOGP_TOLERANCE, torch.float64: 2.5e-7}[dtype]


def test_a_recompute_computes_each_groups_prompt_once(tmp_path, monkeypatch):
    """The recompute's forwards take each group's prompt (but its last token) once, and each sequence's tokens
    after it once: of the tokens its sequences hold, G - 1 copies of each prompt are not computed again (the
    log-probs after it are checked by the tests above)."""
    from grpo.sampler.rollout.loop_cache import LoopCache, prompt_key, prompt_length

    fed, held, recompute = [], {}, LoopCache._recompute_kv

    def counted(loop):
        def count(_, args, kwargs):
            mask = kwargs["attention_mask"]
            fed.append(int(mask[:, mask.shape[1] - kwargs["input_ids"].shape[1]:].sum()))
        holding = [s for s in (*loop.rows, *loop.returned, *loop.calls.values()) if s.history and s.state != "done"]
        held.update({id(s): (prompt_key(s), prompt_length(s), len(s.history)) for s in holding})
        hook = loop.engine.model.register_forward_pre_hook(count, with_kwargs=True)
        try:
            recompute(loop)
        finally:
            hook.remove()
    monkeypatch.setattr(LoopCache, "_recompute_kv", counted)
    with torch.no_grad():
        _in_flight_run(tmp_path, torch.float32, "recompute")
    prompts = {key: length for key, length, _ in held.values()}
    assert len(held) > len(prompts) > 1  # groups with several sequences holding KV
    assert sum(fed) == sum(prompts.values()) + sum(n - length for _, length, n in held.values())
    assert sum(fed) < sum(n for _, _, n in held.values())


def test_an_in_flight_load_stops_the_next_calls_rows_at_once_and_makes_them_again_with_it(tmp_path, monkeypatch):
    """generate(A, then=B) with a version loaded while A decodes: B's started rows decode no step after the load
    and are not recomputed; generate(B) then makes B whole with the new version (what B draws from scratch)."""
    from grpo.sampler.rollout.continuous import ContinuousLoop
    from grpo.sampler.rollout.sequences import NextCall

    b = [p.token_ids for p in prompts((6, 7))]
    after_load, forward = [], ContinuousLoop._forward

    def counted(loop):
        if loop.engine.version == 1:
            after_load.append(sum(s.call is not loop.until and s.state == "decoding" for s in loop.rows))
        return forward(loop)
    monkeypatch.setattr(ContinuousLoop, "_forward", counted)
    with torch.no_grad():
        _, _, _, newer, metrics, engine = _in_flight_run(tmp_path, torch.float32, "recompute", then=NextCall(b, 2, 3))
        assert metrics["sampler/in_flight_loads"] == 1.0 and after_load and set(after_load) == {0}
        assert engine.carried is None and engine.version == 1
        again = engine.generate(b, 2, seed=3)
        fresh = HFEngine(newer, CharTokenizer(), engine.cfg).generate(b, 2, seed=3)
    assert [c.tolist() for c in again.completion_ids] == [c.tolist() for c in fresh.completion_ids]
    assert all(set(v.tolist()) == {1} for v in again.token_versions)


def test_in_flight_weights_on_the_kv_before_leave_a_mismatch_the_recompute_does_not(tmp_path):
    """sampling.in_flight_kv=keep: after the load the sequences go on from the KV of the weights before, so
    the log-probs recorded for the tokens drawn after it differ from their version's over the whole prefix
    (here by far more than float32 rounding); the tokens before it are exact."""
    with torch.no_grad():
        got, ids, old, newer, _, _ = _in_flight_run(tmp_path, torch.float32, "keep")
        gaps = _own_version_gaps(got, ids, {0: old})
        after = _own_version_gaps(got, ids, {1: newer})
    print(f"stale KV: largest relative log-prob gap after the load {after.max().item():.3g}")
    assert gaps.max().item() <= LOGP_TOLERANCE and after.max().item() > 1e-3


def test_a_greedy_call_an_evaluation_never_loads_new_weights_mid_way():
    """An evaluation scores the version it started with: the loop does not ask for new weights in a greedy
    call, and asks before every decode step of a sampled one."""
    engine = HFEngine(chatty_in("llama", torch.float32), CharTokenizer(),
                      load_config(None, ["sampling.max_new_tokens=12", "sampling.generation_batch_size=4"]).sampling)
    asked = []
    engine.poll_weights = lambda: asked.append(engine.decode_rows.steps) or False
    engine.generate([p.token_ids for p in prompts((5, 8))], 2, greedy=True)
    assert asked == [] and engine.decode_rows.take()["sampler/decode_steps"] > 0
    engine.generate([p.token_ids for p in prompts((5, 8))], 2, seed=3)
    assert asked == list(range(int(engine.decode_rows.take()["sampler/decode_steps"])))  # before each one
