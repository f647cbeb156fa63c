"""The `grpo` command's subcommands, one module each (grpo/cli.py dispatches)."""
