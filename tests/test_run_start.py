"""Fresh start or resume: a start never deletes what an earlier run left in its folder."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
import zmq
from conftest import PROCESS_CONFIG, REPO
from helpers import free_tcp_address

from grpo.config import load_config
from grpo.run.ports import free_local_port
from grpo.run.start import (
    RunFolderInUse,
    earlier_outputs,
    hold_run_folder,
    planned_start,
    prepare_run_folder,
    resume_source,
)
from grpo.wire.delivery import Spool


def finished_run(folder: Path, checkpoint: bool = True) -> Path:
    """What a run leaves: published versions, a checkpoint, metrics rows, its config and logs."""
    for v in (1, 2):
        version = folder / "weights" / f"v{v:06d}"
        version.mkdir(parents=True)
        (version / "adapter_model.safetensors").write_bytes(bytes([v]) * 64)
        (version / "manifest.json").write_text(json.dumps({"version": v, "step": v, "kind": "lora", "files": {}}))
    (folder / "weights" / "LATEST").write_text("2")
    if checkpoint:
        (folder / "checkpoints" / "step000002").mkdir(parents=True)
        (folder / "checkpoints" / "step000002" / "state.pt").write_bytes(b"optimizer state")
        (folder / "checkpoints" / "latest").write_text("step000002")
    (folder / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (folder / "config.yaml").write_text("seed: 0\n")
    (folder / "trainer.log").write_text("done\n")
    return folder


def contents(folder: Path) -> dict[str, str]:
    """Every file below `folder` and the sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def config(run_dir: Path, *overrides: str):
    return load_config(None, [f"run.dir={run_dir}", "run.name=my-run", *overrides])


def test_a_fresh_start_into_a_used_run_folder_refuses_and_deletes_nothing(tmp_path):
    run_dir = finished_run(tmp_path / "my-run")
    before = contents(run_dir)
    with pytest.raises(RunFolderInUse) as e:
        prepare_run_folder(config(run_dir, "checkpoint.resume=never"))
    message = str(e.value)
    assert "run.name=my-run" in message and "run.overwrite=true" in message and "new run.name" in message
    assert "published weights v1..v2, checkpoints, metrics.jsonl (2 rows)" in message
    assert "\n" not in message
    assert contents(run_dir) == before


def test_weights_and_metrics_without_a_checkpoint_are_no_fresh_start_either(tmp_path):
    """A run stopped before its first checkpoint: `auto` finds nothing to resume from, and a
    fresh start would have deleted its published versions."""
    run_dir = finished_run(tmp_path / "my-run", checkpoint=False)
    before = contents(run_dir)
    with pytest.raises(RunFolderInUse, match="there is no checkpoint to resume from"):
        prepare_run_folder(config(run_dir))
    assert contents(run_dir) == before


def test_run_overwrite_moves_the_old_contents_aside_whole(tmp_path):
    run_dir = finished_run(tmp_path / "my-run")
    before = contents(run_dir)
    moved = prepare_run_folder(config(run_dir, "checkpoint.resume=never", "run.overwrite=true"))
    assert moved.parent == tmp_path and moved.name.startswith("my-run.replaced-")
    assert {k: v for k, v in contents(moved).items() if k != "REPLACED.json"} == before
    assert json.loads((moved / "REPLACED.json").read_text())["run_dir"] == str(run_dir)
    assert run_dir.is_dir() and list(run_dir.iterdir()) == []
    # a second start finds the folder fresh: nothing more is moved
    assert prepare_run_folder(config(run_dir, "checkpoint.resume=never", "run.overwrite=true")) is None
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["my-run", moved.name]


def test_a_weights_folder_outside_the_run_folder_is_moved_aside_beside_itself(tmp_path):
    """Beside itself: a rename within its own file system (/dev/shm, another disk) always works."""
    elsewhere = Path("/dev/shm") if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK) else tmp_path
    run_dir, weights = tmp_path / "my-run", Path(tempfile.mkdtemp(dir=elsewhere)) / "weights"
    try:
        finished_run(run_dir, checkpoint=False)
        shutil.move(run_dir / "weights", weights)
        before = contents(weights)
        moved = prepare_run_folder(config(run_dir, f"weights.dir={weights}", "run.overwrite=true"))
        record = json.loads((moved / "REPLACED.json").read_text())
        assert record["weights_moved_to"].startswith(f"{weights}.replaced-") and not weights.exists()
        assert contents(Path(record["weights_moved_to"])) == before
    finally:
        shutil.rmtree(weights.parent)


