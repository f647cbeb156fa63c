"""`grpo train --slurm`: one sbatch script that runs the whole run on a Slurm allocation, no Ray.

    grpo train --slurm --nodes 4 --trainer-nodes 2 --gpus-per-node 8 [--partition P] [--time 24:00:00]
               [--account A] [--dry-run] [--config ...] [key=value ...]

The first `--trainer-nodes` nodes run the trainer's DeepSpeed ranks (torchrun, one launcher per node,
`--gpus-per-node` ranks each, the rendezvous on the first node); every other node runs one sampler
per GPU (one per node without GPUs). The samplers reach the trainer at tcp://<first node>:<port>,
signed with the run's secret (written once to <run.dir>/slurm/secret, mode 0600, never into the
script). The run folder and the Python environment must be on storage every node sees: each node
checks at the start that it sees the file the batch host wrote there, and stops the job with a
message naming the folder otherwise. Resubmitting the same script (or a requeue: the script asks
for `--requeue`) resumes the run from its last checkpoint; Slurm's SIGTERM before the time limit
(`--signal=TERM@120`) makes the trainer checkpoint.
"""

from __future__ import annotations

import os
import secrets
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from grpo.commands.processes import SAMPLER_MODULE, TRAINER_MODULE, checkout_root, sampler_python
from grpo.common.files import write_atomically
from grpo.settings import Config

SCRIPT_NAME = "train.sbatch"
SIGTERM_LEAD_S = 120  # Slurm's SIGTERM before the time limit: the trainer's checkpoint needs the time
FLAGS = {"--nodes": "nodes", "--trainer-nodes": "trainer_nodes", "--gpus-per-node": "gpus_per_node",
         "--partition": "partition", "--time": "time", "--account": "account"}
NUMBERS = ("nodes", "trainer_nodes", "gpus_per_node")
OPTIONS_HELP = """\
  --slurm         write <run.dir>/slurm/train.sbatch for a Slurm cluster and submit it with sbatch
                  (--dry-run: print it): --nodes N, --trainer-nodes T (1), --gpus-per-node G (8; 0:
                  CPU nodes), --partition, --time, --account (docs/running.md, "Slurm")"""


@dataclass(frozen=True)
class SlurmJob:
    """What the sbatch script is made from."""

    nodes: int
    trainer_nodes: int
    gpus_per_node: int  # 0: CPU nodes (one trainer rank and one sampler per node)
    run_dir: Path  # absolute: every node's view of the shared run folder
    python: Path  # the environment's Python, on shared storage too
    sampler_python: Path  # the samplers' (an engine's own environment: sampling.vllm.python)
    pythonpath: str | None  # a checkout's root, when the project is not installed
    workdir: Path  # where the job runs (relative paths in the config are read from here)
    args: tuple[str, ...]  # --config and key=value, as given
    name: str
    partition: str = ""
    time: str = ""
    account: str = ""

    @property
    def per_node(self) -> int:
        return max(self.gpus_per_node, 1)

    @property
    def trainer_ranks(self) -> int:
        return self.trainer_nodes * self.per_node

    @property
    def samplers(self) -> int:
        return (self.nodes - self.trainer_nodes) * self.per_node

    def overrides(self) -> list[str]:
        """What the job sets on top of the user's config: every process agrees on these. A run folder to
        overwrite was moved aside when the script was written: a resubmission resumes, never moves it."""
        return [f"run.dir={self.run_dir}", f"sampling.num_workers={self.samplers}",
                f"launch.trainer_ranks={self.trainer_ranks}", "run.overwrite=false"]


def take_options(argv: list[str]) -> tuple[dict, list[str]]:
    """The job's options (--nodes, ...) and the rest of argv."""
    options, rest, i = {"nodes": None, "trainer_nodes": 1, "gpus_per_node": 8}, [], 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in FLAGS:
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 0 if "=" in arg else 1
            key = FLAGS[name]
            if key in NUMBERS and not value.isdigit():
                raise ValueError(f"{name} needs a whole number; got {value!r}")
            options[key] = int(value) if key in NUMBERS else value
        else:
            rest.append(arg)
        i += 1
    return options, rest


