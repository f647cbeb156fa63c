"""A user's second run: their own data and reward module, evaluation during training, dynamic
sampling, through the real processes; and the in-training evaluation against grpo evaluate."""

import json

import torch
from test_launch import launch
from test_training import LEARNING, run_both

from grpo.commands.evaluate import evaluate  # noqa: E402
from grpo.config import load_config
from grpo.data.cursor import PromptCursor
from grpo.data.problems import load_split
from grpo.data.prompts import build_prompts
from grpo.model.loading import add_lora, load_model, load_tokenizer
from grpo.run.metrics_log import MetricsLog
from grpo.sampler.evaluation import TrainingEvaluator, evaluated_through_at_start
from grpo.sampler.rollout.hf_engine import HFEngine
from grpo.weights.folder import WeightWatcher, publish, version_dir

SCORING = '''
def digit_match(completion, row):
    """1 when the first digit is the target; does not apply to the rows with an odd index."""
    if row["index"] % 2:
        return None
    digits = [c for c in completion if c.isdigit()]
    return 1.0 if digits and digits[0] == row["target"] else 0.0
'''


def own_dataset(folder):
    """Not GSM8K: chat-message prompts under 'prompt', text answers under 'target', an extra column."""
    folder.mkdir()
    for split in ("train", "test"):
        rows = [{"prompt": [{"role": "user", "content": f"Say the digit {i % 10}."}], "target": str(i % 10), "index": i}
                for i in range(12)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_own_data_and_reward_module_train_end_to_end_with_evaluation(tmp_path, digit_model_dir, monkeypatch):
    """Three steps through the launcher on a JSONL dataset with renamed columns and a reward from a
    package the test writes (found on PYTHONPATH), the overlong penalty on; evaluation at every
    version, 0 to 3 (the last after the last step), in metrics.jsonl, though at staleness 1 the
    sampler could move on to a newer version than the one it has to evaluate."""
    package = tmp_path / "lib" / "my_rewards_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "scoring.py").write_text(SCORING)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "lib"))
    data, run = own_dataset(tmp_path / "digits"), tmp_path / "run"
    run.mkdir()
    proc = launch(run, digit_model_dir, data, "training.steps=3", "sampling.max_staleness=1",
                  "data.prompt_column=prompt", "data.answer_column=target", "data.answer_format=text",
                  "data.few_shot=0", "data.prefill=", "rewards.names=[my_rewards_pkg.scoring:digit_match]",
                  "rewards.weights=[1.0]", "sampling.max_new_tokens=4", "rewards.overlong_buffer=2",
                  "eval.every=1", "eval.num_problems=3", "eval.batch_size=2")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/answer_accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and [r["step"] for r in evals] == [0, 1, 2, 3]
    assert all(r["eval/problems"] == 3 and r["eval/mean_completion_tokens"] == 4 for r in evals)
    assert all(f"eval at step {v} | answer" in out for v in (0, 1, 2, 3)) and "done: 3 steps" in out
    name = "my_rewards_pkg.scoring:digit_match"
    for row in steps:  # the reward saw the row's own columns: it applied to the even-index prompts only
        cursor = PromptCursor(12, seed=0)
        cursor.seek(row["sampler_step"] * 2)
        assert row[f"rewards/{name}/applies"] == sum(i % 2 == 0 for i in cursor.take(2)) / 2
        # the digit model never stops before 4 tokens: each completion ends at the limit, penalty -1
        assert row["rewards/overlong_penalty/mean"] == -1.0 and row["completions/clipped_ratio"] == 1.0
    assert row["timing/eval_s"] > 0 or steps[0]["timing/eval_s"] > 0


def test_dynamic_sampling_through_the_processes(tmp_path, digit_model_dir, tiny_gsm8k):
    rows = run_both(tmp_path, digit_model_dir, tiny_gsm8k, "training.steps=2", *LEARNING,
                    "sampling.dynamic_sampling=true", "sampling.dynamic_sampling_max_rounds=2")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["sampling/dynamic_rounds"] in (1.0, 2.0)
        # trained groups differ unless the cap was hit: frac_reward_zero_std counts the trained groups
        assert row["frac_reward_zero_std"] == 0.0 or row["sampling/dynamic_cap_hit"] == 1.0
        generated = row["sampling/dynamic_rounds"] * 2
        assert row["sampling/dynamic_dropped_fraction"] == (generated - 2) / generated  # 2 prompts a step trained
        flat = row["sampling/zero_spread_fraction"] * generated
        assert flat == round(flat) and (flat <= generated - 2 or row["sampling/dynamic_cap_hit"] == 1.0)


def test_the_training_evaluation_and_evaluate_py_agree_on_the_same_weights(tmp_path, tiny_model_dir, tiny_gsm8k):
    """The sampler's evaluator (weights hot-swapped into its engine) and grpo evaluate (the
    published folder loaded afresh) write the same completions and the same rates."""
    cfg = load_config(None, [f"model.name_or_path={tiny_model_dir}", f"data.path={tiny_gsm8k}", "lora.r=4",
                             "sampling.max_new_tokens=5", "eval.every=2", "eval.num_problems=5", "eval.batch_size=2"])
    trained = add_lora(load_model(cfg.model), cfg.lora)
    torch.manual_seed(3)
    with torch.no_grad():
        for n, p in trained.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.5)
    publish(trained, tmp_path, version=2, step=2)

    tokenizer = load_tokenizer(cfg.model)
    engine = HFEngine(add_lora(load_model(cfg.model), cfg.lora).eval(), tokenizer, cfg.sampling)
    assert WeightWatcher(tmp_path, [engine.stage_weights]).poll().loaded and engine.version == 2
    prompts, _ = build_prompts(tokenizer, cfg.data, load_split(cfg.data, "test")[0][:5])
    evaluator = TrainingEvaluator(cfg.eval, prompts, tokenizer, cfg.data.prefill)
    assert evaluator.due(0) and evaluator.due(2)
    ours = evaluator.run(engine, 2)
    assert not evaluator.due(3) and evaluator.due(4)
    resumed = TrainingEvaluator(cfg.eval, prompts, tokenizer, cfg.data.prefill,
                                evaluated_through=evaluated_through_at_start(cfg.eval, 45))
    assert not resumed.due(45) and resumed.due(46)  # every 2: the next mark after 45
    assert evaluated_through_at_start(cfg.eval, None) == -1
    cfg.eval.on_start = False
    later = TrainingEvaluator(cfg.eval, prompts, tokenizer, cfg.data.prefill,
                              evaluated_through=evaluated_through_at_start(cfg.eval, None))
    assert not later.due(0) and not later.due(1) and later.due(2)  # the first evaluation is at eval.every
    assert evaluated_through_at_start(cfg.eval, 45) == 45  # a resume is the same either way
    # marks through 6 done, v7 served; the trainer resumes from checkpoint 3 and republishes v4 on:
    # its mark 4 holds other weights than the evaluated v4, so it is due again
    moved = TrainingEvaluator(cfg.eval, prompts, tokenizer, cfg.data.prefill, evaluated_through=6)
    assert not moved.due(7) and not moved.due(3) and moved.due(4)
    cfg.eval.on_start = True
    summary, samples = evaluate(cfg, version_dir(tmp_path, 2), limit=5, batch_size=2, split="test")
    assert [s["completion"] for s in samples] == [s["completion"] for s in evaluator.last_samples]
    _, base = evaluate(cfg, None, limit=5, batch_size=2, split="test")
    assert [s["completion"] for s in base] != [s["completion"] for s in samples]  # the adapter is on
    for key in ("answer_accuracy", "format_rate", "mean_completion_tokens", "truncated_rate"):
        assert ours[f"eval/{key}"] == summary[key]


def test_a_restarted_trainer_writes_each_evaluation_row_once(tmp_path):
    """Rows after the checkpoint go (those steps train again); an evaluation row a re-sent batch
    carries again is not written twice, one of a later version is."""
    rows = [{"step": 0, "eval/answer_accuracy": 0.25}, {"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4},
            {"step": 2, "eval/answer_accuracy": 0.5}, {"step": 3, "loss": 0.3},
            {"step": 4, "eval/answer_accuracy": 0.75}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "lo')
    log = MetricsLog(tmp_path, resumed_step=2, tensorboard=False)
    assert log.evaluated == {0, 2}
    log.write_evaluation({"step": 2, "eval/answer_accuracy": 0.5})  # re-sent with the batch of step 3
    log.write({"step": 3, "loss": 0.3})
    log.write_evaluation({"step": 4, "eval/answer_accuracy": 0.75})
    log.write_evaluation({"step": 4, "eval/answer_accuracy": 0.75})
    log.close()
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert written == rows[:4] + [{"step": 3, "loss": 0.3}, {"step": 4, "eval/answer_accuracy": 0.75}]
