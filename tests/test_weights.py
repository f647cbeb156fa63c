"""Publishing and hot-swapping weights: atomic versions, checksums, the watcher keeps serving."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import REPO, tiny_model

from grpo.config import LoraConfig
from grpo.model.loading import add_lora
from grpo.settings.tree import get_key
from grpo.weights.folder import (
    DIGESTS,
    INITIAL_DIGEST,
    LATEST,
    MANIFEST,
    Staged,
    WeightsDiverged,
    WeightsError,
    WeightWatcher,
    publish,
    published_digests,
    published_versions,
    read_latest,
    stager_for_model,
    verify,
    version_dir,
)
from grpo.wire.behaviour import BEHAVIOUR_KEYS, BehaviourMismatch, check_weights_digest


def lora_model(seed=0, r=4):
    model = add_lora(tiny_model("llama"), LoraConfig(r=r, alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(p, std=0.2)
    return model


def lora_state(model):
    return {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}


def test_publish_writes_an_adapter_only_version_with_a_manifest_and_latest(tmp_path):
    folder = publish(lora_model(), tmp_path, version=1, step=1)
    assert folder == version_dir(tmp_path, 1) and read_latest(tmp_path) == 1
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["README.md", "adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    manifest = verify(folder)
    assert (manifest["version"], manifest["step"], manifest["kind"]) == (1, 1, "lora")
    assert os.path.getsize(folder / "adapter_model.safetensors") < 100_000  # the adapter, not the model
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_published_adapter_loads_with_peft_as_it_is(tmp_path):
    from peft import PeftModel

    model = lora_model()
    folder = publish(model, tmp_path, version=1, step=1)
    loaded = PeftModel.from_pretrained(tiny_model("llama"), folder)
    ids = torch.randint(3, 100, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_full_model_versions_hold_the_whole_model(tmp_path):
    model = tiny_model("qwen2")
    folder = publish(model, tmp_path, version=3, step=3)
    assert verify(folder)["kind"] == "full" and (folder / "model.safetensors").is_file()
    target = tiny_model("qwen2", seed=1)
    watcher = WeightWatcher(tmp_path, [stager_for_model(target)])
    assert watcher.poll().loaded and watcher.version == 3
    for (name, a), b in zip(target.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


def test_an_moe_full_fine_tune_loads_into_the_hf_engines_model_and_carries_hub_names_for_vllm(tmp_path):
    """transformers holds an MoE's experts as one tensor a layer and writes them to the Hub one per expert: the HF
    engine's copy takes the model's own names; a run on vLLM publishes the Hub's, which vLLM reads and which a
    transformers copy reads through from_pretrained's renaming; an export is in the Hub's names either way."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from grpo.config import load_config
    from grpo.weights.folder import load_into, publisher

    config = Qwen3MoeConfig(vocab_size=101, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                            num_experts_per_tok=2, head_dim=8)
    torch.manual_seed(0)
    trained, served = Qwen3MoeForCausalLM(config), Qwen3MoeForCausalLM(config)
    folder = publish(trained, tmp_path / "hf", version=1, step=1)
    load_into(served, folder, verify(folder))
    assert all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(), served.state_dict().values()))
    from grpo.commands.export import write_full

    def per_expert(folder) -> bool:
        with safe_open(folder / "model.safetensors", "pt") as f:
            return any(".experts.0." in key for key in f.keys())

    for engine in ("hf", "vllm"):
        cfg = load_config(None, [f"sampling.engine={engine}", f"weights.dir={tmp_path / engine}"])
        folder = publisher(cfg).publish(trained, 2, 2)
        assert per_expert(folder) == (engine == "vllm")
        (tmp_path / f"export-{engine}").mkdir()
        write_full(tmp_path / f"export-{engine}", folder, cfg)
        assert per_expert(tmp_path / f"export-{engine}")
        again = AutoModelForCausalLM.from_pretrained(folder)  # either way
        assert all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(), again.state_dict().values()))
        copy = Qwen3MoeForCausalLM(config)  # a vLLM sampler's transformers copy, and grpo evaluate, read it too
        load_into(copy, folder, verify(folder))
        assert all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(), copy.state_dict().values()))


def test_keep_last_prunes_old_versions_but_never_latest(tmp_path):
    model = lora_model()
    for v in range(1, 6):
        publish(model, tmp_path, version=v, step=v, keep_last=2)
    assert sorted(published_versions(tmp_path)) == [4, 5]


def test_watcher_loads_a_new_version_into_the_live_model(tmp_path):
    trained, live = lora_model(seed=1), lora_model(seed=2)
    watcher = WeightWatcher(tmp_path, [stager_for_model(live)])
    assert watcher.poll() is None and watcher.version == 0  # nothing published yet
    publish(trained, tmp_path, version=1, step=1)
    result = watcher.poll()
    assert result.loaded and watcher.version == 1
    for k, v in lora_state(trained).items():
        assert torch.equal(lora_state(live)[k], v)
    assert watcher.poll() is None  # nothing newer