def folder_problems(run_dir: Path) -> list[str]:
    """A run folder the sbatch header cannot name (its --output path is split at spaces; % starts a pattern)."""
    if any(c.isspace() or c == "%" for c in str(run_dir)):
        return [f"run.dir {run_dir} holds a space or %, which an sbatch header cannot name: pick another run.dir"]
    return []


def option_problems(options: dict) -> list[str]:
    nodes, trainer_nodes = options["nodes"], options["trainer_nodes"]
    if nodes is None:
        return ["--slurm needs --nodes N: the job's nodes, trainer and sampler nodes together"]
    if not 1 <= trainer_nodes < nodes:
        return [f"--trainer-nodes {trainer_nodes} of --nodes {nodes}: the trainer needs at least one node and the "
                "samplers at least one of their own"]
    return []


def slurm_job(options: dict, cfg: Config, args: list[str]) -> SlurmJob:
    """The job of `options` for the run `cfg`, loaded from `args` (--config and key=value)."""
    return SlurmJob(nodes=options["nodes"], trainer_nodes=options["trainer_nodes"],
                    gpus_per_node=options["gpus_per_node"], run_dir=Path(cfg.run_dir).resolve(),
                    python=Path(sys.executable).absolute(), sampler_python=Path(sampler_python(cfg)).absolute(),
                    pythonpath=checkout_root(), workdir=Path.cwd(), args=tuple(without_secret(absolute_config(args))),
                    name=cfg.run.name, partition=options.get("partition") or "", time=options.get("time") or "",
                    account=options.get("account") or "")


def without_secret(args: list[str]) -> list[str]:
    """`args` less a transport.secret override: the secret goes to <run.dir>/slurm/secret, never into the
    script or a process's command line."""
    return [a for a in args if not a.startswith("transport.secret=")]


def absolute_config(args: list[str]) -> list[str]:
    """`args` with the --config path made absolute: the job may start in another folder."""
    out, i = [], 0
    while i < len(args):
        if args[i] == "--config" and i + 1 < len(args):
            out += ["--config", str(Path(args[i + 1]).resolve())]
            i += 2
            continue
        out.append(f"--config={Path(args[i].split('=', 1)[1]).resolve()}" if args[i].startswith("--config=")
                   else args[i])
        i += 1
    return out


# the batch shell's end: the first step to end decides (portable to bash 4.3: no `wait -p`)
SUPERVISE = """trap 'kill -TERM "$trainer" "$samplers" 2>/dev/null; wait; exit 143' TERM INT  # the trainer checkpoints
set +e
while kill -0 "$trainer" 2>/dev/null && kill -0 "$samplers" 2>/dev/null; do sleep 2; done
if kill -0 "$trainer" 2>/dev/null; then  # the samplers ended first: after their last step, or failed
    wait "$samplers"
    sampled=$?
    [ "$sampled" -eq 0 ] || kill -TERM "$trainer"  # a sampler failed: the trainer checkpoints and stops
    wait "$trainer"
    code=$?
    [ "$code" -ne 0 ] || code=$sampled
else
    wait "$trainer"
    code=$?
    for _ in $(seq 60); do kill -0 "$samplers" 2>/dev/null || break; sleep 1; done  # a minute to end
    kill -TERM "$samplers" 2>/dev/null
    wait "$samplers"
fi
exit $code
"""
# a sampler node's end: the first sampler to fail ends the others and the node's step with its code
WAIT_SAMPLERS = """    code=0  # the first sampler to fail ends the others: the step fails with its code
    while [ "$code" -eq 0 ] && [ ${#pids[@]} -gt 0 ]; do  # polled: `wait -n` misses a child already reaped
        sleep 1
        running=()
        for p in "${pids[@]}"; do
            if kill -0 "$p" 2>/dev/null; then running+=("$p"); else wait "$p" || code=$?; fi
        done
        pids=("${running[@]}")
    done
    [ "$code" -eq 0 ] || kill -TERM "${pids[@]}" 2>/dev/null
    exit $code"""
FREE_PORT = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"


