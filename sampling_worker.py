"""The sampling process: `python sampling_worker.py [--config config.yaml] [key=value ...]`.

Its code is grpo/workers/sampler.py (the launcher starts it as `python -m grpo.workers.sampler`)."""

from grpo.workers.sampler import entry

if __name__ == "__main__":
    entry()
