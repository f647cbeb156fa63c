"""`python -m grpo <command>`: the `grpo` command with this interpreter (grpo/cli.py)."""

from grpo.cli import entry

if __name__ == "__main__":
    entry()
