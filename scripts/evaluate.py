"""`grpo evaluate` from a checkout without `make install`: accuracy of published weights on held-out problems
(grpo/commands/evaluate.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages

from grpo.cli import run_command  # noqa: E402
from grpo.commands.evaluate import main  # noqa: E402

if __name__ == "__main__":
    run_command(lambda: main(sys.argv[1:]))
