"""Starts a run's processes on this machine and supervises them (`grpo train`, the default launcher;
`placement` says where each process runs).

The transport gets a free loopback port unless transport.address is set, so that two runs can
share a machine; a fresh start into a used run folder is refused (grpo/run/start.py). Everything
lands in the run folder: config, address, sampler.log (sampler0.log, ... with several),
trainer.log, metrics.jsonl, tb/, weights/, checkpoints/; each launch opens its part of each log with
a header line. Everything a run needs is checked before anything starts (grpo/run/preflight.py).
Ctrl-C, a failure of any process, or a worker silent in its start-up (launch.stall_s,
grpo/run/watchdog.py) stops all (the trainer checkpoints on SIGTERM); the exit code says which
failed (3: a sampler, 4: the trainer, 130: interrupted; 2: a mistake in the command or config),
and the failing log's last lines of this launch are shown (a sampler's own exit code among them:
8, a reward that fails on every sample; 9, an environment that fails on every episode).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from grpo.commands.processes import SAMPLER_MODULE, TRAINER_MODULE, checkout_root, sampler_python
from grpo.common.files import RunFolderError, ensure_writable, write_atomically
from grpo.common.run_folder import RunFolder
from grpo.config import Config, TransportConfig
from grpo.run.history import resume_changes
from grpo.run.ports import free_local_port, free_loopback_address
from grpo.run.preflight import device_problems, planning_note, source_problems, vllm_problem
from grpo.run.progress import StepProgress, WorkerLogs, format_duration, stop_summary
from grpo.run.start import planned_start, prepare_run_folder
from grpo.run.watchdog import StartupWatch
from grpo.settings.engines import ENGINE_TRAITS

EXIT_SAMPLER_FAILED, EXIT_TRAINER_FAILED, EXIT_INTERRUPTED, EXIT_USAGE = 3, 4, 130, 2
STOP_GRACE_S = 60  # the trainer saves a checkpoint on SIGTERM
FLAGS = ("--gpus",)
OPTIONS_HELP = """\
  --gpus N        with --dry-run only: plan for a machine with N GPUs (planning on another machine)"""


def take_options(argv: list[str]) -> tuple[dict, list[str]]:
    """--gpus N (plan for a machine with N GPUs, with --dry-run only), and the rest of argv."""
    options, rest, i = {"gpus": None}, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--gpus" or arg.startswith("--gpus="):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 0 if "=" in arg else 1
            if not value.isdigit():
                raise ValueError(f"--gpus needs a number of GPUs; got {value!r}")
            options["gpus"] = int(value)
        else:
            rest.append(arg)
        i += 1
    return options, rest


def launch(options: dict, cfg: Config, args: list[str], dry_run: bool) -> int:
    """The run `cfg` (loaded from `args`): its plan printed (dry_run), or its processes started here."""
    if options["gpus"] is not None and not dry_run:
        print("error: --gpus plans for another machine and goes with --dry-run only; a real start counts its GPUs",
              file=sys.stderr)
        return EXIT_USAGE
    gpus_here = gpu_count()
    gpus_given = options["gpus"] is not None
    gpus = options["gpus"] if gpus_given else gpus_here
    address, address_picked = run_address(cfg)
    plan = make_plan(cfg, args, gpus, os.cpu_count() or 1, address, free_master_port(address))
    problems, warnings, changes = launch_problems(cfg, plan, gpus_here, gpus_given)
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    if problems:  # every one of them, before anything starts
        print("\n".join(f"error: {line}" for line in problems), file=sys.stderr)
        return EXIT_USAGE
    if dry_run:
        return report_plan(cfg, plan, address_picked, gpus_given, changes)
    if changes:
        print(changes, flush=True)
    return start_run(cfg, plan)


def placement(trainer_ranks: int, cpu_threads: int, gpus: int, cores: int, samplers: int = 1) -> dict:
    """Ranks, visible GPUs and thread counts for the trainer and each sampler (a pure function):
    with more GPUs than samplers the last ones sample, one each, and the others train (or
    launch.trainer_ranks of them); with fewer, all share GPU 0; on a CPU-only machine one trainer
    rank and the samplers split the cores (or launch.cpu_threads each)."""
    if gpus == 0:
        threads = cpu_threads or max(1, cores // (1 + samplers))
        cpu_env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": ""}
        return {"ranks": trainer_ranks or 1, "trainer_env": dict(cpu_env),
                "sampler_envs": [dict(cpu_env) for _ in range(samplers)]}
    if gpus <= samplers:  # not one GPU each: everything shares the first
        return {"ranks": trainer_ranks or 1, "trainer_env": {"CUDA_VISIBLE_DEVICES": "0"},
                "sampler_envs": [{"CUDA_VISIBLE_DEVICES": "0"} for _ in range(samplers)]}
    ranks = min(trainer_ranks or gpus - samplers, gpus - samplers)
    return {"ranks": ranks, "trainer_env": {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(ranks))},
            "sampler_envs": [{"CUDA_VISIBLE_DEVICES": str(gpus - samplers + i)} for i in range(samplers)]}


def make_plan(cfg: Config, argv: list[str], gpus: int, cores: int, address: str, master_port: int) -> dict:
    """What the launcher starts (a pure function but for which Python a vLLM sampler runs with):
    per process its command and the environment variables it sets."""
    samplers = cfg.sampling.num_workers
    placed = placement(cfg.launch.trainer_ranks, cfg.launch.cpu_threads, gpus, cores, samplers)
    # every process gets the address: the workers' config.yaml in the run folder records it
    shared = [*argv, f"sampling.num_workers={samplers}", f"transport.address={address}"]
    command, env = trainer_command(placed, shared, master_port)
    processes = {"trainer": {"command": command, "env": env}}
    for i, name in enumerate(sampler_names(samplers)):
        processes[name] = {"command": [sampler_python(cfg), "-m", SAMPLER_MODULE, *shared,
                                       f"sampling.worker_index={i}"], "env": placed["sampler_envs"][i]}
    return {"gpus": gpus, "cores": cores, "ranks": placed["ranks"], "address": address,
            "master_port": master_port, "processes": processes}


def trainer_command(plan: dict, args: list[str], port: int) -> tuple[list[str], dict]:
    """One rank: the worker itself, with the environment DeepSpeed's launcher would give it, which
    spares its runner and launcher processes (~240 MB RSS each: both import torch). Several:
    `deepspeed --num_gpus N --module grpo.workers.trainer`."""
    if plan["ranks"] == 1:
        rank_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        return [sys.executable, "-u", "-m", TRAINER_MODULE, *args], {**plan["trainer_env"], **rank_env}
    deepspeed = Path(sys.executable).parent / "deepspeed"
    return ([str(deepspeed), "--num_gpus", str(plan["ranks"]), "--master_port", str(port), "--module", TRAINER_MODULE,
             *args],
            plan["trainer_env"])


def sampler_names(samplers: int) -> list[str]:
    return ["sampler"] if samplers == 1 else [f"sampler{i}" for i in range(samplers)]


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def run_address(cfg: Config) -> tuple[str, bool]:
    """The transport address and whether it was picked here: the default one would make a second
    run on this machine connect to the first, so an unset address becomes a free loopback port."""
    if cfg.transport.address != TransportConfig().address:
        return cfg.transport.address, False
    return free_loopback_address(), True


def free_master_port(address: str) -> int:
    """A free port for DeepSpeed's rendezvous that is not the one just picked for the transport."""
    port = free_local_port()
    while str(port) == address.rsplit(":", 1)[-1]:
        port = free_local_port()
    return port


