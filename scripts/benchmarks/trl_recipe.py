"""TRL's GRPOTrainer set up with our settings, prompts and rewards: the other side of the
comparisons in bench_vs_trl.py and bench_learn.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo.config import Config

TRL_MICRO_BATCH_GROUPS = 2  # groups per TRL micro-batch (ours: training.max_tokens_per_micro_batch)


def trl_prompt_rows(cfg: Config, steps: int) -> list[dict]:
    """The prompts our sampler would take in `steps` steps, as TRL's dataset rows: plain text that
    TRL tokenizes to exactly our token ids, and the row our rewards get, as JSON (TRL passes the
    columns to reward functions; one string column holds any dataset's row)."""
    from grpo.data.cursor import PromptCursor
    from grpo.data.problems import load_split
    from grpo.data.prompts import build_prompts, few_shot_examples, prompt_text
    from grpo.model.loading import load_tokenizer
    from grpo.rewards.strict import reward_rows

    tokenizer = load_tokenizer(cfg.model)
    problems, _ = load_split(cfg.data, cfg.data.split)
    prompts, _ = build_prompts(tokenizer, cfg.data, problems)
    shots = few_shot_examples(cfg.data, cfg.data.few_shot)
    cursor = PromptCursor(len(prompts), cfg.seed)  # the order our sampler takes them in
    chosen = [prompts[i] for _ in range(steps) for i in cursor.take(cfg.sampling.prompts_per_step)]
    rows = []
    for p, row in zip(chosen, reward_rows(chosen)):
        text = prompt_text(tokenizer, p.problem.question, cfg.data.system_prompt, cfg.data.prefill, shots,
                           p.problem.messages)
        if tokenizer(text)["input_ids"] != p.token_ids:  # how TRL tokenizes a plain-text prompt
            raise SystemExit(f"TRL would see other prompt tokens than ours for {p.problem.id}")
        rows.append({"prompt": text, "row": json.dumps(row)})
    return rows


def trl_reward(name: str, prefill: str):
    """One of our reward functions in TRL's form; ours score the prefill + completion with the row."""
    from grpo.rewards import get_reward

    function = get_reward(name)  # the row form: fn(completion, row)

    def reward(completions, row, **_):
        return [function(prefill + c, json.loads(r)) for c, r in zip(completions, row)]

    reward.__name__ = name
    return reward


def trl_trainer(cfg: Config, rows: list[dict], output_dir: Path, max_steps: int, callbacks: list):
    """TRL's GRPOTrainer with our settings (model, LoRA, G, lengths, learning rate, beta, loss,
    rewards), on `rows` in their order."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from grpo.model.loading import load_model, load_tokenizer, target_modules_of

    sampling, training = cfg.sampling, cfg.training
    if training.aggregation not in ("grpo", "dapo", "dr_grpo") or training.use_gspo or training.num_iterations != 1:
        raise SystemExit("the TRL side is set up for GRPO with num_iterations 1 and the grpo/dapo/dr_grpo losses")
    # one optimizer step per step of ours (prompts_per_step groups, generated at once), in micro-batches
    # of TRL_MICRO_BATCH_GROUPS groups as our trainer packs them: the whole step in one micro-batch
    # took TRL past 24 GiB at 8 groups of ~170 tokens
    micro_groups = math.gcd(sampling.prompts_per_step, TRL_MICRO_BATCH_GROUPS)
    trl_args = GRPOConfig(  # in bfloat16 (model.dtype) both its weights and Trainer's bf16 mode (autocast)
        output_dir=str(output_dir), use_cpu=True, bf16=cfg.model.dtype == "bfloat16", fp16=False, seed=cfg.seed,
        per_device_train_batch_size=micro_groups * sampling.group_size,
        gradient_accumulation_steps=sampling.prompts_per_step // micro_groups,
        num_generations=sampling.group_size, max_completion_length=sampling.max_new_tokens,
        temperature=sampling.temperature, top_p=sampling.top_p, learning_rate=training.learning_rate,
        lr_scheduler_type="constant", warmup_steps=training.warmup_steps, weight_decay=training.weight_decay,
        max_grad_norm=training.max_grad_norm, beta=training.beta, loss_type=training.aggregation,
        epsilon=training.clip_low, epsilon_high=training.clip_high, scale_rewards=training.advantage_scale,
        mask_truncated_completions=training.mask_truncated_completions, reward_weights=list(cfg.rewards.weights),
        max_steps=max_steps, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        shuffle_dataset=False, dataloader_num_workers=0,
        # TRL turns it on by default; ours recomputes nothing unless model.gradient_checkpointing
        gradient_checkpointing=cfg.model.gradient_checkpointing)
    lora = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=0.0,
                      target_modules=target_modules_of(cfg.lora), task_type="CAUSAL_LM",
                      use_rslora=cfg.lora.use_rslora, use_dora=cfg.lora.use_dora,
                      modules_to_save=list(cfg.lora.modules_to_save) or None)
    return GRPOTrainer(model=load_model(cfg.model, "cpu"),
                       reward_funcs=[trl_reward(n, cfg.data.prefill) for n in cfg.rewards.names],
                       args=trl_args, train_dataset=Dataset.from_list(rows), processing_class=load_tokenizer(cfg.model),
                       peft_config=lora, callbacks=callbacks)
