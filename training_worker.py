"""The training process: `deepspeed [--num_gpus N] training_worker.py [--config config.yaml] [key=value ...]`.

Its code is grpo/workers/trainer.py (the launcher starts it as `python -m grpo.workers.trainer`)."""

from grpo.workers.trainer import entry

if __name__ == "__main__":
    entry()
