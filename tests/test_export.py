"""grpo export and grpo/run/outputs.py on a run folder made without training (tiny random model)."""

import json
import shutil

import pytest
import torch
import yaml

from grpo.commands.export import export, main  # noqa: E402
from grpo.config import load_config, save_config, to_dict
from grpo.model.loading import add_lora, load_model, load_tokenizer
from grpo.run.outputs import RunOutputsError, last_evaluation, run_config, run_of_weights, version_folder
from grpo.weights.folder import load_into, publish, verify, version_dir

EVAL_ROW = {"step": 3, "eval/answer_accuracy": 0.25, "eval/answer_accuracy_stderr": 0.125, "eval/format_rate": 0.5,
            "eval/problems": 12.0}


def trained_adapter(cfg, seed):
    """A LoRA model whose adapter changes the outputs (lora_B starts at zero: a no-op)."""
    model = add_lora(load_model(cfg.model), cfg.lora).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    return model


def make_run(run, *overrides):
    cfg = load_config(None, [f"run.dir={run}", "run.name=tiny-export", "lora.r=4", "lora.alpha=8",
                             "transport.secret=not-for-the-hub", *overrides])
    save_config(cfg, run / "config.yaml")
    return cfg


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir):
    """runs/tiny-export: versions 3 and 4 of a LoRA adapter (LATEST 4), an evaluation at step 3."""
    run = tmp_path_factory.mktemp("runs") / "tiny-export"
    cfg = make_run(run, f"model.name_or_path={tiny_model_dir}")
    publish(trained_adapter(cfg, seed=1), run / "weights", version=3, step=3)
    publish(trained_adapter(cfg, seed=2), run / "weights", version=4, step=4)
    rows = [{"step": 0, **{k: 0.0 for k in EVAL_ROW if k != "step"}}, {"step": 3, "reward": 0.5}, EVAL_ROW,
            {"step": 4, "reward": 0.7}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "rew')
    return run, cfg


def sampler_model(cfg, folder):
    """The published version loaded the way the sampler loads it (verify, then into the live adapter)."""
    model = add_lora(load_model(cfg.model), cfg.lora).eval()
    load_into(model, folder, verify(folder))
    return model


def greedy(model, ids, tokens=8):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_a_run_folder_saved_with_keys_since_removed_still_reads(tmp_path):
    """A run saves every key of its day: keys removed since are dropped when its folder is read,
    while a user's own config with one is refused (tests/test_models.py)."""
    import yaml

    saved = to_dict(load_config(None, ["seed=3"]))
    saved["lora"]["dropout"], saved["launch"]["samplers"] = 0.0, 1
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    cfg = run_config(tmp_path)
    assert cfg.seed == 3 and not hasattr(cfg.lora, "dropout") and not hasattr(cfg.launch, "samplers")


def chat_ids(tokenizer, question):
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


def test_run_outputs_read_the_config_the_versions_and_the_last_evaluation(lora_run, tmp_path):
    run, cfg = lora_run
    assert to_dict(run_config(run)) == to_dict(cfg)
    assert run_config(run, ["sampling.max_new_tokens=7"]).sampling.max_new_tokens == 7
    assert version_folder(run) == version_dir(run / "weights", 4) == version_folder(run / "weights")
    assert version_folder(run, 3) == version_dir(run / "weights", 3)
    with pytest.raises(RunOutputsError, match=r"has no version 9 \(versions on disk: 3, 4;"):
        version_folder(run, 9)
    with pytest.raises(RunOutputsError, match=f"{tmp_path} is not a run folder: it has no config.yaml"):
        run_config(tmp_path)
    assert run_of_weights(version_dir(run / "weights", 3)) == run and run_of_weights(run / "weights") == run
    assert run_of_weights(tmp_path) is None and run_of_weights(run / "weights" / "v000009") is None
    assert last_evaluation(run) == EVAL_ROW and last_evaluation(run, step=0)["step"] == 0
    assert last_evaluation(run, step=4) is None and last_evaluation(tmp_path) is None


def test_adapter_export_gives_the_logits_of_the_published_version(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, cfg = lora_run
    result = export(run, 3, tmp_path / "adapter")
    assert (result["version"], result["step"], result["library"]) == (3, 3, "peft")
    out = tmp_path / "adapter"
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(cfg.model.name_or_path)  # an absolute folder
    assert (out / "adapter_model.safetensors").read_bytes() == \
        (version_dir(run / "weights", 3) / "adapter_model.safetensors").read_bytes()
    assert AutoTokenizer.from_pretrained(out).chat_template == load_tokenizer(cfg.model).chat_template
    exported = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(adapter_config["base_model_name_or_path"]), str(out)).eval()
    ids = torch.randint(3, 1000, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = sampler_model(cfg, version_dir(run / "weights", 3))(ids).logits, exported(ids).logits
        base = load_model(cfg.model)(ids).logits
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6)
    assert (ours - base).abs().max() > 1e-2  # the adapter is not a no-op
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_merged_export_generates_what_base_plus_adapter_generates(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, cfg = lora_run
    export(run, None, tmp_path / "adapter")
    assert export(run, None, tmp_path / "merged", merge=True)["library"] == "transformers"
    names = {p.name for p in (tmp_path / "merged").iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "README.md", "training_config.yaml"} <= names
    assert not names & {"adapter_config.json", "adapter_model.safetensors", "pytorch_model.bin"}
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert merged.dtype == torch.float32 and not any("lora" in k for k in merged.state_dict())
    base = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path).eval()
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path),
                                          str(tmp_path / "adapter")).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    changed = 0
    for question in ("What is 2 plus 3?", "Name a colour.", "Count to five."):
        ids = chat_ids(tokenizer, question)
        assert greedy(merged, ids) == greedy(reference, ids), question
        changed += greedy(merged, ids) != greedy(base, ids)
    assert changed > 0  # the merge carried the adapter


