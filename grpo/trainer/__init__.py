"""The trainer's side: one optimizer step, what it writes, sharding, the learning rate."""
