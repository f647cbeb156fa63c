"""data.sources: a mixture of datasets drawn by weight, resumable, and training.epochs counted over it."""

import json
import math

import pytest

from grpo.config import ConfigError, load_config
from grpo.data.mixture import MixtureCursor, evaluation_source, source_configs
from grpo.run.epochs import steps_for_epochs, with_epochs_as_steps


def test_weights_3_to_1_draw_the_sources_3_to_1_over_400_rows():
    """400 draws, source 0 with probability 3/4: its count is within three standard deviations of 300
    (sd = sqrt(400 x 3/4 x 1/4) = 8.7); every index is a valid row of its source."""
    cursor = MixtureCursor([50, 30], [3, 1], seed=0)
    drawn = cursor.take(400)
    first = sum(i < 50 for i in drawn)
    assert abs(first - 300) <= 3 * math.sqrt(400 * 0.75 * 0.25)
    assert all(0 <= i < 80 for i in drawn)


def test_each_source_goes_round_its_prompts_once_a_pass():
    cursor = MixtureCursor([5, 7], [1, 1], seed=3)
    drawn = cursor.take(200)
    zeros, ones = [i for i in drawn if i < 5], [i - 5 for i in drawn if i >= 5]
    for own, size in ((zeros, 5), (ones, 7)):
        passes = len(own) // size
        assert passes >= 5
        for p in range(passes):
            assert sorted(own[p * size:(p + 1) * size]) == list(range(size))


def test_a_restored_or_seeked_cursor_draws_what_the_uninterrupted_one_draws():
    whole = MixtureCursor([50, 30], [3, 1], seed=7).take(5000)  # past a block of draws
    first = MixtureCursor([50, 30], [3, 1], seed=7)
    assert first.take(2100) == whole[:2100]
    again = MixtureCursor([50, 30], [3, 1], seed=7)
    again.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as the sampler's state file holds it
    assert again.take(2900) == whole[2100:]
    seeked = MixtureCursor([50, 30], [3, 1], seed=7)
    seeked.seek(4100)
    assert seeked.take(900) == whole[4100:]
    assert MixtureCursor([50, 30], [3, 1], seed=8).take(100) != whole[:100]
    with pytest.raises(ValueError, match="saved cursor is for seed 7, sources of \\[50, 30\\] prompts and weights"):
        MixtureCursor([50, 31], [3, 1], seed=7).load_state_dict(first.state_dict())


def test_a_mixture_entry_that_cannot_be_read_is_a_config_error_naming_it():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.sources=[{path: a, weight: 0}, {weight: 1}, {path: c, weight: 1, colour: red}]"])
    assert str(e.value).splitlines()[1:] == [
        "  data.sources: a: weight must be a number > 0; got 0",
        "  data.sources: an entry has no path: {'weight': 1}",
        "  data.sources: c: unknown key 'colour' (it may set path, weight, split, prompt_column, answer_column, "
        "answer_format, hub_config, few_shot, task_args)"]
    with pytest.raises(ConfigError, match="data.sources: b: data.few_shot=2 shows solved problems"):
        load_config(None, ["data.sources=[{path: a, weight: 1}, {path: b, weight: 1, answer_format: text}]"])


def two_sources(tmp_path, weights=(3, 1)):
    folders = []
    for name, size in (("plus", 12), ("times", 4)):
        folder = tmp_path / name
        folder.mkdir()
        for split in ("train", "test"):
            rows = [{"question": f"What is {i} {name} 1?", "answer": f"#### {i}"} for i in range(size)]
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        folders.append(folder)
    return f"data.sources=[{{path: {folders[0]}, weight: {weights[0]}}}, {{path: {folders[1]}, weight: {weights[1]}}}]"


def test_the_sampler_loads_each_source_and_draws_from_them_by_weight(tmp_path, tiny_model_dir):
    from grpo.sampler.state import SamplerState
    from grpo.wire.delivery import Spool
    from grpo.workers.sampler import load_policy_and_prompts, resume_position

    cfg = load_config(None, [f"model.name_or_path={tiny_model_dir}", two_sources(tmp_path), "data.few_shot=0",
                             f"run.dir={tmp_path / 'run'}", "lora.r=4", "rewards.timeout_s=0"])  # no jail: no scores
    assert [s.path for s in source_configs(cfg.data)] == [str(tmp_path / "plus"), str(tmp_path / "times")]
    assert evaluation_source(cfg.data).path == str(tmp_path / "plus")
    _, sources = load_policy_and_prompts(cfg)
    assert [len(s) for s in sources] == [12, 4]
    assert [p.problem.id for p in sources[1]] == ["1:train-0", "1:train-1", "1:train-2", "1:train-3"]
    (tmp_path / "run").mkdir()
    cursor, start = resume_position(cfg, SamplerState.of_sampler(tmp_path / "run", 0),
                                    Spool.of_sampler(tmp_path / "run", 0), [12, 4], tmp_path / "run")
    assert isinstance(cursor, MixtureCursor) and start == 0
    table = [p for s in sources for p in s]
    drawn = [table[i].problem.question for i in cursor.take(400)]
    times = sum("times" in q for q in drawn)
    assert abs(times - 100) <= 3 * math.sqrt(400 * 0.25 * 0.75)


def test_epochs_set_the_steps_from_the_problems_of_every_source(tmp_path):
    assert steps_for_epochs(1.5, 12, 2) == 9 and steps_for_epochs(1, 13, 4) == 4 and steps_for_epochs(0.01, 5, 8) == 1
    cfg = with_epochs_as_steps(load_config(None, [two_sources(tmp_path), "data.few_shot=0", "training.epochs=2",
                                                  "sampling.prompts_per_step=4"]))
    assert cfg.training.steps == 8  # 2 passes over 12 + 4 problems, 4 a step
    untouched = with_epochs_as_steps(load_config(None, ["training.steps=7"]))
    assert untouched.training.steps == 7
    with pytest.raises(ConfigError, match="training.epochs=1 counts the problems of data.split, which cannot be read"):
        with_epochs_as_steps(load_config(None, [f"data.path={tmp_path / 'none'}", "data.few_shot=0",
                                                "training.epochs=1"]))