def test_overwrite_through_a_linked_run_folder_keeps_the_link(tmp_path):
    real, link = tmp_path / "disk" / "my-run", tmp_path / "runs" / "my-run"
    finished_run(real)
    link.parent.mkdir()
    link.symlink_to(real)
    before = contents(real)
    moved = prepare_run_folder(config(link, "checkpoint.resume=never", "run.overwrite=true"))
    assert moved.parent == real.parent and {k: v for k, v in contents(moved).items() if k != "REPLACED.json"} == before
    assert link.is_symlink() and link.resolve() == real and list(real.iterdir()) == []


def test_a_run_whose_trainer_runs_is_in_use_for_any_start(tmp_path):
    """A second launch into a live run would resume under it (dropping the versions and metrics
    rows past its checkpoint) or move it away with run.overwrite: both refuse while its lock is held."""
    run_dir = finished_run(tmp_path / "my-run")
    before = contents(run_dir)
    held = hold_run_folder(config(run_dir))
    try:
        for extra in ([], ["checkpoint.resume=never", "run.overwrite=true"]):
            with pytest.raises(RunFolderInUse, match=f"is in use by a running trainer \\(pid {os.getpid()}\\)"):
                prepare_run_folder(config(run_dir, *extra))
        assert planned_start(config(run_dir))[0] == "in use"
    finally:
        held.close()
    assert contents(run_dir) == before and planned_start(config(run_dir))[0] == "resume"


def test_another_runs_checkpoint_starts_a_fresh_run_folder_then_its_own_take_over(tmp_path):
    source = finished_run(tmp_path / "source") / "checkpoints"
    used = finished_run(tmp_path / "my-run", checkpoint=False)
    with pytest.raises(RunFolderInUse, match=f"checkpoint.resume={source} is another run's checkpoint"):
        prepare_run_folder(config(used, f"checkpoint.resume={source}"))
    fresh = tmp_path / "fresh-run"
    assert prepare_run_folder(config(fresh, f"checkpoint.resume={source}")) is None
    assert resume_source(str(source), fresh) == source
    (fresh / "checkpoints").mkdir(parents=True)
    (fresh / "checkpoints" / "latest").write_text("step000004")  # the run's own first checkpoint
    assert resume_source(str(source), fresh) == fresh / "checkpoints"


def test_resume_sources(tmp_path):
    run_dir = finished_run(tmp_path / "my-run")
    assert resume_source("auto", run_dir) == run_dir / "checkpoints"
    assert resume_source("never", run_dir) is None
    assert resume_source(str(run_dir / "checkpoints"), tmp_path / "other") == run_dir / "checkpoints"
    assert resume_source("auto", tmp_path / "empty") is None
    before = contents(run_dir)
    assert prepare_run_folder(config(run_dir)) is None  # auto with a checkpoint: a resume, nothing moves
    assert contents(run_dir) == before
    assert earlier_outputs(tmp_path / "empty", tmp_path / "empty" / "weights") == []


def one_rank_trainer(run_dir: Path, model_dir, data_dir, address: str, *extra: str) -> tuple[list[str], dict]:
    """The command and environment of a one-rank trainer (as the launcher starts it)."""
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_local_port()), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    args = [sys.executable, str(REPO / "training_worker.py"), "--config", str(PROCESS_CONFIG), f"run.dir={run_dir}",
            "run.name=my-run", f"model.name_or_path={model_dir}", f"data.path={data_dir}",
            f"transport.address={address}", "lora.r=4", *extra]
    return args, env


def start_one_rank_trainer(run_dir: Path, model_dir, data_dir, address: str, *extra: str):
    args, env = one_rank_trainer(run_dir, model_dir, data_dir, address, *extra)
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def launch_one_rank_trainer(run_dir: Path, model_dir, data_dir, address: str, *extra: str) -> subprocess.Popen:
    """A one-rank trainer in the background, its output in run_dir/trainer.log."""
    args, env = one_rank_trainer(run_dir, model_dir, data_dir, address, *extra)
    with open(run_dir / "trainer.log", "ab") as log:
        return subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def error_lines(proc) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if " ERROR " in line]