def rank_problem(ranks: int, gpus: int, cfg: Config) -> str | None:
    """Each rank trains whole groups: more ranks than groups a step leave some idle every step."""
    groups = cfg.sampling.prompts_per_step
    if ranks <= groups:
        return None
    given = (f"launch.trainer_ranks={ranks} gives {ranks} trainer ranks" if cfg.launch.trainer_ranks == ranks
             else f"{gpus} GPUs give {ranks} trainer ranks")
    return (f"{given} but sampling.prompts_per_step={groups} gives only {groups} groups a step: raise "
            f"sampling.prompts_per_step to >= {ranks} (a multiple of {ranks} balances the ranks) or set "
            f"launch.trainer_ranks={groups}")


def rank_warning(ranks: int, cfg: Config) -> str | None:
    groups = cfg.sampling.prompts_per_step
    if groups % ranks == 0:
        return None
    return (f"sampling.prompts_per_step={groups} is not a multiple of the {ranks} trainer ranks: some "
            f"ranks train {groups // ranks + 1} groups a step, others {groups // ranks}, and each step waits for "
            "the busiest")


def placement_problem(trainer_ranks: int, gpus: int, samplers: int, where: str) -> str | None:
    """launch.trainer_ranks that `placement` could not give as asked (on GPUs each rank needs a GPU
    of its own); `where` names the machine ('this machine has' or 'the plan is for')."""
    if trainer_ranks <= 1 or gpus == 0:
        return None
    own = gpus - samplers if gpus > samplers else 1  # with fewer GPUs than samplers, all share GPU 0
    if trainer_ranks <= own:
        return None
    shared = (f"the trainer and sampling.num_workers={samplers} sampler(s) share GPU 0" if gpus <= samplers else
              f"sampling.num_workers={samplers} sampler(s) take {samplers} of them, one each")
    return (f"launch.trainer_ranks={trainer_ranks} cannot be placed: {where} {gpus} GPU{'s' * (gpus != 1)} and "
            f"{shared}, which leaves {own} for trainer ranks (one GPU each); set launch.trainer_ranks={own} "
            f"(or 0: automatic), or use a machine with {trainer_ranks + samplers} GPUs")


