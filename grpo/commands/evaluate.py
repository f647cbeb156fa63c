"""Held-out accuracy (greedy, pass@1) and exact-format rate, for the base model or trained weights.

    grpo evaluate --run runs/<name> [--version N] [--limit N] [key=value ...]
    grpo evaluate [--config config.yaml] [--weights PATH] [--limit N]
                                         [--batch-size 16] [--out summary.json] [key=value ...]

--run evaluates a run's published version (default: the one weights/LATEST names) with that run's
resolved config (runs/<name>/config.yaml: model, prompt, rewards, task, environment); key=value
overrides still apply on top. --weights takes a published version folder (runs/<name>/weights/v000200,
adapter or full model, checksums verified; inside a run folder, that run's config is used unless
--config is given) or any PEFT adapter folder; without either the base model of --config is
evaluated. The prompt (system prompt, chat template, prefill) is the training one; an answer is
correct when rewards.accuracy_reward gives it >= 1 and well-formed when rewards.format_reward does
(GSM8K's strict pair by default; `--config configs/needle_haystack.yaml` evaluates that task with
its own scorer).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from grpo.agent.runner import rollout_runner
from grpo.common.model_files import resolve_device
from grpo.common.run_folder import RunFolder
from grpo.common.sources import SourceError
from grpo.config import Config, ConfigError, parse_cli
from grpo.data.mixture import evaluation_source, source_configs
from grpo.data.problems import load_split
from grpo.data.prompts import build_prompts
from grpo.environments import prompt_options
from grpo.environments.pool import IsolationError
from grpo.model.loading import add_lora, load_model, load_processor, load_tokenizer
from grpo.rewards.sandbox import reward_sandbox
from grpo.rewards.strict import checks_of
from grpo.run.outputs import RunOutputsError, run_config, run_of_weights, version_folder
from grpo.run.preflight import named_code_problems
from grpo.sampler.episodes import TemplateRoleError
from grpo.sampler.evaluation import greedy_samples, summary
from grpo.sampler.rollout.hf_engine import HFEngine
from grpo.weights.folder import MANIFEST, WeightsError, load_into, verify


def load_evaluated_model(cfg: Config, weights: Path | None, device):
    """The base model, or the base model with published / PEFT weights applied."""
    base = load_model(cfg.model, device)
    if weights is None:
        return base.eval()
    if (weights / MANIFEST).is_file():  # a published version: verify, then load like the sampler does
        manifest = verify(weights)
        model = add_lora(base, cfg.lora, cfg.model.train_vision) if manifest["kind"] == "lora" else base
        load_into(model, weights, manifest)
        return model.eval()
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(weights)).eval()


def evaluate(cfg: Config, weights: Path | None, limit: int | None, batch_size: int, split: str) -> tuple[dict, list]:
    """The summary and the scored samples (grpo/sampler/evaluation.py: the same function as the
    evaluation during training)."""
    device = resolve_device(cfg.sampling.device)
    tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template_kwargs)
    model = load_evaluated_model(cfg, weights, device)
    problems, _ = load_split(evaluation_source(cfg.data), split)  # data.eval_path when set
    problems = problems[:limit] if limit else problems
    prompts, dropped = build_prompts(tokenizer, source_configs(cfg.data)[0], problems, **prompt_options(cfg.env),
                                     processor=load_processor(cfg.model, evaluation_source(cfg.data), tokenizer))
    engine = HFEngine(model, tokenizer, cfg.sampling)
    episodes = rollout_runner(cfg, tokenizer)  # episodes or agent sessions: greedy, judged by their last message
    # as in training
    sandbox = reward_sandbox(cfg.rewards)
    start = time.perf_counter()
    try:
        with tqdm(total=len(prompts), desc="evaluate", unit="problem", file=sys.stderr) as bar:
            samples = greedy_samples(engine, tokenizer, prompts, cfg.data.prefill, batch_size, progress=bar.update,
                                     checks=checks_of(cfg.rewards), episodes=episodes, call=sandbox)
    finally:
        if episodes is not None:
            episodes.close()
        if sandbox is not None:
            sandbox.close()
    result = {"model": cfg.model.name_or_path, "weights": str(weights) if weights else None, "split": split,
              "dropped_overlong": dropped, **summary(samples), "max_new_tokens": cfg.sampling.max_new_tokens,
              "seconds": round(time.perf_counter() - start, 1)}
    return result, samples


CHECKS = [named_code_problems]  # the rewards it scores with and the environment, imported at the start


def resolve_inputs(args, overrides: list[str]) -> tuple:
    """(config, weights folder or None, where the config came from), from --run / --weights / --config."""
    if args.run is not None:
        if args.weights is not None or args.config is not None:
            raise RunOutputsError("--run evaluates a run with its own config and weights: "
                                  "leave out --weights and --config")
        return (run_config(args.run, overrides, CHECKS), version_folder(args.run, args.version),
                str(RunFolder(args.run).config))
    if args.version is not None:
        raise RunOutputsError("--version picks a version of a run: use it with --run runs/<name>")
    if args.weights is not None and not args.weights.exists():
        raise RunOutputsError(f"--weights {args.weights} does not exist")
    run = run_of_weights(args.weights) if args.weights is not None and args.config is None else None
    if run is not None:  # a run's weights folder (its LATEST) or one of its versions, as that run was trained
        weights = args.weights if (args.weights / MANIFEST).is_file() else version_folder(args.weights)
        return run_config(run, overrides, CHECKS), weights, str(RunFolder(run).config)
    path = args.config or "config.yaml"
    source = path if Path(path).is_file() or args.config else "built-in defaults"
    return parse_cli(["--config", path, *overrides], checks=CHECKS), args.weights, source


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="run folder (runs/<name>): its config and its published weights")
    parser.add_argument("--version", type=int, help="with --run: the published version (default: weights/LATEST)")
    parser.add_argument("--config", help="config file (default config.yaml; with --weights inside a run: that run's)")
    parser.add_argument("--weights", type=Path, help="published version folder or PEFT adapter folder")
    parser.add_argument("--limit", type=int, help="first N test problems")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--split", default="test")
    parser.add_argument("--out", type=Path, help="JSON summary path (samples go next to it as .samples.jsonl)")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg, weights, config_source = resolve_inputs(args, overrides)
        torch.manual_seed(cfg.seed)
        summary, samples = evaluate(cfg, weights, args.limit, args.batch_size, args.split)
    except (RunOutputsError, ConfigError, WeightsError, SourceError, TemplateRoleError, IsolationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = json.dumps({**summary, "config": config_source}, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        args.out.with_suffix(".samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
