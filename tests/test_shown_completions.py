"""The completions a person reads (logging.completions_per_step): chosen and shaped by the sampler,
written by the trainer to completions.jsonl at the step they trained, dropped past a resume's step."""

import json
import math

from grpo.data.problems import Problem
from grpo.data.prompts import Prompt
from grpo.run.metrics_log import MetricsLog
from grpo.sampler.shown_completions import MAX_SHOWN_CHARS, shown_completions, shown_text


def prompt(i: int) -> Prompt:
    return Prompt(Problem(id=f"p{i}", question=f"q{i}", answer=str(i)), [1, 2],
                  turns=({"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"}))


def test_the_first_samples_are_shown_with_their_prompt_rewards_total_and_advantage():
    """2 prompts x G=2, 3 shown: samples 0 and 1 of p0, sample 0 of p1; a reward that failed on a
    sample is None there, and so is a total that is not a number."""
    records = shown_completions(3, [prompt(0), prompt(1)], ["a", "b", "c", "d"], ["acc", "fmt"],
                                [[1.0, 0.5], [0.0, 0.25], [1.0, 1.0], [0.0, 0.0]],
                                [[False, False], [True, False], [False, False], [False, False]],
                                [1.5, math.nan, 2.0, 0.0], [0.75, -0.75, 1.0, -1.0], group_size=2)
    assert records == [
        {"sample_id": "p0", "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q0"}],
         "completion": "a", "rewards": {"acc": 1.0, "fmt": 0.5}, "reward": 1.5, "advantage": 0.75},
        {"sample_id": "p0", "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q0"}],
         "completion": "b", "rewards": {"acc": None, "fmt": 0.25}, "reward": None, "advantage": -0.75},
        {"sample_id": "p1", "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"}],
         "completion": "c", "rewards": {"acc": 1.0, "fmt": 1.0}, "reward": 2.0, "advantage": 1.0}]
    json.dumps(records, allow_nan=False)  # JSON as it is: no NaN in the batch's header
    assert shown_completions(0, [prompt(0)], ["a"], ["acc"], [[1.0]], [[False]], [1.0], [0.0], 1) == []


def test_a_long_text_is_cut_and_says_how_much_more_there_was():
    assert shown_text("x" * MAX_SHOWN_CHARS) == "x" * MAX_SHOWN_CHARS
    assert shown_text("abcdefgh", limit=3) == "abc... [5 more characters]"


def test_the_trainer_writes_them_at_their_step_and_a_resume_drops_the_steps_it_trains_again(tmp_path):
    record = {"sample_id": "p0", "prompt": [], "completion": "a", "rewards": {"acc": 1.0}, "reward": 1.0,
              "advantage": 0.5}
    log = MetricsLog(tmp_path, None, tensorboard=False)
    for step in (1, 2, 3):
        log.write({"step": step, "loss": 0.0})
        log.write_completions(step, step % 2, [record, {**record, "completion": "b"}, "not a record"])
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [(r["step"], r["sampler"], r["completion"]) for r in rows] == [
        (1, 1, "a"), (1, 1, "b"), (2, 0, "a"), (2, 0, "b"), (3, 1, "a"), (3, 1, "b")]
    assert rows[0] == {"step": 1, "sampler": 1, **record}
    (tmp_path / "completions.jsonl").write_text((tmp_path / "completions.jsonl").read_text() + '{"step": 4, "com')
    MetricsLog(tmp_path, 2, tensorboard=False).close()  # a trainer resumed from its checkpoint of step 2
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [(r["step"], r["completion"]) for r in rows] == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_the_records_stay_within_their_share_of_the_batch_header():
    """Many long non-ASCII completions (6 bytes each in the header's JSON): the first records whose JSON
    fits MAX_SHOWN_BYTES are shown, never a header the trainer would refuse."""
    from grpo.sampler.shown_completions import MAX_SHOWN_BYTES

    texts = ["数" * 30_000] * 64
    records = shown_completions(64, [prompt(0)] * 64, texts, ["acc"], [[1.0]] * 64, [[False]] * 64, [1.0] * 64,
                                [0.0] * 64, group_size=1)
    size = len(json.dumps(records))
    assert 0 < len(records) < 64 and size <= MAX_SHOWN_BYTES
    assert len(json.dumps(records + records[:1])) > MAX_SHOWN_BYTES  # one more would not fit
    assert records[0]["completion"].endswith("... [14000 more characters]")