def plan_lines(cfg: Config, plan: dict, state: str, address_picked: bool, gpus_given: bool) -> list[str]:
    """The dry run's report: one line per fact, then each process's devices, environment and command."""
    run_dir = Path(cfg.run_dir)
    lines = ["dry run: nothing is started, created or moved",
             f"run folder  {run_dir} ({'exists' if run_dir.is_dir() else 'does not exist yet'})",
             f"start       {state}",
             f"machine     {plan['gpus']} GPU{'s' * (plan['gpus'] != 1)}{' (--gpus)' if gpus_given else ''}, "
             f"{plan['cores']} CPU cores",
             f"transport   {plan['address']} " + ("(a free loopback port; a real start picks its own)" if address_picked
                                                   else "(transport.address)"),
             f"deepspeed   master port {plan['master_port']} (a real start picks its own free port)"]
    for name, process in plan["processes"].items():
        env = process["env"]
        devices = (f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}" if env["CUDA_VISIBLE_DEVICES"]
                   else f"CPU, {env['OMP_NUM_THREADS']} threads")
        ranks = f"{plan['ranks']} rank{'s' * (plan['ranks'] > 1)}"
        what = ranks if name == "trainer" else f"engine {cfg.sampling.engine}"
        lines.append(f"{name:<11} {what}, {devices}")
        if name != "trainer" and ENGINE_TRAITS[cfg.sampling.engine].own_python:
            found = process["command"][0] != sys.executable
            lines.append(f"  python   {process['command'][0]}" + ("" if found else
                         f" (sampling.vllm.python={cfg.sampling.vllm.python} does not exist: make install-vllm)"))
        lines.append(f"  env      {' '.join(f'{k}={v}' for k, v in env.items())}")
        lines.append(f"  command  {shlex.join(process['command'])}")
    return lines