def test_a_bfloat16_merge_is_the_float32_merge_rounded_once(lora_run, tmp_path):
    """Merged in float32 and cast at the end: adding a small update to bfloat16 weights would round
    most of it away."""
    from transformers import AutoModelForCausalLM

    run, _ = lora_run
    export(run, None, tmp_path / "fp32", merge=True)
    export(run, None, tmp_path / "bf16", merge=True, dtype="bfloat16")
    full = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32").state_dict()
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16).state_dict()
    assert half.keys() == full.keys() and all(v.dtype == torch.bfloat16 for v in half.values())
    assert all(torch.equal(half[k], full[k].to(torch.bfloat16)) for k in full)


def test_model_card_names_the_version_the_evaluation_and_the_prompt(lora_run, tmp_path):
    run, cfg = lora_run
    export(run, 3, tmp_path / "v3")
    card = (tmp_path / "v3" / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front == {"library_name": "peft", "tags": ["grpo", "reinforcement-learning"]}  # a local base: no Hub id
    assert "# tiny-export: version 3 (step 3)" in card and "| algorithm | GRPO |" in card
    assert "Greedy answers to 12 held-out problems at step 3: answer accuracy 0.2500 ± 0.1250" in card
    assert "exact-format rate 0.5000" in card and "| LoRA | r 4, alpha 8," in card
    assert cfg.data.system_prompt in card and json.dumps(cfg.data.prefill) in card
    assert "PeftModel.from_pretrained(base" in card and "hf upload <user>/<repo> DIR" in card
    saved = yaml.safe_load((tmp_path / "v3" / "training_config.yaml").read_text())
    assert saved["transport"]["secret"] == "<removed by export>"
    saved["transport"]["secret"] = cfg.transport.secret
    assert saved == to_dict(cfg)
    export(run, 4, tmp_path / "v4")  # no evaluation at step 4: the last one, said so
    assert ("at step 3 (the last evaluation; the exported version is step 4)"
            in (tmp_path / "v4" / "README.md").read_text())


def test_a_non_empty_out_is_refused_and_force_moves_user_files_aside(lora_run, tmp_path, capsys):
    run, _ = lora_run
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main([str(run), "--out", str(out)]) == 2
    assert f"error: --out {out} is not empty (notes.txt)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "notes.txt").read_text() == "mine"
    assert main([str(run), "--out", str(out), "--force"]) == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("out.replaced-")]
    assert len(aside) == 1 and (aside[0] / "notes.txt").read_text() == "mine"
    assert (out / "adapter_model.safetensors").is_file()
    earlier = (out / "README.md").read_text()
    assert main([str(run), "--out", str(out), "--force", "--version", "3"]) == 0  # an earlier export: moved aside too
    asides = sorted(p for p in tmp_path.iterdir() if p.name.startswith("out.replaced-"))
    assert len(asides) == 2 and sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", *(p.name for p in asides)])
    assert sorted([(p / "README.md").read_text() if (p / "README.md").is_file() else (p / "notes.txt").read_text()
                   for p in asides]) == sorted([earlier, "mine"])
    assert "# tiny-export: version 3 (step 3)" in (out / "README.md").read_text()
    assert main([str(run), "--out", str(run / "weights")]) == 2
    assert main([str(run), "--out", str(run.parent)]) == 2
    assert capsys.readouterr().err.count("is the run folder, holds it, or lies in its weights; choose another") == 2