def test_an_evaluation_mark_is_served_on_the_way_to_latest_so_eval_every_1_sees_every_version(tmp_path):
    """Versions 1..3 published while the sampler evaluated: preferring the next mark (2), the
    watcher loads v2, not LATEST (v3); then v3. Without a preference, or with a mark not yet
    published, it loads LATEST as before."""
    models = {v: lora_model(seed=10 + v) for v in (1, 2, 3)}
    live = lora_model(seed=2)
    watcher = WeightWatcher(tmp_path, [stager_for_model(live)])
    for v, model in models.items():
        publish(model, tmp_path, version=v, step=v)
    watcher.version = 1
    assert watcher.poll(prefer=2).version == 2 and watcher.version == 2
    assert all(torch.equal(lora_state(live)[k], v) for k, v in lora_state(models[2]).items())
    assert watcher.poll(prefer=3).version == 3
    watcher.version = 1
    assert watcher.poll(prefer=5).version == 3  # the mark is not published yet: LATEST
    watcher.version = 1
    assert watcher.poll().version == 3
    watcher.version = 1  # a mark that cannot be loaded does not hold the sampler back: on to LATEST
    (version_dir(tmp_path, 2) / "adapter_model.safetensors").write_bytes(b"damaged")
    assert not watcher.poll(prefer=2).loaded and watcher.version == 1
    assert watcher.poll(prefer=2).version == 3


def test_a_version_one_copy_refuses_is_served_by_neither(tmp_path):
    """The scoring copy and an engine's own copy take a version together. Here the first copy (rank
    8) could take the published rank-8 adapter and the second (rank 4) cannot, so neither does:
    before staging, the first served v1 while the second kept v0."""
    first, second = lora_model(seed=5, r=8), lora_model(seed=6)
    before = lora_state(first)
    publish(lora_model(seed=1, r=8), tmp_path, version=1, step=1)
    events = []

    def recorded(folder, manifest, version):
        events.append("staged")
        return Staged(lambda: events.append("committed"), discard=lambda: events.append("discarded"))
    watcher = WeightWatcher(tmp_path, [recorded, stager_for_model(first), stager_for_model(second)])
    result = watcher.poll()
    assert not result.loaded and watcher.version == 0 and "weights do not fit the model" in result.error
    assert events == ["staged", "discarded"]
    assert all(torch.equal(lora_state(first)[k], v) for k, v in before.items())
    assert WeightWatcher(tmp_path, [stager_for_model(first)]).poll().loaded  # the first copy alone takes it
    assert not all(torch.equal(lora_state(first)[k], v) for k, v in before.items())


def test_a_commit_that_fails_after_another_copy_took_the_version_stops_the_sampler(tmp_path):
    live = lora_model(seed=5)
    publish(lora_model(seed=1), tmp_path, version=1, step=1)

    def breaks_at_commit(folder, manifest, version):
        def commit():
            raise RuntimeError("engine died mid-reload")
        return Staged(commit)
    watcher = WeightWatcher(tmp_path, [stager_for_model(live), breaks_at_commit])
    with pytest.raises(WeightsDiverged, match="serving weights v1 from .* failed in copy 2 of 2 after the others "
                                              r"took it \(engine died mid-reload\); the sampler stops"):
        watcher.poll()


def test_each_publish_records_its_manifest_digest_and_only_recorded_digests_pass(tmp_path):
    """The digest a batch names (what `verify` read) is the sha256 of manifest.json; the trainer
    accepts a version's digest only if it recorded it, both copies of a version re-published after
    a restart, and version 0 only as the initial weights."""
    import hashlib

    first = publish(lora_model(seed=1), tmp_path, version=1, step=1)
    digest = verify(first)["digest"]
    assert digest == hashlib.sha256((first / MANIFEST).read_bytes()).hexdigest()
    publish(lora_model(seed=2), tmp_path, version=1, step=1)  # a restarted trainer's other v1
    again = verify(version_dir(tmp_path, 1))["digest"]
    assert published_digests(tmp_path) == {1: {digest, again}} and digest != again
    foreign = tmp_path / "other-run"
    stranger = verify(publish(lora_model(seed=3), foreign, version=1, step=1))["digest"]
    with open(tmp_path / DIGESTS, "a") as f:
        f.write('{"version": 2, "dig')  # a line cut short by a crash is skipped
    for ok in (digest, again):
        check_weights_digest(1, ok, published_digests(tmp_path), sampler=0, step=4)
    check_weights_digest(0, INITIAL_DIGEST, {}, sampler=0, step=0)
    with pytest.raises(BehaviourMismatch, match=f"sampler 1 step 4 was sampled with weights v1 whose manifest "
                                                f"sha256 is {stranger[:16]}, but this trainer published v1 as "):
        check_weights_digest(1, stranger, published_digests(tmp_path), sampler=1, step=4)
    with pytest.raises(BehaviourMismatch, match="published v2 as nothing"):
        check_weights_digest(2, digest, published_digests(tmp_path), sampler=0, step=4)
    with pytest.raises(BehaviourMismatch, match="published v0 as initial"):
        check_weights_digest(0, digest, published_digests(tmp_path), sampler=0, step=0)


