"""N samplers feeding the real trainer, with generation replaced by a timed wait: how the
trainer's idle fraction falls as samplers are added, against the model of docs/scaling.md.

    .venv/bin/python scripts/benchmarks/simulate_scaling.py [--samplers 1,2,4] [--generate-s 3.0]
                                                 [--staleness 3] [--steps 14] [--ranks 1]

The trainer is the real `deepspeed training_worker.py` (a tiny random Llama with LoRA, so a
step is short), with its real socket, inbox, digest and behaviour checks, DeepSpeed step and
publishing. Each fake sampler is a thread with its own ZeroMQ sender that does what a sampler
does around generation: it waits until the weights its global step may use are published
(loaded through a real `WeightWatcher`, checksums and all), waits `--generate-s` seconds in
place of generating, then sends a batch naming that version and its digest.

The model (docs/scaling.md): with generation time G per batch, trainer time T per step, weights
latency L (publish + poll) and staleness s, the steady step time is
max(T, G / N, (G + T + L) / (s + 1)); the trainer idles 1 - T / step of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from grpo.config import load_config  # noqa: E402
from grpo.objective import Objective  # noqa: E402
from grpo.run.ports import free_local_port  # noqa: E402
from grpo.run.secret import run_secret  # noqa: E402
from grpo.weights.folder import INITIAL_DIGEST, Staged, WeightWatcher  # noqa: E402
from grpo.wire.batch import RolloutBatch  # noqa: E402
from grpo.wire.behaviour import behaviour_of  # noqa: E402
from grpo.wire.delivery import global_step, steps_of_sampler  # noqa: E402
from grpo.wire.staleness import required_version, wait_for_version  # noqa: E402
from grpo.wire.transport import BatchSender  # noqa: E402

if TYPE_CHECKING:
    from grpo.config import Config

POLL_S = 0.05  # the fake samplers' weights poll


def predicted_step_s(generate_s: float, train_s: float, latency_s: float, staleness: int, samplers: int) -> float:
    """Steady-state seconds per trainer step (docs/scaling.md)."""
    return max(train_s, generate_s / samplers, (generate_s + train_s + latency_s) / (staleness + 1))


def tiny_model(folder: Path, hidden_size: int = 64) -> None:
    """A tiny random Llama with the embedded model's tokenizer (the tests' processes use it too)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo.config import ModelConfig
    from grpo.model.loading import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def fixed_batch(behaviour: dict, cfg: Config) -> RolloutBatch:
    """4 prompts x 8 completions of 24 tokens; its contents do not matter, its cost does (its advantages
    follow from its rewards, as the trainer checks)."""
    from grpo.objective.advantages import group_advantages
    from grpo.rewards.overlong import overlong_penalty, reward_columns

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (64,), generator=g) for _ in range(4)]
    completions = [torch.randint(3, 500, (24,), generator=g) for _ in range(32)]
    r = cfg.rewards
    names, weights = reward_columns(r.names, r.weights, r.overlong_buffer)
    rewards = torch.randn(32, len(names), generator=g)
    if r.overlong_buffer > 0:
        rewards[:, -1] = overlong_penalty(24, cfg.sampling.max_new_tokens, r.overlong_buffer, r.overlong_penalty)
    totals = (rewards.double() @ torch.tensor(weights, dtype=torch.float64)).float()
    return RolloutBatch(step=0, policy_version=0, prompt_ids=prompts, completion_ids=completions,
                        group_sizes=[8] * 4, old_logps=[torch.full((24,), -6.0) for _ in completions],
                        ref_logps=None, rewards=rewards, reward_names=names,
                        advantages=group_advantages(totals, 8, scale=cfg.training.advantage_scale),
                        truncated=torch.zeros(32, dtype=torch.bool), behaviour=behaviour, totals=totals,
                        scored=torch.ones(32, dtype=torch.bool), worst=torch.zeros(32, dtype=torch.bool))


