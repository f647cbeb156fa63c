"""The training process: `deepspeed [--num_gpus N] training_worker.py [--config config.yaml] [key=value ...]`.

Its code is grpo/trainer/worker.py (the launcher starts it as `python -m grpo.trainer.worker`)."""

from grpo.trainer.worker import entry

if __name__ == "__main__":
    entry()
