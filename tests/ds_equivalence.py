"""Launched by test_training.py as `deepspeed --num_gpus N tests/ds_equivalence.py OUT.json`.

For each case, one trainer update (grpo.trainer.training_step.train_step: W ranks, several micro-batches)
and, on rank 0, the single-process whole-batch update from the same start; rank 0 writes both.
"""

import dataclasses
import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "benchmarks"))

from bench_vision import images_of, prompt_with, tiny_vlm  # noqa: E402
from conftest import tiny_model  # noqa: E402

from grpo.config import LoraConfig, load_config  # noqa: E402
from grpo.model.loading import add_lora  # noqa: E402
from grpo.model.logprobs import completion_logprobs  # noqa: E402
from grpo.model.sharding import pack_micro_batches, shard_groups  # noqa: E402
from grpo.model.vision import wire_images  # noqa: E402
from grpo.trainer.groups import group_costs  # noqa: E402
from grpo.trainer.training_step import (  # noqa: E402
    PolicyObjective,
    deepspeed_config,
    make_optimizer,
    micro_batch_loss,
    release_deepspeed_shm,
    train_step,
)
from grpo.wire.batch import RolloutBatch  # noqa: E402

AGGREGATIONS = ("grpo", "dapo", "dr_grpo")
CASES = [(level, agg, 0, "sampler") for level in ("token", "sequence") for agg in AGGREGATIONS] + \
        [("token", agg, 2, "sampler") for agg in AGGREGATIONS] + \
        [("token", agg, 3, "sampler") for agg in AGGREGATIONS] + \
        [("sequence", "grpo", 3, "sampler"),  # ZeRO-2 partitions gradients, ZeRO-3 the parameters too
         # the trainer computes the reference log-probs (adapter off) that the single process is given
         ("token", "grpo", 0, "trainer"), ("sequence", "dapo", 3, "trainer")]
VISION = ("model.train_vision=true", "data.path=shapes")  # a tiny Qwen2-VL with images, its vision encoder trained
CASES = [(*case, ()) for case in CASES] + [  # the other policy losses, and the entropy bonus's gradient
    ("token", "dapo", 0, "sampler", ("training.loss=cispo", "training.entropy_coef=0.01")),
    ("sequence", "grpo", 2, "sampler", ("training.loss=sapo",)),
    # one rank pads with zero-loss forwards: they run the vision encoder too, or ZeRO-2's reduction would not line up
    ("token", "grpo", 2, "sampler", VISION), ("sequence", "grpo", 0, "sampler", VISION)]


def start_model(vision: bool = False):
    lora = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    model = add_lora(tiny_vlm(torch.float32), lora, train_vision=True) if vision else \
        add_lora(tiny_model("llama", seed=0), lora)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)  # a trained-looking adapter: every LoRA matrix gets a gradient
    return model.train()


def make_batch(model, sizes=(3, 1, 4, 2, 3), vision: bool = False) -> RolloutBatch:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 101, (n,), generator=g) for n in (7, 3, 12, 5, 9)]
    images, fields = None, {}
    if vision:  # three prompts, one or two images each: at 30 tokens a micro-batch, one rank has 1, the other 2
        sizes = (5, 1, 1)
        images = [images_of((56, 56)), images_of((56, 84), (28, 56), seed=1), images_of((28, 28), seed=2)]
        prompts = [prompt_with(own) for own in images]
        pixels, grids, patch_values = wire_images(images)
        fields = {"image_pixels": pixels, "image_grids": grids, "patch_values": patch_values}
    lengths = torch.randint(1, 9, (sum(sizes),), generator=g).tolist()
    top = 90 if vision else 101  # no image tokens (97-100) in a completion of the vision model's
    completions = [torch.randint(3, top, (n,), generator=g) for n in lengths]
    with torch.no_grad():
        current = completion_logprobs(model, prompts, completions, list(sizes), images=images)
    noise = lambda: [x + 0.3 * torch.randn(len(x), generator=g) for x in current]  # noqa: E731
    truncated = torch.rand(sum(sizes), generator=g) < 0.3
    return RolloutBatch(step=0, policy_version=0, prompt_ids=prompts, completion_ids=completions,
                        group_sizes=list(sizes), old_logps=noise(), ref_logps=noise(),
                        rewards=torch.zeros(sum(sizes), 1), reward_names=["r"],
                        advantages=torch.randn(sum(sizes), generator=g), truncated=truncated, **fields)


def lora_params(model):
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # under ZeRO-3 each rank holds a slice: gather the whole tensors (a collective; no-op otherwise)
    with deepspeed.zero.GatheredParameters([p for _, p in trainable]):
        return {n: p.detach().clone() for n, p in trainable}


def reference_update(cfg, batch):
    """Single process, whole batch, no DeepSpeed: loss, grad norm, clip, AdamW."""
    model = start_model(cfg.model.train_vision)
    before = lora_params(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.training.learning_rate, weight_decay=cfg.training.weight_decay)
    loss, _, _ = micro_batch_loss(model, batch, cfg)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.training.max_grad_norm)
    optimizer.step()
    after = lora_params(model)
    return loss.item(), grad_norm.item(), {n: (after[n] - before[n]).tolist() for n in before}


def main(out_path: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    release_deepspeed_shm()
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for level, aggregation, stage, reference_on, extra in CASES:
        cfg = load_config(None, [f"training.use_gspo={level == 'sequence'}", f"training.aggregation={aggregation}",
                                 f"training.reference_on={reference_on}",
                                 "training.max_tokens_per_micro_batch=30", "training.beta=0.04",
                                 "training.learning_rate=0.01", "training.max_grad_norm=0.1",
                                 "training.mask_truncated_completions=true", "sampling.max_new_tokens=10",
                                 "training.clip_low=0.2", "training.clip_high=0.28", f"deepspeed.zero_stage={stage}",
                                 *extra])
        model = start_model(cfg.model.train_vision)
        batch = make_batch(model, vision=cfg.model.train_vision)
        costs = group_costs(batch)
        micro_counts = [len(pack_micro_batches(shard, costs, cfg.training.max_tokens_per_micro_batch))
                        for shard in shard_groups(costs, world)]
        given = batch
        if reference_on == "trainer":
            with torch.no_grad(), model.disable_adapter():
                adapter_off = completion_logprobs(model, batch.prompt_ids, batch.completion_ids, batch.group_sizes,
                                                  temperature=cfg.sampling.temperature)
            batch, given = dataclasses.replace(batch, ref_logps=None), dataclasses.replace(batch, ref_logps=adapter_off)
        before = lora_params(model)
        optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg)
        engine, *_ = deepspeed.initialize(model=PolicyObjective(model, cfg), optimizer=optimizer,
                                          config=deepspeed_config(cfg, world))
        metrics = train_step(engine, batch, cfg, rank, world, torch.device("cpu"))
        after = lora_params(model)
        if rank == 0:
            ref_loss, ref_norm, ref_delta = reference_update(dataclasses.replace(cfg, training=dataclasses.replace(
                cfg.training, reference_on="sampler")), given)
            results.append({"case": [level, aggregation, stage, reference_on, *extra], "loss": metrics["loss"],
                            "grad_norm": metrics["grad_norm"],
                            "delta": {n: (after[n] - before[n]).tolist() for n in before},
                            "ref_loss": ref_loss, "ref_grad_norm": ref_norm, "ref_delta": ref_delta,
                            "micro_batches": micro_counts})
        dist.barrier()
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0])
