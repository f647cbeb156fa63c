"""Export a run's published version as a folder to load with transformers / PEFT or upload to the Hub.

    grpo export runs/<name> [--version N] --out DIR [--merge [--dtype D]] [--force]

LoRA runs: the PEFT adapter (adapter_config.json's base_model_name_or_path set to a base a user can
load: a Hub id, the embedded model's public Hub id, or a local folder), or with --merge the base model
with the adapter merged in by PEFT's merge_and_unload(). Full fine-tunes: the model folder as
published. Every export also holds the tokenizer with its chat template, a README.md model card
(training settings, the last evaluation, the prompt format, how to load and upload it; for a run
with env.tools, how to offer the tools and read the model's calls) and the resolved config as
training_config.yaml.

The version's checksums are verified first. DIR must be new or empty unless --force, which moves
its contents aside to DIR.replaced-<date> (nothing is deleted). --merge merges in float32 and
saves in --dtype (float32 by default: in bfloat16 the rounding can undo small LoRA updates). The
export is written into a temporary folder beside DIR and renamed at the end; its files are mode
0644 and its folders 0755 (readable by all, whatever wrote them).
"""

from __future__ import annotations

import argparse
import json
import os
import pprint
import shutil
import sys
import time
import uuid
from pathlib import Path

import yaml

from grpo.common.files import aside_name
from grpo.common.sources import EMBEDDED_MODELS, SourceError
from grpo.config import Config, ConfigError, to_dict
from grpo.data.images import has_images
from grpo.data.mixture import source_configs
from grpo.run.outputs import RunOutputsError, last_evaluation, run_config, version_folder, weights_root
from grpo.weights.folder import WeightsError, verify

TRAINING_CONFIG = "training_config.yaml"
FILE_MODE, FOLDER_MODE = 0o644, 0o755  # an export is meant to be shared: transformers writes its weights 0600


class ExportError(ValueError):
    """An --out folder this export may not write."""


def base_reference(model_cfg) -> tuple[str, bool]:
    """(what a user passes to from_pretrained for the base model, whether that is a Hub id): the embedded
    model's public Hub id (never this machine's cache folder), a local folder's absolute path, or the Hub id."""
    name = model_cfg.name_or_path
    if name in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[name][2], True
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser().resolve()), False
    return name, True


def check_out(out: Path, run_dir: Path, force: bool) -> None:
    """Refuse an --out that is a file, holds the run, or is not empty (unless --force)."""
    target, run = out.resolve(), run_dir.resolve()
    if target == run or target in run.parents or weights_root(run).resolve() in [target, *target.parents]:
        raise ExportError(f"--out {out} is the run folder, holds it, or lies in its weights; choose another folder")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; choose a folder")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries and not force:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ExportError(f"--out {out} is not empty ({shown}); choose a new folder, or --force to replace it "
                          "(an earlier export is replaced, anything else is moved aside to "
                          f"{out.name}.replaced-<date>)")


def write_lora(tmp: Path, folder: Path, cfg: Config, merge: bool, dtype: str = "float32") -> str:
    """The adapter as published, pointed at a loadable base; or (merge) the merged full model: merged
    in float32 (a bfloat16 weight would round away most of a small LoRA update), saved in `dtype`."""
    if not merge:
        base_path, _ = base_reference(cfg.model)
        shutil.copyfile(folder / "adapter_model.safetensors", tmp / "adapter_model.safetensors")  # bytes as verified
        adapter_config = json.loads((folder / "adapter_config.json").read_text())
        adapter_config["base_model_name_or_path"] = base_path
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
        return "peft"
    from peft import PeftModel

    from grpo.common.model_files import DTYPES, resolve_model_path
    from grpo.model.loading import model_class

    path = resolve_model_path(cfg.model.name_or_path, cfg.model.cache_dir)
    base = model_class(path, cfg.model).from_pretrained(path, dtype=DTYPES["float32"],
                                                        trust_remote_code=cfg.model.trust_remote_code)
    merged = PeftModel.from_pretrained(base, str(folder)).merge_and_unload().to(DTYPES[dtype])
    merged.save_pretrained(tmp, safe_serialization=True)  # also generation_config
    return "transformers"


def write_full(tmp: Path, folder: Path, cfg: Config) -> str:
    """A full fine-tune's version (model, config, generation_config) saved again in transformers' Hub format: the
    HF engine's versions carry the model's own names (an MoE's experts fused, a vision-language model's modules
    renamed), which older transformers and other tools do not read."""
    from grpo.model.loading import model_class

    model = model_class(folder, cfg.model).from_pretrained(folder, dtype="auto",
                                                           trust_remote_code=cfg.model.trust_remote_code)
    if getattr(model, "_weight_conversions", None) == []:  # read under its own names: save with the class's renames
        model._weight_conversions = None  # (transformers reverts the renames it read with, here none)
    model.save_pretrained(tmp, safe_serialization=True)
    return "transformers"


