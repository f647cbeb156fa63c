"""The two processes' mains: their start-up, exit codes and end (grpo/sampler/ and grpo/trainer/ hold
what each does; they import the config's types from grpo/settings, never the config's loading)."""
