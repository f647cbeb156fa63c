"""The rows of a run's metrics.jsonl: one per training step, and one per evaluation."""


def is_evaluation_row(row: dict) -> bool:
    """A metrics.jsonl row of an evaluation (eval.every), not of a training step."""
    return "eval/answer_accuracy" in row
