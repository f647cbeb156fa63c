"""`grpo train --slurm` on a stand-in Slurm: tests/slurm_standins/ holds an srun, scontrol and sbatch
that run each node's share as local processes with the variables Slurm sets (nodes 127.0.0.1-3:
loopback addresses that each 'node' binds or reaches). Two trainer nodes of one rank each and one
sampler node train, the job is killed as a failed node would kill it, and the same script,
submitted again, resumes the run from its last checkpoint."""

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PROCESS_CONFIG, REPO

STANDINS = REPO / "tests" / "slurm_standins"
NODES = "127.0.0.1,127.0.0.2,127.0.0.3"
SLURM = ["--slurm", "--nodes", "3", "--trainer-nodes", "2", "--gpus-per-node", "0"]


def environment(job_id: int) -> dict:
    path = os.pathsep.join([str(STANDINS), str(Path(sys.executable).parent), os.environ["PATH"]])
    return {**os.environ, "PATH": path,
            "SLURM_STANDIN_NODES": NODES, "SLURM_STANDIN_JOB_ID": str(job_id), "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1"}


def train_command(run_dir, model_dir, data_dir, *extra):
    return [sys.executable, "-m", "grpo.cli", "train", *SLURM, "--config", str(PROCESS_CONFIG), f"run.dir={run_dir}",
            f"model.name_or_path={model_dir}", f"data.path={data_dir}", "sampling.group_size=4",
            "sampling.max_new_tokens=4", "training.steps=8", "checkpoint.every=1", "transport.recv_timeout_s=300",
            "sampling.wait_timeout_s=300", *extra]


def rows(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("}") and "eval/" not in line]


def wait_for_code(slurm_dir: Path, job_id: int, timeout_s: float) -> int:
    code = slurm_dir / f"{job_id}.code"
    deadline = time.monotonic() + timeout_s
    while not code.is_file() or not code.read_text().strip():
        assert time.monotonic() < deadline, (slurm_dir / f"{job_id}.out").read_text()[-4000:]
        time.sleep(0.5)
    return int(code.read_text())


