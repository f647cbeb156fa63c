"""A run folder's config across launches, and what a resume may change (grpo/run/history.py)."""

import threading
from pathlib import Path

import yaml

from grpo.config import all_keys, load_config, save_config
from grpo.run.history import (
    ALLOWED,
    LAUNCH_SET,
    REFUSED,
    SPOOLED,
    UNDECIDED,
    allowed_line,
    changed_settings,
    refused_changes,
    resume_changes,
    save_run_config,
    settings_a_resume_keeps,
)
from grpo.run.start import earlier_outputs, planned_start, prepare_run_folder, resume_source
from grpo.sampler.state import SamplerState, drop_a_start_made_otherwise
from grpo.wire.delivery import Spool


def config(run_dir: Path, *overrides: str):
    return load_config(None, [f"run.dir={run_dir}", "run.name=my-run", *overrides])


def checkpointed(run_dir: Path, tag: str = "step000002") -> Path:
    """A run folder with a whole checkpoint named `tag` (DeepSpeed's `latest`)."""
    (run_dir / "checkpoints" / tag).mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text(tag)
    return run_dir


def kept_configs(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.glob("config.*.yaml"))


# ----------------------------------------------------------------------------- the history

def test_each_launch_with_other_settings_keeps_the_config_before_it(tmp_path):
    run_dir = tmp_path / "my-run"
    run_dir.mkdir()
    first, second = config(run_dir, "lora.r=16"), config(run_dir, "lora.r=8", "training.learning_rate=1e-5")
    assert save_run_config(first) is None and kept_configs(run_dir) == []
    first_text = (run_dir / "config.yaml").read_text()

    assert save_run_config(second) == run_dir / "config.001.yaml"
    assert (run_dir / "config.001.yaml").read_text() == first_text
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (saved["lora"]["r"], saved["training"]["learning_rate"]) == (8, 1e-5)
    second_text = (run_dir / "config.yaml").read_text()

    assert save_run_config(config(run_dir, "lora.r=8", "training.learning_rate=1e-5")) is None  # equal: a no-op
    assert kept_configs(run_dir) == ["config.001.yaml"] and (run_dir / "config.yaml").read_text() == second_text

    # what every launch sets itself updates config.yaml without a copy
    relaunched = config(run_dir, "lora.r=8", "training.learning_rate=1e-5", "transport.address=tcp://127.0.0.1:6001")
    assert save_run_config(relaunched) is None and kept_configs(run_dir) == ["config.001.yaml"]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["transport"]["address"] == "tcp://127.0.0.1:6001"
    third_text = (run_dir / "config.yaml").read_text()

    assert save_run_config(first) == run_dir / "config.002.yaml"  # back to the first: kept in launch order
    assert [(run_dir / name).read_text() for name in kept_configs(run_dir)] == [first_text, third_text]
    assert (run_dir / "config.yaml").read_text() == first_text


def test_two_workers_writing_at_once_leave_whole_files_and_no_copy_of_an_equal_config(tmp_path):
    """The trainer and sampler 0 of one launch write the same config, maybe at the same moment:
    under the lock each sees the other's file whole, so the second write is a no-op."""
    run_dir = tmp_path / "my-run"
    run_dir.mkdir()
    save_run_config(config(run_dir, "lora.r=16"))
    same = [config(run_dir, "lora.r=8") for _ in range(8)]
    threads = [threading.Thread(target=save_run_config, args=(cfg,)) for cfg in same]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert kept_configs(run_dir) == ["config.001.yaml"]
    assert yaml.safe_load((run_dir / "config.001.yaml").read_text())["lora"]["r"] == 16
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["lora"]["r"] == 8
    # no temporary files
    assert sorted(p.name for p in run_dir.iterdir()) == [".config.lock", "config.001.yaml", "config.yaml"]


def test_changed_settings_pairs_old_and_new_values():
    old = {"lora.r": 16, "training.steps": 200, "seed": 0}
    new = {"lora.r": 8, "training.steps": 200, "seed": 0, "eval.every": 5}
    assert changed_settings(old, new) == {"lora.r": (16, 8), "eval.every": (None, 5)}
    assert changed_settings(new, new) == {}


# ----------------------------------------------------------------------------- what a resume may change

