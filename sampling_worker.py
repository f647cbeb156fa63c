"""The sampling process: `python sampling_worker.py [--config config.yaml] [key=value ...]`.

Its code is grpo/sampler/worker.py (the launcher starts it as `python -m grpo.sampler.worker`)."""

from grpo.sampler.worker import entry

if __name__ == "__main__":
    entry()
