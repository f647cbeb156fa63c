"""A two-process off-policy GRPO/GSPO trainer: the library behind the two workers."""