def test_a_corrupted_version_or_a_missing_one_is_refused(lora_run, tmp_path, capsys):
    run = tmp_path / "copy"
    shutil.copytree(lora_run[0], run)
    with open(version_dir(run / "weights", 4) / "adapter_model.safetensors", "r+b") as f:
        f.seek(-3, 2)
        byte = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([byte[0] ^ 1]))
    assert main([str(run), "--out", str(tmp_path / "out")]) == 2
    assert "adapter_model.safetensors: checksum mismatch" in capsys.readouterr().err
    assert main([str(run), "--version", "7", "--out", str(tmp_path / "out")]) == 2
    assert "has no version 7 (versions on disk: 3, 4;" in capsys.readouterr().err
    assert main([str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert f"error: {tmp_path} is not a run folder: it has no config.yaml" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]  # nothing written
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "--merge" in capsys.readouterr().out


def test_a_full_fine_tune_exports_its_model_folder_as_published(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "full"
    cfg = make_run(run, f"model.name_or_path={tiny_model_dir}", "lora.enabled=false", "training.reference_on=sampler")
    model = load_model(cfg.model)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.add_(1.0)
    folder = publish(model, run / "weights", version=2, step=2)
    assert export(run, None, tmp_path / "out", merge=True)["library"] == "transformers"
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for (name, a), b in zip(loaded.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    card = (tmp_path / "out" / "README.md").read_text()
    assert "library_name: transformers" in card and "a fully fine-tuned model" in card
    assert "metrics.jsonl holds no evaluation" in card


def modes(folder):
    """{path relative to folder ("." for itself): permission bits} of everything under folder."""
    return {str(p.relative_to(folder)): p.stat().st_mode & 0o777 for p in [folder, *folder.rglob("*")]}


def test_every_exported_file_is_0644_and_every_folder_0755(lora_run, tmp_path, tiny_model_dir):
    run, _ = lora_run
    export(run, None, tmp_path / "adapter")
    export(run, None, tmp_path / "merged", merge=True)  # transformers writes model.safetensors 0600
    full = tmp_path / "full"
    cfg = make_run(full, f"model.name_or_path={tiny_model_dir}", "lora.enabled=false", "training.reference_on=sampler")
    publish(load_model(cfg.model), full / "weights", version=1, step=1)
    export(full, None, tmp_path / "full-out")
    tokenizer = {"chat_template.jinja": 0o644, "tokenizer.json": 0o644, "tokenizer_config.json": 0o644}
    card = {"README.md": 0o644, "training_config.yaml": 0o644}
    assert modes(tmp_path / "adapter") == {".": 0o755, "adapter_config.json": 0o644,
                                           "adapter_model.safetensors": 0o644, **tokenizer, **card}
    model = {"config.json": 0o644, "generation_config.json": 0o644, "model.safetensors": 0o644}
    assert modes(tmp_path / "merged") == {".": 0o755, **model, **tokenizer, **card}
    assert modes(tmp_path / "full-out") == {".": 0o755, **model, **tokenizer, **card}


def test_an_export_of_the_embedded_model_names_its_public_base_not_a_cache_folder(tmp_path):
    from grpo.common.model_files import resolve_model_path

    run = tmp_path / "embedded"
    cfg = make_run(run, "model.name_or_path=smollm2-135m-instruct")
    publish(trained_adapter(cfg, seed=1), run / "weights", version=1, step=1)
    export(run, None, tmp_path / "out")
    out = tmp_path / "out"
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    card = (out / "README.md").read_text()
    assert yaml.safe_load(card.split("---\n")[1]) == {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                                      "library_name": "peft",
                                                      "tags": ["grpo", "reinforcement-learning"]}
    assert 'AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")' in card
    cache = resolve_model_path("smollm2-135m-instruct")
    assert [p.name for p in out.iterdir() if cache in p.read_bytes().decode("utf-8", "replace")] == []


@pytest.mark.parametrize("parser, message", [
    ("hermes", 'Half of 48:\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "48 / 2"}}\n</tool_call>'),
    ("llama3_json", '{"name": "calculate", "parameters": {"expression": "48 / 2"}}; '
                    '{"name": "calculate", "parameters": {"expression": "48 + 24"}}')])
def test_the_model_card_of_a_tool_run_offers_its_tools_and_reads_calls_as_training_did(tmp_path, tiny_model_dir,
                                                                                       parser, message):
    """The card's snippet, run as written on the export: the chat template is given the tools' schemas
    (the ones training offered), and its lines that read a message's calls read them as
    env.tool_parser does; the card names the parser and vLLM's --tool-call-parser."""
    import re

    from grpo.environments.tool_calls import PARSERS
    from grpo.environments.tools import tool_schemas

    tool = "grpo.environments.calculator:calculate"
    run = tmp_path / "tools"
    cfg = make_run(run, f"model.name_or_path={tiny_model_dir}", "model.chat_template=chatml-tools",
                   f"env.tools=[{tool}]", f"env.tool_parser={parser}", "data.few_shot=0")
    publish(trained_adapter(cfg, seed=1), run / "weights", version=1, step=1)
    export(run, None, tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"| tools | `{tool}` (calls read by {parser}) |" in card
    assert f"vllm serve DIR --enable-auto-tool-choice --tool-call-parser {parser}" in card
    code = re.search(r"## Use\n\n```python\n(.*?)```", card, re.DOTALL).group(1)
    assert "apply_chat_template(messages, tools=tools, tokenize=False" in code
    assert f"read as in training (env.tool_parser={parser}; vLLM: --tool-call-parser {parser})" in code
    ran = {}
    exec(code.replace('"DIR"', f'"{tmp_path / "out"}"').replace("max_new_tokens=256", "max_new_tokens=8"), ran)
    assert ran["tools"] == tool_schemas([tool])
    assert '"name": "calculate"' in ran["text"] and cfg.data.system_prompt in ran["text"]  # the template offered it
    reading = code[code.index("# its tool calls"):code.index("print(calls)")]
    read = {"message": message}
    exec(reading, {"json": json, "re": re}, read)
    expected = [{"name": c.name, ("arguments" if parser == "hermes" else "parameters"): c.arguments}
                for c in PARSERS[parser](message)]
    assert read["calls"] == expected and len(expected) == (1 if parser == "hermes" else 2)