def launch_problems(cfg: Config, plan: dict, gpus_here: int,
                    gpus_given: bool) -> tuple[list[str], list[str], str | None]:
    """(problems, warnings, the settings a resume changes): everything that would stop this run after
    it started, found now. A plan for another machine (--gpus) reports what this machine lacks
    (model, data, vLLM) as warnings."""
    gpus, samplers = plan["gpus"], cfg.sampling.num_workers
    where = "the plan is for" if gpus_given else "this machine has"
    problems = [p for p in (rank_problem(plan["ranks"], gpus, cfg),
                            placement_problem(cfg.launch.trainer_ranks, gpus, samplers, where)) if p]
    problems += device_problems(cfg, gpus)
    warnings = [w for w in (None if problems else rank_warning(plan["ranks"], cfg),
                            planning_note(gpus, gpus_here) if gpus_given else None) if w]
    refusal, changes = resume_changes(cfg)  # a resume that changes what its checkpoint depends on
    problems += [refusal] if refusal else []
    found, notes = source_problems(cfg)
    vllm = vllm_problem(cfg.sampling, plan["processes"][sampler_names(samplers)[0]]["command"][0])
    found += [vllm] if vllm else []
    if gpus_given:
        warnings += [f"on this machine: {line}" for line in found]
    else:
        problems += found
    return problems, warnings + notes, changes


