"""Test helpers shared by several test files (not fixtures)."""

import os
from contextlib import contextmanager

import torch

from grpo.run.ports import free_loopback_address
from grpo.wire.batch import RolloutBatch


def free_tcp_address() -> str:
    return free_loopback_address()


@contextmanager
def closed_pipe():
    """The writing end of a pipe whose reader is gone before the first write: every write fails with EPIPE
    (`command | head -0`, or a `grep -q` that has found its match)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        yield write_end
    finally:
        os.close(write_end)


def make_batch(step: int = 0, seed: int = 0, group_sizes=(3, 2), with_ref: bool = True) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    n = sum(group_sizes)
    lengths = torch.randint(1, 9, (n,), generator=g).tolist()
    completions = [torch.randint(0, 50000, (c,), generator=g) for c in lengths]
    prompts = [torch.randint(0, 50000, (p,), generator=g) for p in (5, 11)[:len(group_sizes)]]
    old_logps = [-torch.rand(c, generator=g) for c in lengths]
    ref_logps = [-torch.rand(c, generator=g) for c in lengths] if with_ref else None
    rewards = torch.randn(n, 2, generator=g)
    return RolloutBatch(
        step=step, policy_version=max(0, step - 1), prompt_ids=prompts,
        completion_ids=completions, group_sizes=list(group_sizes), old_logps=old_logps, ref_logps=ref_logps,
        rewards=rewards, reward_names=["gsm8k_answer", "think_answer_format"],
        advantages=torch.randn(n, generator=g), truncated=torch.rand(n, generator=g) > 0.5,
        meta={"sample_ids": ["train-1", "train-2"], "metrics": {"a": 1.5}},
        totals=rewards.sum(1), scored=torch.arange(n) != 1, worst=torch.arange(n) == 0)


def assert_batches_equal(a: RolloutBatch, b: RolloutBatch) -> None:
    for name in ("schema", "step", "sampler", "policy_version", "group_sizes", "reward_names", "meta"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("prompt_ids", "completion_ids", "old_logps", "ref_logps", "token_versions", "model_mask",
                 "teacher_logps", "segments"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert len(x) == len(y) and all(torch.equal(u, v) and u.dtype == v.dtype for u, v in zip(x, y)), name
    for name in ("rewards", "advantages", "truncated", "totals", "scored", "worst"):
        x, y = getattr(a, name), getattr(b, name)
        assert torch.equal(x, y) and x.dtype == y.dtype, name


def command_line(process) -> str:
    """A psutil.Process's command line, "" for one that has exited (a zombie not yet reaped, or gone):
    a run's tree always holds a jail's short-lived calls."""
    import psutil

    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:  # ZombieProcess is one
        return ""


def new_version_loader(tmp_path, model, at_poll: int, also=lambda: True, change=lambda newer: None):
    """(the model as it was, the newer one, engine -> the engine polling for weights) for an HF engine serving
    `model` (which the load changes): a version 1 that changes the attention (the keys of layer 0), the head and
    whatever `change` does to it, published in `tmp_path` and loaded between two decode steps, at the first poll
    from poll `at_poll` on where `also()` holds (sampling.in_flight_updates)."""
    import copy

    from grpo.weights.folder import publish, verify

    old, newer = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():
        newer.get_decoder().layers[0].self_attn.k_proj.weight.mul_(-2.0)  # a VLM's decoder is its language model
        newer.lm_head.weight.mul_(1.3)
        change(newer)
    folder = publish(newer, tmp_path, 1, 1)
    manifest = verify(folder)

    def polling(engine):
        polls = []

        def poll() -> bool:
            polls.append(engine.decode_rows.steps)
            if len(polls) >= at_poll and engine.version == 0 and also():
                engine.load_weights(folder, manifest, 1)
                return True
            return False
        engine.poll_weights = poll
        return engine
    return old, newer, polling
