"""The Python API: a run started from Python, its handle, and rewards given as function objects."""

import subprocess
import sys

import pytest
from api_rewards import digit_matches
from conftest import PROCESS_CONFIG, REPO
from helpers import free_tcp_address

import grpo
from grpo.api import cli_overrides, import_path


def module_level_reward(completion, row):
    return 0.0


class Scorer:
    def score(self, completion, row):
        return 0.0


def test_overrides_become_the_command_lines_key_value_strings():
    texts, roots = cli_overrides({"training.steps": 2, "training.learning_rate": 1e-5, "training.use_gspo": True,
                                  "run.name": "a b", "rewards.names": [digit_matches, "gsm8k_answer"],
                                  "rewards.weights": [1.0, 0.5], "env.pass_env": {}})
    assert texts == ["training.steps=2", "training.learning_rate=1.0e-05", "training.use_gspo=true", "run.name=a b",
                     "rewards.names=['api_rewards:digit_matches', gsm8k_answer]", "rewards.weights=[1.0, 0.5]",
                     "env.pass_env={}"]
    assert roots == [str(REPO / "tests")]  # the workers import api_rewards from there
    assert cli_overrides(["training.steps=2"]) == (["training.steps=2"], [])
    with pytest.raises(TypeError, match="not one string"):
        cli_overrides("training.steps=2")


def test_code_the_runs_processes_cannot_import_is_refused_by_name():
    assert import_path(module_level_reward) == "test_api:module_level_reward"

    def inner(completion, row):
        return 0.0

    for code, what in ((lambda c, r: 0.0, "<lambda>"), (inner, "inner"), (Scorer.score, "Scorer.score")):
        with pytest.raises(ValueError, match="cannot be imported by the run's processes") as raised:
            import_path(code)
        assert what in str(raised.value)
    with pytest.raises(ValueError, match="is not a function or class"):
        import_path(3)


def test_a_function_of_a_script_run_as_main_is_named_by_its_file(tmp_path):
    script = tmp_path / "train_it.py"
    script.write_text("import grpo\n\ndef my_reward(completion, row):\n    return 1.0\n\n"
                      "print(grpo.import_path(my_reward))\n")
    out = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{script}:my_reward\n"
    session = subprocess.run([sys.executable, "-c", "import grpo\ndef f(c, r): return 1.0\ngrpo.import_path(f)"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "defined in this notebook or interactive session" in session.stderr


def test_a_two_step_run_started_from_python(tmp_path, digit_model_dir, tiny_gsm8k, monkeypatch):
    """grpo.launch with a dict of overrides and a reward function object: the run trains 2 steps,
    the handle's metrics are metrics.jsonl's rows, and each step was scored by that function; then
    grpo.evaluate and grpo.export on the run's last version. Started from a folder whose files are
    named like the project's packages: they shadow none of them in the run's processes."""
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    for shadow in (work / "rewards.py", work / "common.py", work / "data" / "__init__.py"):
        shadow.write_text("raise ImportError('a user file shadowed the project')\n")
    monkeypatch.chdir(work)
    run = grpo.launch(PROCESS_CONFIG, {
        "run.dir": tmp_path / "run", "model.name_or_path": digit_model_dir, "data.path": tiny_gsm8k,
        "transport.address": free_tcp_address(), "sampling.max_new_tokens": 1, "launch.cpu_threads": 1,
        "training.steps": 2, "rewards.names": [digit_matches], "rewards.weights": [1.0]}, echo=False)
    assert run.run_dir == tmp_path / "run"
    assert run.wait(timeout=600) == 0
    assert "done: 2 steps" in "".join(run.output)
    rows = run.metrics()
    assert [row["step"] for row in rows] == [1, 2]
    assert all("rewards/api_rewards:digit_matches/mean" in row
               and row["rewards/api_rewards:digit_matches/failures"] == 0 for row in rows), sorted(rows[0])
    assert (run.run_dir / "weights" / "LATEST").read_text().strip() == "2"
    result = grpo.evaluate(run=run.run_dir, limit=3, batch_size=3)  # in this process, with the run's config
    assert (result["problems"], len(result["samples"]), result["weights"]) == (3, 3, str(run.run_dir / "weights" /
                                                                                          "v000002"))
    exported = grpo.export(run.run_dir, tmp_path / "exported")
    assert (exported["version"], exported["kind"]) == (2, "lora")
    assert (tmp_path / "exported" / "adapter_config.json").is_file()


def test_a_config_mistake_is_raised_before_anything_starts(tmp_path):
    from grpo.config import ConfigError

    with pytest.raises(ConfigError, match="training.stepz"):
        grpo.launch(PROCESS_CONFIG, {"run.dir": tmp_path / "run", "training.stepz": 2})
    assert not (tmp_path / "run").exists()


def test_stop_ends_the_run_as_ctrl_c_does_and_the_same_launch_resumes_it(tmp_path, digit_model_dir, tiny_gsm8k):
    import time

    overrides = {"run.dir": tmp_path / "run", "model.name_or_path": digit_model_dir, "data.path": tiny_gsm8k,
                 "sampling.max_new_tokens": 1, "launch.cpu_threads": 1, "training.steps": 1000,
                 "checkpoint.every": 1000}
    run = grpo.launch(PROCESS_CONFIG, overrides, echo=False)
    deadline = time.monotonic() + 300
    while not run.metrics() and time.monotonic() < deadline:
        assert run.running, "".join(run.output)
        time.sleep(0.5)
    assert run.stop(timeout=300) == 130
    trained = run.metrics()[-1]["step"]
    assert "the checkpoint of step" in "".join(run.output)  # saved at the stop, though checkpoint.every is 1000
    again = grpo.launch(PROCESS_CONFIG, {**overrides, "training.steps": trained + 1}, echo=False)
    assert again.wait(timeout=600) == 0
    assert [row["step"] for row in again.metrics()] == list(range(1, trained + 2))


@pytest.mark.parametrize("value", ["Solve it. #### marks the answer", "<think>\n", "Think step by step...", "yes",
                                   "exp: a", "12", " padded ", "plain words", "a:b"])
def test_a_string_override_reaches_the_config_as_written(value):
    from grpo.config import load_config

    texts, _ = cli_overrides({"data.system_prompt": value})
    assert load_config(None, texts).data.system_prompt == value


def test_numpy_scalars_are_numbers_and_other_objects_are_refused_by_key():
    import functools

    import numpy as np

    assert cli_overrides({"training.learning_rate": np.float32(0.5), "training.steps": np.int64(3)})[0] == \
        ["training.learning_rate=0.5", "training.steps=3"]
    with pytest.raises(TypeError, match="overrides: rewards.names is a partial"):
        cli_overrides({"rewards.names": [functools.partial(digit_matches)]})


def test_an_installed_packages_function_adds_no_folder_to_the_workers_path():
    import yaml

    assert cli_overrides({"rewards.names": [yaml.safe_load]}) == (["rewards.names=['yaml:safe_load']"], [])


def test_a_launch_from_inside_the_file_that_defines_its_reward_is_refused_by_name(tmp_path):
    """Without `if __name__ == "__main__":` the config's import of the script would run it again."""
    script = tmp_path / "train_it.py"
    script.write_text("import grpo\n\ndef my_reward(completion, row):\n    return 1.0\n\n"
                      f"grpo.launch({str(PROCESS_CONFIG)!r}, {{'rewards.names': [my_reward], 'rewards.weights': [1.0], "
                      f"'run.dir': {str(tmp_path / 'run')!r}}})\n")
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "put the launch under `if __name__ == \"__main__\":`" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "run").exists()