def test_the_trainer_refuses_a_fresh_start_into_a_finished_run_and_deletes_nothing(tmp_path, tiny_model_dir,
                                                                                   tiny_gsm8k):
    run_dir = finished_run(tmp_path / "my-run")
    before = contents(run_dir)
    proc = start_one_rank_trainer(run_dir, tiny_model_dir, tiny_gsm8k, free_tcp_address(), "checkpoint.resume=never")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = error_lines(proc)
    assert len(errors) == 1 and "run.name=my-run" in errors[0] and "run.overwrite=true" in errors[0], errors
    assert contents(run_dir) == before


def test_a_trainer_whose_address_is_taken_stops_in_one_line_naming_it(tmp_path, tiny_model_dir, tiny_gsm8k):
    address = free_tcp_address()
    context = zmq.Context()
    taken = context.socket(zmq.PULL)
    taken.bind(address)
    try:
        proc = start_one_rank_trainer(tmp_path / "run", tiny_model_dir, tiny_gsm8k, address)
    finally:
        taken.close(linger=0)
        context.term()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = error_lines(proc)
    assert len(errors) == 1 and f"transport.address {address} cannot be bound" in errors[0], errors
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("script", ["training_worker.py", "sampling_worker.py"])
def test_help_exits_0_and_names_the_config_and_the_key_reference(script):
    proc = subprocess.run([sys.executable, str(REPO / script), "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert f"{script} [--config config.yaml] [key=value ...]" in proc.stdout
    assert "--help-config" in proc.stdout and "docs/config.md" in proc.stdout


def test_help_config_prints_every_key_with_its_default(tmp_path):
    from grpo.config import all_keys

    proc = subprocess.run([sys.executable, str(REPO / "sampling_worker.py"), "--help-config"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    printed = [line.split(" = ", 1)[0] for line in proc.stdout.splitlines()
               if " = " in line and not line.startswith(" ")]
    assert printed == all_keys()
    assert "training.learning_rate = 0.0002" in proc.stdout and "checkpoint.resume = auto" in proc.stdout


def test_a_config_error_is_one_message_without_a_traceback():
    proc = subprocess.run([sys.executable, str(REPO / "training_worker.py"), "training.lr=1e-5", "num_generations=4"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "unknown config key 'training.lr'; did you mean 'training.learning_rate'?" in proc.stderr
    assert "unknown config key 'num_generations'; did you mean 'sampling.group_size'?" in proc.stderr


# ----------------------------------------------------------------------------- resumes with other settings
# and starts that trained nothing

def process_settings(steps: int, rank: int) -> list[str]:
    """What both workers of these runs take (the sampler needs run.name too: the same config)."""
    from test_faults import COMMON

    return [*COMMON, f"training.steps={steps}", f"lora.r={rank}", "run.name=my-run"]


def wait_for_file(path: Path, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        assert proc.poll() is None, f"exited with {proc.returncode} before {path.name} was written"
        assert time.monotonic() < deadline, f"no {path.name} after {timeout_s:g} s"
        time.sleep(0.2)


def train_together(run_dir: Path, model_dir, data_dir, steps: int, rank: int, *extra: str) -> str:
    """A one-rank trainer and a sampler for `steps` steps; both exit 0. Their logs."""
    from test_sampling_worker import start_sampler

    address = free_tcp_address()
    trainer = launch_one_rank_trainer(run_dir, model_dir, data_dir, address, *process_settings(steps, rank), *extra)
    sampler = start_sampler(run_dir, model_dir, data_dir, address, *process_settings(steps, rank), *extra)
    try:
        trainer_code = trainer.wait(timeout=300)
        sampler_code = sampler.wait(timeout=120) if trainer_code == 0 else None  # else it would wait for nobody
    finally:
        for proc in (trainer, sampler):
            if proc.poll() is None:
                proc.kill()
    logs = (run_dir / "trainer.log").read_text() + (run_dir / "sampler.log").read_text()
    assert (trainer_code, sampler_code) == (0, 0), logs[-6000:]
    return logs


def test_a_resume_with_another_lora_rank_is_refused_before_anything_is_written(tmp_path, tiny_model_dir, tiny_gsm8k):
    """Trained one step with lora.r=4 (a checkpoint at step 1); the same run with lora.r=8 would load
    an adapter of another shape. The trainer and a sampler started by hand each refuse in one line
    (exit 2), and no file of the run folder changes. With lora.r=4 again it resumes, and the
    trainer lists the settings that did change."""
    from test_sampling_worker import start_sampler

    run_dir = tmp_path / "my-run"
    run_dir.mkdir()
    train_together(run_dir, tiny_model_dir, tiny_gsm8k, steps=1, rank=4)
    shutil.copy(run_dir / "config.yaml", tmp_path / "first-config.yaml")
    before = contents(run_dir)
    expected = (f"run folder {run_dir} (run.name=my-run) resumes from its checkpoint of step 1, which depends on "
                "settings this start changes: lora.r 4 -> 8 (the checkpoint's LoRA adapter); nothing was changed. "
                "Run the same command with lora.r=4, or start a new run: a new run.name, or "
                "checkpoint.resume=never run.overwrite=true to move this one aside")

    trainer = start_one_rank_trainer(run_dir, tiny_model_dir, tiny_gsm8k, free_tcp_address(),
                                     *process_settings(2, 8))
    assert trainer.returncode == 2, trainer.stdout + trainer.stderr
    assert [line.split(" ERROR ", 1)[1] for line in error_lines(trainer)] == [expected]
    sampler = start_sampler(run_dir, tiny_model_dir, tiny_gsm8k, free_tcp_address(), *process_settings(2, 8),
                            log_name="../refused-sampler.log")  # beside the run folder: it must not change
    assert sampler.wait(timeout=300) == 2
    log = (tmp_path / "refused-sampler.log").read_text()
    assert [line.split(" ERROR ", 1)[1] for line in log.splitlines() if " ERROR " in line] == [expected], log
    assert contents(run_dir) == before

    logs = train_together(run_dir, tiny_model_dir, tiny_gsm8k, 2, 4, "training.learning_rate=0.01")
    assert ("trainer[0] INFO resuming with changed settings: training.steps 1 -> 2, training.learning_rate 0.05 -> "
            "0.01 (the schedule continues from where it stands, with the new peak)\n") in logs
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (run_dir / "config.001.yaml").read_bytes() == (tmp_path / "first-config.yaml").read_bytes()


def test_a_first_start_stopped_before_its_first_step_does_not_hold_back_a_retry_with_other_settings(
        tmp_path, tiny_model_dir, tiny_gsm8k):
    """The first start (lora.r=4): its sampler spools two steps that no trainer takes and is
    killed; its trainer is stopped (SIGTERM) before its first step. The retry with lora.r=8 is a
    fresh start: no step-0 checkpoint is resumed (a size mismatch), the sampler does not re-send
    the spooled lora.r=4 batches (exit 7), and it trains. The first start's config is kept."""
    from test_sampling_worker import start_sampler

    run_dir = tmp_path / "my-run"
    run_dir.mkdir()
    sampler = start_sampler(run_dir, tiny_model_dir, tiny_gsm8k, free_tcp_address(), *process_settings(2, 4))
    try:
        wait_for_file(run_dir / "sampler_state.json", sampler)  # step 0 spooled and queued for a trainer
    finally:
        sampler.kill()
        sampler.wait()
    trainer = launch_one_rank_trainer(run_dir, tiny_model_dir, tiny_gsm8k, free_tcp_address(), *process_settings(2, 4))
    try:
        wait_for_file(run_dir / "trainer_state.json", trainer)  # bound and waiting for its first batch
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=120) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert "no step trained since step 0: no checkpoint written" in (run_dir / "trainer.log").read_text()
    assert not (run_dir / "checkpoints").exists() and Spool.of_sampler(run_dir, 0).steps() != []

    logs = train_together(run_dir, tiny_model_dir, tiny_gsm8k, steps=1, rank=8)
    assert "resumed from" not in logs
    assert "an earlier start with other settings left a position and spooled batches: dropped; starting at step 0" \
        in logs
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["lora"]["r"] == 8
    assert yaml.safe_load((run_dir / "config.001.yaml").read_text())["lora"]["r"] == 4
    assert sorted(p.name for p in run_dir.glob("config*.yaml")) == ["config.001.yaml", "config.yaml"]