def sbatch_headers(job: SlurmJob) -> list[str]:
    """The job's #SBATCH options: its nodes whole, requeue-safe, one job of the run's name at a time."""
    headers = [f"--job-name={job.name}", f"--nodes={job.nodes}", "--ntasks-per-node=1", "--exclusive",
               f"--output={job.run_dir}/slurm/%j.out", "--open-mode=append", "--requeue",
               "--dependency=singleton",  # one job of this name at a time: a resubmission waits for the last
               f"--signal=TERM@{SIGTERM_LEAD_S}"]
    headers += [f"--gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else []
    return headers + [f"--{key}={value}" for key, value in (("partition", job.partition), ("time", job.time),
                                                           ("account", job.account)) if value]


def sbatch_script(job: SlurmJob) -> str:
    """The script, every path absolute; the processes' arguments reach them as words, never re-read by a
    shell. Portable to bash 4.3 (no `wait -p`)."""
    q = shlex.quote
    gpus = f" --gpus-per-node={job.gpus_per_node}" if job.gpus_per_node else ""
    args = " ".join(q(a) for a in [*job.args, *job.overrides()])
    sampler_nodes, per_node = job.nodes - job.trainer_nodes, job.per_node
    # a sampler a GPU: the g-th of those Slurm gave the node
    on_gpu = (' CUDA_VISIBLE_DEVICES="${GPUS[g]}"', " sampling.device=cuda:0") if job.gpus_per_node else ("", "")
    step = "srun --ntasks-per-node=1 --kill-on-bad-exit=1" + gpus
    path = f"\nexport PYTHONPATH={q(job.pythonpath)}${{PYTHONPATH:+:$PYTHONPATH}}" if job.pythonpath else ""
    return f"""#!/bin/bash
{chr(10).join(f"#SBATCH {h}" for h in sbatch_headers(job))}
# Written by `grpo train --slurm`: {job.trainer_nodes} trainer node(s) x {per_node} rank(s), {sampler_nodes} sampler
# node(s) x {per_node} sampler(s). Submit it again to resume the run from its last checkpoint.
set -euo pipefail
cd {q(str(job.workdir))}
export RUN_DIR={q(str(job.run_dir))} PYTHON={q(str(job.python))} SAMPLER_PYTHON={q(str(job.sampler_python))}
[ -s "$RUN_DIR/slurm/secret" ] || {{ echo "$RUN_DIR/slurm/secret is missing: run grpo train --slurm again" >&2
    exit 2; }}
GRPO_TRANSPORT_SECRET=$(cat "$RUN_DIR/slurm/secret")
export GRPO_TRANSPORT_SECRET BIN=$(dirname "$PYTHON") PYTHONSAFEPATH=1{path}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={SIGTERM_LEAD_S - 15}  # torchrun lets the trainer checkpoint after SIGTERM
NODES=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
# the batch host is the first node: the trainer's rank 0 binds the transport and hosts the rendezvous there
free_port() {{ "$PYTHON" -c "{FREE_PORT}"; }}
PORT=$(free_port)
RENDEZVOUS_PORT=$(free_port)
export MASTER=${{NODES[0]}} PORT RENDEZVOUS_PORT
ARGS=({args} "transport.address=tcp://$MASTER:$PORT")
# every node must see the run folder and the environment: the batch host writes a mark, each node looks for it
export MARK="$RUN_DIR/slurm/seen-$SLURM_JOB_ID"
date > "$MARK"
SEEN='[ -f "$MARK" ] && [ -x "$PYTHON" ] && [ -x "$SAMPLER_PYTHON" ] || {{ echo "node $(hostname) does not see \
$RUN_DIR or $PYTHON: put the run folder (run.dir) and the environment on a filesystem every node mounts" >&2; \
exit 2; }}'

{step} --nodes={job.trainer_nodes} --ntasks={job.trainer_nodes} \\
    --nodelist="$(IFS=,; echo "${{NODES[*]:0:{job.trainer_nodes}}}")" bash -c "$SEEN"'
    exec "$BIN/torchrun" --nnodes {job.trainer_nodes} --node_rank "$SLURM_PROCID" --nproc_per_node {per_node} \\
        --master_addr "$MASTER" --master_port "$RENDEZVOUS_PORT" -m {TRAINER_MODULE} "$@"' trainer "${{ARGS[@]}}" &
trainer=$!
{step} --nodes={sampler_nodes} --ntasks={sampler_nodes} \\
    --nodelist="$(IFS=,; echo "${{NODES[*]:{job.trainer_nodes}}}")" bash -c "$SEEN"'
    IFS=, read -ra GPUS <<< "${{CUDA_VISIBLE_DEVICES:-$(seq -s, 0 {per_node - 1})}}"
    pids=()
    for g in $(seq 0 {per_node - 1}); do
       {on_gpu[0]} "$SAMPLER_PYTHON" -m {SAMPLER_MODULE} "$@"{on_gpu[1]} \\
            sampling.worker_index=$((SLURM_PROCID * {per_node} + g)) &
        pids+=($!)
    done
{WAIT_SAMPLERS}' samplers "${{ARGS[@]}}" &
samplers=$!

{SUPERVISE}"""


def write_job(job: SlurmJob, secret: str | None) -> Path:
    """The script and the run's secret in <run.dir>/slurm/ (`secret` when given, else the one there, else a
    new one; only its owner reads it); the script's path."""
    folder = job.run_dir / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    secret_file = folder / "secret"
    if secret or not secret_file.is_file():
        written = secret_file.with_name("secret.tmp")
        written.unlink(missing_ok=True)  # created anew: mode 0600 from the start
        with os.fdopen(os.open(written, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write((secret or secrets.token_hex(32)) + "\n")
        os.replace(written, secret_file)
    script = folder / SCRIPT_NAME
    write_atomically(script, sbatch_script(job))
    script.chmod(0o700)
    return script


def submit(script: Path) -> int:
    """`sbatch script`: its answer printed, its exit code returned."""
    try:
        done = subprocess.run(["sbatch", str(script)], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        print(f"error: sbatch is not on PATH; the script is {script}: submit it where Slurm is", file=sys.stderr)
        return 2
    print((done.stdout + done.stderr).strip())
    return done.returncode


def launch(options: dict, cfg: Config, args: list[str], dry_run: bool) -> int:
    """`grpo train --slurm ...`: the script printed (--dry-run), or written to <run.dir>/slurm/ and
    submitted. Everything a real start checks is checked first, with the job's own settings."""
    from grpo.config import ConfigError, parse_cli
    from grpo.run.preflight import named_code_problems
    from grpo.run.start import planned_start, prepare_run_folder

    problems = option_problems(options) + folder_problems(Path(cfg.run_dir).resolve())
    job = None if problems else slurm_job(options, cfg, args)
    state = None
    if job is not None:
        try:  # with what the job sets: its samplers and trainer ranks against the run's steps
            parse_cli([*args, *job.overrides()], checks=[named_code_problems])
        except ConfigError as e:
            problems.append(str(e))
        state, words = planned_start(cfg)
        if state in ("refuse", "in use"):
            problems.append(words)
    if problems:
        print("\n".join(f"error: {line}" for line in problems), file=sys.stderr)
        return 2
    in_flight = cfg.sampling.max_staleness + 1  # batches the staleness gate lets the samplers make at once
    if 0 < in_flight < job.samplers:
        print(f"warning: {job.samplers} samplers, and sampling.max_staleness={cfg.sampling.max_staleness} lets "
              f"{in_flight} of them work at once: raise sampling.max_staleness, or give the samplers fewer GPUs "
              "(docs/scaling.md)", file=sys.stderr)
    if dry_run:
        print(sbatch_script(job), end="")
        return 0
    if state == "overwrite":  # here, not in the job: the trainer would move the job's own files aside with it
        print(f"run.overwrite=true: the old contents of {job.run_dir} were moved to {prepare_run_folder(cfg)}")
    script = write_job(job, cfg.transport.secret or os.environ.get("GRPO_TRANSPORT_SECRET"))
    print(f"wrote {script} ({job.trainer_nodes} trainer node(s) with {job.trainer_ranks} rank(s), "
          f"{job.nodes - job.trainer_nodes} sampler node(s) with {job.samplers} sampler(s)); submitting it:")
    return submit(script)