def test_sampler_never_loads_half_written_or_corrupted_weights(tmp_path, caplog):
    live = lora_model(seed=2)
    watcher = WeightWatcher(tmp_path, [stager_for_model(live)])
    publish(lora_model(seed=1), tmp_path, version=1, step=1)
    watcher.poll()
    serving = lora_state(live)

    # a half-written version: the folder exists, LATEST points at it, but no manifest
    half = version_dir(tmp_path, 2)
    half.mkdir()
    (half / "adapter_model.safetensors").write_bytes(b"partial")
    (tmp_path / LATEST).write_text("2")
    result = watcher.poll()
    assert not result.loaded and "unreadable manifest" in result.error
    # a corrupted file: checksum mismatch
    publish(lora_model(seed=3), tmp_path, version=3, step=3)
    path = version_dir(tmp_path, 3) / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    result = watcher.poll()
    assert not result.loaded and "checksum mismatch" in result.error
    # an adapter for another model shape
    publish(add_lora(tiny_model("llama"), LoraConfig(r=8, alpha=8, target_modules=["q_proj", "v_proj"])),
            tmp_path, version=4, step=4)
    result = watcher.poll()
    assert not result.loaded and "do not fit the model" in result.error

    assert watcher.version == 1 and watcher.failures == 3
    assert all(torch.equal(lora_state(live)[k], v) for k, v in serving.items())  # untouched
    assert "refused weights v3" in caplog.text and "still serving v1" in caplog.text
    publish(lora_model(seed=5), tmp_path, version=5, step=5)  # a good later version is taken
    assert watcher.poll().loaded and watcher.version == 5


def test_verify_names_what_is_wrong(tmp_path):
    folder = publish(lora_model(), tmp_path, version=1, step=1)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["../escape"] = "0" * 64
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(WeightsError, match="file '../escape' is missing"):
        verify(folder)
    (tmp_path / LATEST).write_text("twelve")
    with pytest.raises(WeightsError, match="holds 'twelve', not a version number"):
        read_latest(tmp_path)


CRASH_MID_PUBLISH = """
import os, signal, sys
import torch
sys.path[:0] = [{repo!r}, {tests!r}]
import grpo.weights.folder as weights
from test_weights import lora_model

save = weights.save_weights
def save_then_die(model, folder, hub_names):
    kind = save(model, folder, hub_names)  # every file written, nothing renamed into place yet
    os.kill(os.getpid(), signal.SIGKILL)
weights.save_weights = save_then_die
weights.publish(lora_model(seed=2), {root!r}, version=2, step=2)
"""


def test_a_publisher_killed_mid_write_leaves_no_visible_version(tmp_path):
    publish(lora_model(seed=1), tmp_path, version=1, step=1)
    model = lora_model(seed=9)
    watcher = WeightWatcher(tmp_path, [stager_for_model(model)])
    assert watcher.poll().loaded and watcher.version == 1
    code = subprocess.run([sys.executable, "-c", CRASH_MID_PUBLISH.format(
        repo=str(REPO), tests=str(REPO / "tests"), root=str(tmp_path))], timeout=120).returncode
    assert code == -signal.SIGKILL
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-v000002")]  # the half-done write
    assert read_latest(tmp_path) == 1 and published_versions(tmp_path) == [1]
    assert watcher.poll() is None and watcher.version == 1 and watcher.failures == 0  # nothing to see
    publish(lora_model(seed=2), tmp_path, version=2, step=2)  # the restarted trainer publishes again
    assert watcher.poll().loaded and watcher.version == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # and the leftover is gone


def test_a_sampler_with_another_lora_alpha_is_named_before_its_batch_is_trained():
    """The sampler's scoring copy scales a loaded adapter by its own lora.alpha / r: with another
    alpha it would sample and score a policy the trainer never had, and no shape check sees it."""
    from grpo.config import load_config
    from grpo.wire.behaviour import check_behaviour

    def settings(*overrides):
        cfg = load_config(None, list(overrides))
        return {key: get_key(cfg, key) for key in BEHAVIOUR_KEYS}
    check_behaviour(settings("lora.alpha=16"), settings("lora.alpha=16"), sampler=0, step=3)
    with pytest.raises(BehaviourMismatch, match=r"sampler 1 step 3 was made with other settings than this trainer's; "
                                                r"nothing was trained with it\. Start both with the same config: "
                                                r"lora\.alpha: the sampler used 16, this trainer has 32$"):
        check_behaviour(settings("lora.alpha=16"), settings(), sampler=1, step=3)
