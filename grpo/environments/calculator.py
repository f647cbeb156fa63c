"""The shipped example: GSM8K with a calculator tool.

The model may write `<calc>expression</calc>` and end its message; the next turn shows it
`expression = value` for each call (or `expression: error: why`). A message without a call is
its answer: the episode ends and the rewards score it. Expressions are arithmetic only (numbers,
+ - * / // % **, parentheses), read with `ast` and never `eval`: a bad call is an error message to
the model. The pool (grpo/environments/pool.py) still runs it in a child with a time limit and no
network, like every environment.
"""

from __future__ import annotations

import ast
import math
import operator
import re

from grpo.environments import Reply

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
NOTE = re.compile(r"<<([^=<>]*)=([^<>]*)>>")  # GSM8K's calculator notes: "48/2 = <<48/2=24>>24 clips"
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
             ast.USub: operator.neg, ast.UAdd: operator.pos}  # Pow through _power
MAX_DIGITS = 64  # no GSM8K quantity comes near; every intermediate is kept below 10 ** 64
MAX_INT = 10 ** MAX_DIGITS
MAX_LENGTH = 500  # characters of one expression: a GSM8K calculation is a few dozen


def _bounded(number):
    """`number` if it is a real number below 10 ** MAX_DIGITS in size; ValueError otherwise."""
    if isinstance(number, complex):
        raise ValueError("the result is not a real number")
    if isinstance(number, float) and not math.isfinite(number):
        raise ValueError("the result is not a finite number")
    if abs(number) >= MAX_INT:
        raise ValueError(f"a number of more than {MAX_DIGITS} digits")
    return number


def _power(base, exponent):
    """base ** exponent, refused before it is computed when the integer result would be too big
    (`(9**64)**64` would otherwise run until the time limit)."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1 \
            and exponent * math.log10(abs(base)) >= MAX_DIGITS:
        raise ValueError(f"{base} ** {exponent} has more than {MAX_DIGITS} digits")
    return base ** exponent


def evaluate(expression: str) -> float | int:
    """The value of an arithmetic expression; ValueError naming what is not allowed or too big
    (every intermediate is a real number below 10 ** MAX_DIGITS)."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return _bounded(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return _bounded(OPERATORS[type(node.op)](value(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            apply = _power if isinstance(node.op, ast.Pow) else OPERATORS[type(node.op)]
            return _bounded(apply(left, right))
        raise ValueError(f"{type(node).__name__} is not arithmetic")
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip().replace(",", ""), mode="eval")
        return value(tree.body)
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None
    except (RecursionError, MemoryError):  # nested too deep for the parser or the walk
        raise ValueError("nested too deeply") from None


def show(number: float | int) -> str:
    """24.0 -> 24; 1/3 -> 0.333333 (what a calculator shows)."""
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    return str(number) if isinstance(number, int) else f"{number:.6g}"


class Calculator:
    """One GSM8K episode: tool results until a message without a call (`max_calls` in all)."""

    @staticmethod
    def demonstration(row: dict, answer: str) -> list[dict] | None:
        """A few-shot GSM8K problem solved with the calculator: each of its solution's calculator
        notes becomes a call (the solution since the previous note, then `<calc>`) and the
        calculator's reply; then the whole `answer`. Every message opens with <think>, as the
        trained format's data.prefill opens each of the model's turns. None when the solution has
        no note this calculator computes."""
        solution, turns, start = row.get("answer", "").split("####")[0], [], 0
        for note in NOTE.finditer(solution):
            try:
                value = show(evaluate(note.group(1)))
            except (ValueError, ArithmeticError, TypeError):
                return None
            call = note.group(1).strip()
            opening = NOTE.sub("", solution[start:note.start()]).strip()
            turns += [{"role": "assistant", "content": f"<think>\n{opening} <calc>{call}</calc>"},
                      {"role": "user", "content": f"{call} = {value}"}]
            start = note.end()
        return turns + [{"role": "assistant", "content": answer}] if turns else None

    def __init__(self, row: dict, max_calls: int = 8):
        self.calls_left = max_calls

    def step(self, message: str) -> Reply:
        calls = CALL.findall(message)
        if not calls:
            return Reply(done=True)
        lines, errors = [], 0
        for expression in calls:
            if self.calls_left <= 0:
                lines.append(f"{expression.strip()}: error: no calls left")
                errors += 1
                continue
            self.calls_left -= 1
            try:
                lines.append(f"{expression.strip()} = {show(evaluate(expression))}")
            except (ValueError, ArithmeticError, TypeError) as e:  # ZeroDivisionError, OverflowError, ...
                lines.append(f"{expression.strip()}: error: {e}")
                errors += 1
        return Reply(text="\n".join(lines), tool_calls=len(calls), tool_errors=errors)


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: The expression to evaluate, for example "48 / 2" or "(3 + 4) * 12".
    """
    return show(evaluate(expression))  # a ValueError (not arithmetic, too big) is the tool error the model reads


def tool_demonstration(row: dict, answer: str) -> list[dict] | None:
    """A few-shot GSM8K problem solved with the `calculate` tool (env.tools): each calculator note
    of its solution becomes an assistant message (the solution since the previous note) that calls
    the tool, and the tool's result; then the whole `answer`. The chat template writes the calls
    in the model's own form. None when the solution has no note the tool computes."""
    solution, turns, start = row.get("answer", "").split("####")[0], [], 0
    for note in NOTE.finditer(solution):
        try:
            value = calculate(note.group(1))
        except (ValueError, ArithmeticError, TypeError):
            return None
        opening = NOTE.sub("", solution[start:note.start()]).strip()
        call = {"type": "function",
                "function": {"name": "calculate", "arguments": {"expression": note.group(1).strip()}}}
        turns += [{"role": "assistant", "content": f"<think>\n{opening}", "tool_calls": [call]},
                  {"role": "tool", "name": "calculate", "content": value}]
        start = note.end()
    return turns + [{"role": "assistant", "content": answer}] if turns else None