def base_paragraph(cfg: Config, library: str) -> str:
    """Which base model the export came from, and where adapter_config.json points."""
    base, is_hub = base_reference(cfg.model)
    name = cfg.model.name_or_path
    if name in EMBEDDED_MODELS:
        package, gguf, _ = EMBEDDED_MODELS[name]
        text = (f"Base model: `{base}` (Hugging Face Hub). It was trained on the project's embedded copy "
                f"(`{name}`: the GGUF file {gguf} of the {package.replace('_', '-')} package, dequantised), whose "
                "weights differ from the Hub's by the 4-bit rounding")
        if library == "peft":
            return text + ("; on the Hub weights the adapter can answer slightly differently than in training "
                           "(grpo.model.loading.convert_embedded rebuilds the copy it was trained on).")
        return text + "; this folder holds that copy with the adapter merged in."
    if is_hub:
        return f"Base model: `{name}` (Hugging Face Hub)."
    text = f"Base model: the local folder `{base}`"
    if library == "peft":
        text += "; adapter_config.json's base_model_name_or_path points there (elsewhere, point it at your copy)"
    return text + "."


def lora_summary(lora) -> str:
    """The adapter's settings in a line: rank, alpha, its modules and what else it trains."""
    from grpo.model.loading import target_modules_of

    targets = target_modules_of(lora)
    extras = [name for name, on in (("rsLoRA", lora.use_rslora), ("DoRA", lora.use_dora)) if on]
    extras += [f"{', '.join(lora.modules_to_save)} trained whole"] if lora.modules_to_save else []
    return (f"r {lora.r}, alpha {lora.alpha}, on {targets if isinstance(targets, str) else ', '.join(targets)}"
            + "".join(f", {extra}" for extra in extras))