def test_a_resume_that_changes_what_its_checkpoint_depends_on_is_refused_naming_each_key(tmp_path):
    run_dir = checkpointed(tmp_path / "my-run")
    save_config(config(run_dir, "lora.r=16", "training.steps=200"), run_dir / "config.yaml")
    before = sorted(p.name for p in run_dir.rglob("*"))
    resumed = config(run_dir, "lora.r=8", "lora.target_modules=[q_proj,v_proj]", "training.steps=400")
    refusal, changed = resume_changes(resumed)
    assert changed is None
    assert refusal == (
        f"run folder {run_dir} (run.name=my-run) resumes from its checkpoint of step 2, which depends on settings "
        "this start changes: lora.r 16 -> 8 (the checkpoint's LoRA adapter), lora.target_modules "
        "[q_proj,k_proj,v_proj,o_proj] -> [q_proj,v_proj] (the checkpoint's LoRA adapter); nothing was changed. "
        "Run the same command with lora.r=16 lora.target_modules=[q_proj,k_proj,v_proj,o_proj], or start a new "
        "run: a new run.name, or checkpoint.resume=never run.overwrite=true to move this one aside")
    assert sorted(p.name for p in run_dir.rglob("*")) == before
    # the old values it names, given back, make a resume that passes
    assert resume_changes(config(run_dir, "lora.r=16", "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
                                 "training.steps=400"))[0] is None


def test_a_resume_that_changes_safe_settings_lists_them_in_one_line(tmp_path):
    run_dir = checkpointed(tmp_path / "my-run")
    save_config(config(run_dir, "training.steps=200"), run_dir / "config.yaml")
    resumed = config(run_dir, "training.steps=400", "training.learning_rate=1e-5", "sampling.group_size=16",
                     "transport.address=tcp://127.0.0.1:6001", f"checkpoint.resume={run_dir / 'checkpoints'}",
                     "transport.secret=s3cret")
    assert resume_changes(resumed) == (None, (
        "resuming with changed settings: sampling.group_size 8 -> 16, training.steps 200 -> 400, "
        "training.learning_rate 0.0002 -> 1e-05 (the schedule continues from where it stands, with the new peak), "
        "transport.secret null -> ***"))
    relaunched = config(run_dir, "training.steps=200", "transport.address=tcp://127.0.0.1:6002")
    assert resume_changes(relaunched) == (None, None)  # what every launch sets itself is not listed


def test_a_fresh_start_compares_nothing(tmp_path):
    run_dir = tmp_path / "my-run"
    run_dir.mkdir()
    save_config(config(run_dir, "lora.r=16"), run_dir / "config.yaml")
    assert resume_changes(config(run_dir, "lora.r=8")) == (None, None)  # no checkpoint
    checkpointed(run_dir)
    assert resume_changes(config(run_dir, "lora.r=8", "checkpoint.resume=never")) == (None, None)


def test_beta_may_change_unless_the_trainer_would_need_reference_log_probs_the_spooled_batches_lack():
    off = load_config(None, ["training.beta=0", "training.reference_on=sampler"])
    on = load_config(None, ["training.beta=0.04", "training.reference_on=sampler"])
    on_trainer = load_config(None, ["training.beta=0.04", "training.reference_on=trainer"])
    assert refused_changes({"training.beta": (0.0, 0.04)}, off, on) == {
        "training.beta": "batches spooled without reference log-probs cannot be trained with them"}
    assert refused_changes({"training.beta": (0.0, 0.04)}, off, on_trainer) == {}
    assert refused_changes({"training.beta": (0.04, 0.0)}, on, off) == {}
    assert refused_changes({"training.reference_on": ("trainer", "sampler")}, on_trainer, on) == {
        "training.reference_on": "batches spooled without reference log-probs cannot be trained with them"}


def test_with_the_kl_in_the_reward_beta_and_the_estimator_stay_as_the_spooled_batches_have_them():
    """The spooled batches' KL penalty column was made with them; the trainer would refuse it."""
    cfg = load_config(None, ["training.kl_in=reward", "training.kl_estimator=k1", "training.reference_on=sampler"])
    changes = {"training.beta": (0.04, 0.1), "training.kl_estimator": ("k1", "k3")}
    assert refused_changes(changes, cfg, cfg) == {key: SPOOLED for key in changes}
    assert refused_changes(changes, load_config(None, []), load_config(None, [])) == {}
    assert refused_changes({"training.kl_in": ("loss", "reward")}, load_config(None, []), cfg) == {
        "training.kl_in": SPOOLED}


def test_every_key_is_refused_allowed_or_set_by_each_launch():
    """A new key is refused on a resume until someone decides: this lists the ones nobody has."""
    cfg = load_config(None, [])
    changes = {key: (1, 2) for key in all_keys() if key not in LAUNCH_SET}
    undecided = [key for key, why in refused_changes(changes, cfg, cfg).items() if why == UNDECIDED]
    assert undecided == []
    assert refused_changes({"lora.r": (16, 8)}, cfg, cfg) == {"lora.r": "the checkpoint's LoRA adapter"}
    assert set(REFUSED) & set(ALLOWED) == set()
    assert allowed_line({"training.steps": (200, 400)}) == "resuming with changed settings: training.steps 200 -> 400"
    # a run's config.yaml holds the clip range its first start resolved: a switch of loss says so
    assert allowed_line({"training.loss": ("ppo_clip", "cispo")}) == (
        "resuming with changed settings: training.loss ppo_clip -> cispo (the clip range is training.clip_low/"
        "clip_high as this start has them: a loss's own defaults (cispo: 1, 4) apply only where they are unset, not "
        "over a run's config.yaml)")