def report_plan(cfg: Config, plan: dict, address_picked: bool, gpus_given: bool, changes: str | None = None) -> int:
    """--dry-run: print the plan (with the settings a resume changes); exit 2 where a real start
    would refuse the run folder."""
    state, words = planned_start(cfg)
    lines = plan_lines(cfg, plan, words, address_picked, gpus_given)
    if changes:
        lines.insert(3, f"changes     {changes}")
    print("\n".join(lines))
    if state in ("refuse", "in use"):  # as a real start would: one line
        print(f"error: {words}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def start_run(cfg: Config, plan: dict) -> int:
    """Check what the run needs, claim its folder, start the processes and supervise them."""
    try:
        run_dir = ensure_writable(cfg.run_dir)
        moved = prepare_run_folder(cfg)  # refuses a fresh start into a used folder (nothing changed)
    except RunFolderError as e:  # grpo.run.start.RunFolderInUse is one
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if moved:
        print(f"run.overwrite=true: the old contents of {run_dir} were moved to {moved}", flush=True)
    write_atomically(RunFolder(run_dir).address, plan["address"] + "\n")  # for whoever attaches to this run
    logs = WorkerLogs({name: RunFolder(run_dir).log(name) for name in plan["processes"]})  # this launch's part of each
    procs = start_processes(plan, logs.logs)
    try:
        print(f"run folder {run_dir}: trainer ({plan['ranks']} rank(s)) and {len(procs) - 1} sampler(s) started; "
              f"transport {plan['address']}; logs in {', '.join(path.name for path in logs.logs.values())}",
              flush=True)
        return supervise(cfg, procs, logs, StepProgress(RunFolder(run_dir).metrics, cfg.training.steps))
    except BrokenPipeError:  # whoever read this output is gone (a Python caller, a closed pipe): stop the run
        sys.stdout = sys.stderr = open(os.devnull, "w")
        for name in sorted(procs, key=lambda name: name == "trainer"):  # the samplers first, as Ctrl-C does
            stop(procs[name])
        return EXIT_INTERRUPTED


def start_processes(plan: dict, logs: dict[str, Path]) -> dict[str, subprocess.Popen]:
    """The processes of `make_plan`, each writing to its log after a header line of this launch,
    with its own Python's bin folder first on PATH (the venv's tools, not the shell's)."""
    procs, now = {}, time.strftime("%Y-%m-%d %H:%M:%S %Z")
    for name, process in plan["processes"].items():
        bin_dir = str(Path(process["command"][0]).parent)
        env = {**os.environ, **process["env"], "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
               "PYTHONPATH": os.pathsep.join(p for p in (checkout_root(), os.environ.get("PYTHONPATH")) if p),
               # `python -m` would put the working folder first on sys.path, where a user's rewards.py or
               # data/ would shadow the project's packages; the workers add it last instead (Python >= 3.11)
               "PYTHONSAFEPATH": "1"}
        with open(logs[name], "ab") as log:
            log.write(f"===== launch {now}: {shlex.join(process['command'])}\n".encode())
            log.flush()
            # their own session: Ctrl-C reaches only this launcher, which stops them in order
            procs[name] = subprocess.Popen(process["command"], stdout=log, stderr=subprocess.STDOUT,
                                           env=env, start_new_session=True)
    return procs


def supervise(cfg: Config, procs: dict, logs: WorkerLogs, progress: StepProgress) -> int:
    """Show progress until the trainer finishes, a process fails or stalls in its start-up, Ctrl-C
    or the time limit; stop all in each case, and say what the run left. The exit code says which."""
    interrupted = {"flag": False}
    signal.signal(signal.SIGINT, lambda *_: interrupted.update(flag=True))
    signal.signal(signal.SIGTERM, lambda *_: interrupted.update(flag=True))
    signal.signal(signal.SIGHUP, lambda *_: interrupted.update(flag=True))  # the terminal or caller went away
    deadline = time.monotonic() + cfg.launch.max_minutes * 60 if cfg.launch.max_minutes > 0 else float("inf")
    samplers = [name for name in procs if name != "trainer"]
    watch = StartupWatch(logs, procs, cfg.launch.stall_s)

    def stop_all(names):
        for name in names:
            stop(procs[name])

    def stopped() -> None:
        stop_all([*samplers, "trainer"])
        print(f"stopped: {stop_summary(cfg.run_dir, cfg.weights_dir, cfg.training.steps)}", flush=True)

    while True:
        logs.print_new()
        progress.print_new()
        codes = {name: proc.poll() for name, proc in procs.items()}
        if interrupted["flag"]:
            print("interrupted: stopping the sampler(s) and the trainer (the trainer saves a checkpoint)", flush=True)
            stopped()
            return EXIT_INTERRUPTED
        if time.monotonic() >= deadline:
            print(f"time limit: launch.max_minutes={cfg.launch.max_minutes:g} reached after "
                  f"{format_duration(time.monotonic() - progress.started)}; stopping all (the trainer saves a "
                  "checkpoint)", flush=True)
            stopped()
            return 0
        for name, code in codes.items():
            if code not in (None, 0):
                others = [other for other in procs if other != name]
                print(f"the {name} failed (exit code {code}); stopping the {', '.join(others)}. Last lines of "
                      f"{logs.logs[name]} (this launch):\n{logs.tail(name)}", file=sys.stderr, flush=True)
                stop_all(others)
                return EXIT_TRAINER_FAILED if name == "trainer" else EXIT_SAMPLER_FAILED
        stuck = watch.check()
        if stuck is not None:
            name, message = stuck
            print(f"error: {message}; stopping all", file=sys.stderr, flush=True)
            stop_all([*samplers, "trainer"])
            return EXIT_TRAINER_FAILED if name == "trainer" else EXIT_SAMPLER_FAILED
        if codes["trainer"] == 0 and not (cfg.eval.every and codes[samplers[0]] is None):
            stop_all(samplers)  # the trainer is done; a sampler may be waiting on weights (with eval.every,
            # sampler 0 first evaluates the final weights and exits by itself)
            print(f"done: {cfg.training.steps} steps; weights in {cfg.weights_dir}", flush=True)
            return 0
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process and everything it started, wait for all of them, then SIGKILL.

    The whole tree: deepspeed's runner returns as soon as it has passed the signal on, while
    its ranks are still writing their checkpoint.
    """
    import psutil

    try:
        tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=STOP_GRACE_S)
    for p in alive:
        p.kill()
    proc.wait()