def fake_sampler(index: int, cfg: Config, batch: RolloutBatch, generate_s: float, errors: list) -> None:
    served = {"digest": INITIAL_DIGEST}
    watcher = WeightWatcher(cfg.weights_dir, [lambda folder, manifest, version:
                                              Staged(lambda: served.update(digest=manifest["digest"]))])
    sender = BatchSender(cfg.transport.address, send_timeout_s=300,
                         secret=run_secret(cfg.transport.secret, cfg.run_dir))
    try:
        for step in range(steps_of_sampler(index, cfg.training.steps, cfg.sampling.num_workers)):
            g = global_step(index, step, cfg.sampling.num_workers)
            wait_for_version(watcher, required_version(g, cfg.sampling.max_staleness, 1), 300, poll_s=POLL_S)
            version, digest = watcher.version, served["digest"]
            time.sleep(generate_s)  # in place of generating
            sender.send(dataclasses.replace(batch, sampler=index, step=step, policy_version=version,
                                            token_versions=None, weights_digest=digest))  # every token: version
    except Exception as e:  # reported by the caller
        errors.append(f"sampler {index}: {e}")
    finally:
        sender.close()


def simulate(samplers: int, generate_s: float, staleness: int, steps: int, ranks: int, model_dir: Path,
             run_dir: Path) -> dict:
    """One run; the trainer's measured step time, train time and idle fraction in the steady state, and the model's."""
    overrides = [f"run.dir={run_dir}", f"model.name_or_path={model_dir}", "lora.r=4", "training.beta=0",
                 f"transport.address=tcp://127.0.0.1:{free_local_port()}", f"sampling.num_workers={samplers}",
                 f"sampling.max_staleness={staleness}", f"training.steps={steps}", "logging.tensorboard=false",
                 "checkpoint.every=100000", "sampling.max_new_tokens=24", "training.verify_shared_prefix=false"]
    cfg = load_config(ROOT / "config.yaml", overrides)
    from grpo.model.loading import load_tokenizer

    batch = fixed_batch(behaviour_of(cfg, load_tokenizer(cfg.model), Objective.of(cfg).header()), cfg)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "trainer.log", "wb") as log:
        trainer = subprocess.Popen([str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks),
                                    "--master_port", str(free_local_port()), str(ROOT / "training_worker.py"),
                                    "--config", str(ROOT / "config.yaml"), *overrides],
                                   cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    errors: list[str] = []
    threads = [threading.Thread(target=fake_sampler, args=(i, cfg, batch, generate_s, errors), daemon=True)
               for i in range(samplers)]
    for thread in threads:
        thread.start()
    code = trainer.wait(timeout=900)
    if code != 0 or errors:
        raise RuntimeError(f"trainer exit {code}, {errors}:\n{(run_dir / 'trainer.log').read_text()[-3000:]}")
    # steady state: the first staleness + 1 batches need only version 0, so the samplers make them
    # while the trainer starts; measure from the row after them
    all_rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, rows = all_rows[staleness], all_rows[staleness + 1:]
    wall = rows[-1]["wall_time"] - first["wall_time"]
    step_s = wall / len(rows)
    train_s = statistics.median(r["timing/train_s"] + r["timing/publish_s"] for r in rows)
    idle = sum(r["timing/wait_s"] for r in rows) / wall
    predicted = predicted_step_s(generate_s, train_s, POLL_S / 2, staleness, samplers)
    return {"samplers": samplers, "step_s": step_s, "train_s": train_s, "idle": idle, "predicted_step_s": predicted,
            "predicted_idle": 1 - train_s / predicted, "staleness_max": max(r["staleness"] for r in rows)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samplers", default="1,2,4")
    parser.add_argument("--generate-s", type=float, default=3.0)
    parser.add_argument("--staleness", type=int, default=3)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--ranks", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"# generation {args.generate_s:g} s per batch (a wait), max_staleness {args.staleness}, "
          f"{args.steps} steps, {args.ranks} trainer rank(s)")
    print("| samplers | trainer s/step (T) | step s, measured | step s, model | trainer idle, measured | model | "
          "max staleness |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        tiny_model(Path(tmp) / "model")
        for n in (int(x) for x in args.samplers.split(",")):
            r = simulate(n, args.generate_s, args.staleness, args.steps, args.ranks, Path(tmp) / "model",
                         Path(tmp) / f"run{n}")
            print(f"| {n} | {r['train_s']:.2f} | {r['step_s']:.2f} | {r['predicted_step_s']:.2f} | {r['idle']:.0%} | "
                  f"{r['predicted_idle']:.0%} | {r['staleness_max']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