def settings_table(cfg: Config, step: int) -> str:
    training, lora = cfg.training, cfg.lora
    rows = [("algorithm", "GSPO" if training.use_gspo else "GRPO"),
            ("learning rate", f"{training.learning_rate:g} ({training.lr_schedule})"),
            ("group size", cfg.sampling.group_size), ("prompts per step", cfg.sampling.prompts_per_step),
            ("steps", f"{training.steps} configured; this is step {step}"), ("KL beta", training.beta),
            ("rewards", ", ".join(f"{n} x {w:g}" for n, w in zip(cfg.rewards.names, cfg.rewards.weights))),
            ("data", f"{cfg.data.path} (split {cfg.data.split})"), ("dtype", cfg.model.dtype)]
    if lora.enabled:
        rows.append(("LoRA", lora_summary(lora)))
    if cfg.env.tools:
        rows.append(("tools", f"{', '.join(f'`{t}`' for t in cfg.env.tools)} (calls read by {cfg.env.tool_parser})"))
    return "\n".join(["| setting | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


# how each env.tool_parser's calls are read from the model's message (grpo/environments/tool_calls.py), in
# a few lines a user can paste: (how to decode the message, the lines that read its calls)
READ_CALLS = {
    "hermes": ("skip_special_tokens=False",  # the tags may be special tokens
               ['calls = [json.loads(call)',
                '         for call in re.findall(r"<tool_call>(.*?)</tool_call>", message, re.DOTALL)]']),
    "llama3_json": ("skip_special_tokens=True",  # <|python_tag|> and the turn's end dropped
                    ['calls = [json.loads(part) for part in message.split(";") if part.strip().startswith("{")]']),
}


def usage_code(cfg: Config, library: str) -> list[str]:
    """A Python snippet that loads the export and answers one question in the training prompt format;
    for a tool run, offering the tools as training did and reading the calls as env.tool_parser does."""
    images = any(has_images(source) for source in source_configs(cfg.data))  # a vision-language model
    auto = "AutoModelForImageTextToText" if images else "AutoModelForCausalLM"
    load = ([f'base = {auto}.from_pretrained("{base_reference(cfg.model)[0]}")',
             'model = PeftModel.from_pretrained(base, "DIR")'] if library == "peft"
            else [f'model = {auto}.from_pretrained("DIR")'])
    tools, decode = bool(cfg.env.tools), "skip_special_tokens=True"
    offered, read = [], []
    if tools:
        from grpo.environments.tools import tool_schemas

        decode, read_lines = READ_CALLS[cfg.env.tool_parser]
        try:
            schemas = pprint.pformat(tool_schemas(list(cfg.env.tools)), width=100, sort_dicts=False).splitlines()
            offered = [f"# the tools it was trained with (env.tools: {', '.join(cfg.env.tools)}), as JSON schemas",
                       f"tools = {schemas[0]}", *(f"        {line}" for line in schemas[1:])]
        except (ValueError, ImportError) as e:  # exported where the tools' code is not: named, not described
            offered = [f"# the tools it was trained with (env.tools: {', '.join(cfg.env.tools)}); their JSON schemas "
                       f"could not be made here ({str(e)[:100]}): build them with "
                       "transformers.utils.get_json_schema(function)", "tools = [...]"]
        read = [f"# its tool calls, read as in training (env.tool_parser={cfg.env.tool_parser}; vLLM: "
                f"--tool-call-parser {cfg.env.tool_parser})", *read_lines, "print(calls)"]
    return ["```python", *(["import json", "import re", ""] if tools else []),
            f"from transformers import {auto}, AutoTokenizer",
            *(["from peft import PeftModel"] if library == "peft" else []), "",
            'tokenizer = AutoTokenizer.from_pretrained("DIR")', *load, *offered,
            f'messages = [{{"role": "system", "content": {json.dumps(cfg.data.system_prompt)}}},',
            '            {"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. '
            'How many in all?"}]',
            f"text = tokenizer.apply_chat_template(messages, {'tools=tools, ' if tools else ''}tokenize=False, "
            f"add_generation_prompt=True{template_kwargs(cfg.data.chat_template_kwargs)}) + "
            f"{json.dumps(cfg.data.prefill)}",
            'ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)',
            "out = model.generate(**ids, max_new_tokens=256, do_sample=False)",
            f"message = tokenizer.decode(out[0, ids.input_ids.shape[1]:], {decode})", "print(message)", *read,
            "```"]


def template_kwargs(kwargs: dict) -> str:
    """data.chat_template_kwargs as the snippet's keyword arguments (", enable_thinking=False")."""
    return "".join(f", {key}={value!r}" for key, value in kwargs.items())


def tools_text(cfg: Config) -> list[str]:
    """For a tool run: the loop around the snippet, and serving it with vLLM."""
    if not cfg.env.tools:
        return []
    return ["Run each call's function with its arguments, then append the model's message "
            '(`{"role": "assistant", "content": message}`) and one `{"role": "tool", "content": result}` message '
            "per call, and generate again: the chat template renders them as in training. A message without a call "
            f"is the answer (at most {cfg.env.max_turns} messages an episode in training). Served by vLLM: "
            f"`vllm serve DIR --enable-auto-tool-choice --tool-call-parser {cfg.env.tool_parser}`, with the "
            "same `tools` in each request.", ""]


def model_card(cfg: Config, run_dir: Path, manifest: dict, library: str) -> str:
    """README.md: front matter for the Hub, what was trained how, its evaluation, how to use it."""
    base, is_hub = base_reference(cfg.model)
    front = {**({"base_model": base} if is_hub else {}), "library_name": library,
             "tags": ["grpo", "reinforcement-learning"]}
    kind = ("a fully fine-tuned model" if manifest["kind"] != "lora" else "a LoRA adapter" if library == "peft"
            else "a LoRA adapter merged into its base model")
    algorithm = "GSPO" if cfg.training.use_gspo else "GRPO"
    return "\n".join([
        "---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
        f"# {cfg.run.name}: version {manifest['version']} (step {manifest['step']})", "",
        f"This is {kind} trained with {algorithm} (reinforcement learning from rewards) in the run "
        f"`{cfg.run.name}`. {base_paragraph(cfg, library)}", "",
        "## Training", "", settings_table(cfg, manifest["step"]), "",
        "The whole resolved config is in training_config.yaml.", "",
        "## Evaluation", "", evaluation_text(run_dir, manifest["step"]), "",
        "## Prompt format", "",
        f"Training prompts were the tokenizer's chat template (in this folder) over a system turn, "
        f"{cfg.data.few_shot} solved train problems as earlier chat turns (data.few_shot), and the question; the "
        f"assistant turn was opened with the prefill {json.dumps(cfg.data.prefill)}. System prompt:", "",
        "```text", cfg.data.system_prompt, "```", "",
        "## Use", "", *usage_code(cfg, library), "", *tools_text(cfg),
        "DIR is this folder (or its Hub repo id once uploaded).", "",
        "## Upload", "", "```bash", "hf upload <user>/<repo> DIR", "```", "",
        'or `HfApi().upload_folder(folder_path="DIR", repo_id="<user>/<repo>", repo_type="model")` '
        "(huggingface_hub).", ""])


def evaluation_text(run_dir: Path, step: int) -> str:
    """The exported step's evaluation, else the last one, from metrics.jsonl."""
    row = last_evaluation(run_dir, step) or last_evaluation(run_dir)
    if row is None:
        return ("metrics.jsonl holds no evaluation (eval.every=0); measure it with "
                f"`grpo evaluate --run {run_dir}`.")
    note = "" if row.get("step") == step else f" (the last evaluation; the exported version is step {step})"
    count = f"{int(row['eval/problems'])} " if "eval/problems" in row else ""
    return (f"Greedy answers to {count}held-out problems at step {row.get('step')}{note}: "
            f"answer accuracy {row['eval/answer_accuracy']:.4f} ± {row.get('eval/answer_accuracy_stderr', 0.0):.4f} "
            f"(standard error), exact-format rate {row.get('eval/format_rate', 0.0):.4f}.")


def save_image_processor(model_cfg, tmp: Path) -> None:
    """A vision-language model's image processor (preprocessor_config.json) beside the weights, as it was read."""
    from grpo.common.model_files import resolve_model_path

    path = Path(resolve_model_path(model_cfg.name_or_path, model_cfg.cache_dir))
    if (path / "preprocessor_config.json").is_file():
        from transformers import AutoImageProcessor

        AutoImageProcessor.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code).save_pretrained(tmp)


def save_tokenizer(model_cfg, tmp: Path) -> None:
    """The training tokenizer's files and chat template, less the offline-loading flags transformers
    records in tokenizer_config.json (they describe this machine, not the tokenizer)."""
    from grpo.model.loading import load_tokenizer

    load_tokenizer(model_cfg).save_pretrained(tmp)
    save_image_processor(model_cfg, tmp)
    path = tmp / "tokenizer_config.json"
    if path.is_file():
        settings = json.loads(path.read_text())
        for key in ("is_local", "local_files_only"):
            settings.pop(key, None)
        path.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


def training_config_yaml(cfg: Config) -> str:
    """The resolved config, without the transport secret (the folder is meant to be shared)."""
    tree = to_dict(cfg)
    if tree["transport"].get("secret"):
        tree["transport"]["secret"] = "<removed by export>"
    return yaml.safe_dump(tree, sort_keys=False)


def share_modes(folder: Path) -> None:
    """Every file FILE_MODE, every folder FOLDER_MODE (the folder itself included)."""
    for path in [folder, *folder.rglob("*")]:
        path.chmod(FOLDER_MODE if path.is_dir() else FILE_MODE)


def install(tmp: Path, out: Path) -> Path | None:
    """Rename the finished export into place; returns where a non-empty --out was moved (nothing
    is deleted: an earlier export may hold files of the user's, e.g. a Hub repo's .git)."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    aside = aside_name(out, time.strftime("%Y%m%d-%H%M%S")) if out.exists() else None
    if aside is not None:
        os.rename(out, aside)
    os.rename(tmp, out)
    return aside


def export(run_dir: Path, version: int | None, out: Path, merge: bool = False, force: bool = False,
           dtype: str = "float32") -> dict:
    """Write the export; returns what was written (version, step, kind, library, moved_aside)."""
    cfg = run_config(run_dir)
    folder = version_folder(run_dir, version)
    check_out(out, run_dir, force)
    manifest = verify(folder)  # checksums before anything is read
    tmp = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:8]}"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.mkdir()
        library = write_lora(tmp, folder, cfg, merge, dtype) if manifest["kind"] == "lora" \
            else write_full(tmp, folder, cfg)
        save_tokenizer(cfg.model, tmp)
        (tmp / TRAINING_CONFIG).write_text(training_config_yaml(cfg))
        (tmp / "README.md").write_text(model_card(cfg, run_dir, manifest, library))
        share_modes(tmp)
        aside = install(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"version": manifest["version"], "step": manifest["step"], "kind": manifest["kind"], "library": library,
            "moved_aside": str(aside) if aside else None}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="run folder (runs/<name>)")
    parser.add_argument("--version", type=int, help="published version to export (default: weights/LATEST)")
    parser.add_argument("--out", type=Path, required=True, help="folder to write (new or empty, unless --force)")
    parser.add_argument("--merge", action="store_true", help="LoRA: merge the adapter into the base model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="--merge: the merged model's dtype (merged in float32 either way; in bfloat16 the "
                             "rounding can undo small LoRA updates)")
    parser.add_argument("--force", action="store_true", help="write into a non-empty --out: its contents are moved "
                                                            "aside to DIR.replaced-<date> first")
    args = parser.parse_args(argv)
    try:
        result = export(args.run, args.version, args.out, args.merge, args.force, args.dtype)
    except (RunOutputsError, ExportError, ConfigError, WeightsError, SourceError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if result["moved_aside"]:
        print(f"moved the earlier contents of {args.out} aside to {result['moved_aside']}", file=sys.stderr)
    print(f"exported {args.run} v{result['version']} (step {result['step']}, {result['kind']}) to {args.out} "
          f"as a {result['library']} folder")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