# ----------------------------------------------------------------------------- a start that trained nothing

def untrained_leftovers(run_dir: Path) -> Path:
    """What a first start stopped before its first step leaves (an earlier version also saved a
    checkpoint of step 0 on SIGTERM)."""
    checkpointed(run_dir, "step000000")
    (run_dir / "checkpoints" / "step000000" / "mp_rank_00_model_states.pt").write_bytes(b"untrained")
    (run_dir / "checkpoints" / "zero_to_fp32.py").write_text("# DeepSpeed's script\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "eval/answer_accuracy": 0.1}\n')
    (run_dir / "trainer_state.json").write_text('{"step": 0, "next_steps": {}, "incarnation": "a", "updates": 0}')
    for name in ("config.yaml", "trainer.log", "sampler.log", "address"):
        (run_dir / name).write_text("x\n")
    (run_dir / "weights").mkdir()
    Spool.of_sampler(run_dir, 0).put(0, [b"a batch of the first start"])
    SamplerState.of_sampler(run_dir, 0).save(2, {"seed": 0, "size": 12, "epoch": 0, "index": 4})
    return run_dir


def test_what_a_start_that_trained_nothing_left_neither_blocks_nor_is_resumed(tmp_path):
    run_dir = untrained_leftovers(tmp_path / "my-run")
    cfg = config(run_dir, "lora.r=8")
    assert earlier_outputs(run_dir, run_dir / "weights") == []
    assert resume_source("auto", run_dir) is None
    assert planned_start(cfg)[0] == "fresh" and resume_changes(cfg) == (None, None)
    assert prepare_run_folder(cfg) is None
    moved = [p.name for p in run_dir.iterdir() if p.name.startswith("metrics.jsonl.replaced-")]
    assert len(moved) == 1 and not (run_dir / "metrics.jsonl").exists()  # this start evaluates its own start



def test_a_sampler_drops_what_a_start_with_other_settings_left_and_keeps_what_its_own_left(tmp_path):
    """Spooled batches of lora.r=16 would stop a lora.r=8 trainer (exit 7): dropped, the sampler
    starts at step 0. A start with the same settings (a sampler restarted before the first step
    was trained) keeps them: they are valid batches of this run."""
    run_dir = untrained_leftovers(tmp_path / "my-run")  # an earlier version's start: its settings unrecorded
    state, spool = SamplerState.of_sampler(run_dir, 0), Spool.of_sampler(run_dir, 0)
    first = settings_a_resume_keeps(config(run_dir, "lora.r=16"))
    retry = settings_a_resume_keeps(config(run_dir, "lora.r=8"))
    assert drop_a_start_made_otherwise(run_dir, 0, first) is True
    assert state.load() is None and spool.steps() == []

    spool.put(0, [b"a batch of lora.r=16"])
    state.save(1, {"seed": 0, "size": 12, "epoch": 0, "index": 2})
    assert drop_a_start_made_otherwise(run_dir, 0, first) is False  # restarted with the same settings
    assert state.load()["next_step"] == 1 and spool.steps() == [0]
    assert drop_a_start_made_otherwise(run_dir, 0, retry) is True
    assert state.load() is None and spool.steps() == []
    assert drop_a_start_made_otherwise(run_dir, 0, retry) is False  # nothing left to drop
    assert (first["lora.r"], retry["lora.r"]) == (16, 8) and "training.steps" not in first


def test_a_checkpoint_of_a_trained_step_still_counts(tmp_path):
    run_dir = untrained_leftovers(tmp_path / "my-run")
    (run_dir / "checkpoints" / "step000001").mkdir()
    (run_dir / "checkpoints" / "latest").write_text("step000001")
    assert earlier_outputs(run_dir, run_dir / "weights") == ["checkpoints"]
    assert resume_source("auto", run_dir) == run_dir / "checkpoints"
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "loss": 0.5}\n')
    assert earlier_outputs(run_dir, run_dir / "weights") == ["checkpoints", "metrics.jsonl (2 rows)"]


def test_the_reward_columns_and_weights_are_refused_on_a_resume_and_the_rest_of_rewards_is_not():
    """The trainer recomputes every batch's advantages with rewards.names, weights and the overlong
    penalty: a spooled batch scored with other ones would stop it. The judge, services, time limits may change."""
    cfg = load_config(None, [])
    spooled = "batches record it: the trainer would refuse those spooled with the old value"
    changes = {"rewards.weights": ([1.0, 1.0], [2.0, 1.0]), "rewards.names": (["a"], ["b"]),
               "rewards.overlong_buffer": (0, 4), "rewards.overlong_penalty": (1.0, 2.0),
               "rewards.timeout_s": (10.0, 20.0), "rewards.on_failure": ("worst", "fallback")}
    assert refused_changes(changes, cfg, cfg) == {key: spooled for key in list(changes)[:4]}