def test_the_dry_run_prints_the_job_and_writes_nothing(tmp_path, tiny_model_dir, tiny_gsm8k):
    run_dir = tmp_path / "run"
    out = subprocess.run(train_command(run_dir, tiny_model_dir, tiny_gsm8k, "--dry-run"), cwd=tmp_path,
                         env=environment(1), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    script = out.stdout
    assert script.startswith("#!/bin/bash\n#SBATCH --job-name=gsm8k-lora-grpo\n#SBATCH --nodes=3\n")
    assert "#SBATCH --requeue" in script and "#SBATCH --gpus-per-node" not in script  # CPU nodes
    assert "torchrun\" --nnodes 2 --node_rank \"$SLURM_PROCID\" --nproc_per_node 1" in script
    assert ("sampling.num_workers=1 launch.trainer_ranks=2 run.overwrite=false "
            "\"transport.address=tcp://$MASTER:$PORT\")") in script
    assert not run_dir.exists()
    bash = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert bash.returncode == 0, bash.stderr


def test_a_job_whose_options_or_run_cannot_work_is_refused_before_anything_is_written(tmp_path, tiny_model_dir,
                                                                                      tiny_gsm8k):
    command = train_command(tmp_path / "run", tiny_model_dir, tiny_gsm8k)
    for change, said in (([*command[:5], "--nodes", "2", "--trainer-nodes", "2", *command[9:]],
                          "--trainer-nodes 2 of --nodes 2: the trainer needs at least one node and the samplers"),
                         ([*command, "sampling.prompts_per_step=1"], "launch.trainer_ranks=2 is more than "
                                                                      "sampling.prompts_per_step=1")):
        out = subprocess.run(change, cwd=tmp_path, env=environment(1), capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and said in out.stderr, out.stderr
    assert not (tmp_path / "run").exists()


def test_three_nodes_train_and_the_same_script_resumes_after_a_node_failure(tmp_path, tiny_model_dir, tiny_gsm8k):
    run_dir, first_job = tmp_path / "run", 4101
    out = subprocess.run(train_command(run_dir, tiny_model_dir, tiny_gsm8k, "transport.secret=sekrit-4101"),
                         cwd=tmp_path, env=environment(first_job), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and f"Submitted batch job {first_job}" in out.stdout, out.stdout + out.stderr
    slurm_dir = run_dir / "slurm"
    script = slurm_dir / "train.sbatch"
    assert stat.S_IMODE((slurm_dir / "secret").stat().st_mode) == 0o600 and stat.S_IMODE(script.stat().st_mode) == 0o700
    assert (slurm_dir / "secret").read_text().strip() == "sekrit-4101" and "sekrit" not in script.read_text()
    job = int((slurm_dir / f"{first_job}.pid").read_text())
    deadline = time.monotonic() + 600
    while len(rows(run_dir)) < 2:  # trained two steps (a checkpoint after each: checkpoint.every=1)
        assert time.monotonic() < deadline and not (slurm_dir / f"{first_job}.code").exists(), \
            (slurm_dir / f"{first_job}.out").read_text()[-4000:]
        time.sleep(0.2)
    os.killpg(job, signal.SIGKILL)  # every node's processes at once, as a lost allocation
    for name in ("trainer", "sampler"):
        subprocess.run(["pkill", "-KILL", "-f", f"grpo.workers.{name}.*run.dir={run_dir}"])
    killed_at = rows(run_dir)
    assert 2 <= len(killed_at) < 8, killed_at  # 8 steps: the kill lands long before the last

    second_job = 4102  # a new submission gets a new job id
    out = subprocess.run(["sbatch", str(script)], env=environment(second_job), capture_output=True, text=True)
    assert out.stdout.strip() == f"Submitted batch job {second_job}"
    assert wait_for_code(slurm_dir, second_job, 600) == 0, (slurm_dir / f"{second_job}.out").read_text()[-4000:]
    assert rows(run_dir) == list(range(1, 9))  # the steps after the checkpoint trained once more, none twice
    assert (run_dir / "weights" / "LATEST").read_text().strip() == "8"
    second_log = (slurm_dir / f"{second_job}.out").read_text()
    assert "resum" in second_log.lower(), second_log[-3000:]


FAKE_PYTHON = """#!/bin/bash
if [ "$1" = "-c" ]; then exec {python} "$@"; fi  # the script's own use: a free port
echo "sampler $*" >> {log}
exit 3
"""
FAKE_TORCHRUN = """#!/bin/bash
trap 'echo "trainer stopped by SIGTERM" >> {log}; exit 0' TERM
echo "trainer started" >> {log}
while true; do sleep 0.1; done
"""


def test_a_failed_sampler_stops_the_trainer_and_fails_the_job_with_its_code(tmp_path):
    """The samplers' node ends with the code of its first sampler to fail; the trainer is then sent
    SIGTERM (it checkpoints and stops) and the job exits with the sampler's code, never waits."""
    from grpo.commands.slurm import SlurmJob, sbatch_script

    bin_dir, log = tmp_path / "bin", tmp_path / "processes.log"
    bin_dir.mkdir()
    for name, text in (("python", FAKE_PYTHON), ("torchrun", FAKE_TORCHRUN)):
        (bin_dir / name).write_text(text.format(python=sys.executable, log=log))
        (bin_dir / name).chmod(0o755)
    run_dir = tmp_path / "run"
    (run_dir / "slurm").mkdir(parents=True)
    (run_dir / "slurm" / "secret").write_text("s3cret\n")
    job = SlurmJob(nodes=3, trainer_nodes=2, gpus_per_node=0, run_dir=run_dir, python=bin_dir / "python",
                   sampler_python=bin_dir / "python", pythonpath=None, workdir=tmp_path, args=(), name="fails")
    (run_dir / "slurm" / "train.sbatch").write_text(sbatch_script(job))
    started = time.monotonic()
    done = subprocess.run(["bash", str(run_dir / "slurm" / "train.sbatch")], env={**environment(7), "SLURM_JOB_ID": "7",
                          "SLURM_JOB_NODELIST": NODES}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stdout + done.stderr
    lines = log.read_text().splitlines()
    assert lines.count("trainer started") == 2 and lines.count("trainer stopped by SIGTERM") == 2
    samplers = [line for line in lines if line.startswith("sampler -m grpo.workers.sampler")]
    assert len(samplers) == 1 and samplers[0].endswith("sampling.worker_index=0")
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("children, code", [
    ("(exit 0) & pids+=($!); (exit 0) & pids+=($!)", 0),  # a node's samplers after the last step
    ("(exit 0) & pids+=($!); (sleep 0.5; exit 3) & pids+=($!); sleep 60 & pids+=($!)", 3),
])
def test_a_sampler_node_ends_with_its_samplers_code_even_when_they_ended_before_the_wait(children, code):
    """Each child has ended before the script waits (bash's `wait -n` then answers 127, not their code); a
    failure ends the node at once, its other samplers stopped."""
    from grpo.commands.slurm import WAIT_SAMPLERS

    started = time.monotonic()
    done = subprocess.run(["bash", "-c", f"pids=(); {children}; sleep 0.2\n{WAIT_SAMPLERS}"], capture_output=True,
                          text=True, timeout=30)
    assert (done.returncode, done.stderr) == (code, "")
    assert time.monotonic() - started < 10  # the sleeper was stopped, not waited for

