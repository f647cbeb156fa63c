"""A reward as a user writes it in a module of their own (tests/test_api.py passes the function object)."""


def digit_matches(completion: str, row: dict) -> float:
    return float(completion.strip()[:1] == str(row["reference_answer"]))
