"""The shipped calculator environment (grpo/environments/calculator.py)."""



import pytest

from grpo.environments import Reply
from grpo.environments.calculator import Calculator, evaluate

# ----------------------------------------------------------------------------- the shipped calculator

@pytest.mark.parametrize("expression, value", [("48 / 2", 24.0), ("2 + 3 * 4", 14), ("(7 - 2) ** 2", 25),
                                               ("1,200 * 3", 3600), ("-4 // 3", -2), ("10 % 4", 2)])
def test_the_calculator_computes_arithmetic(expression, value):
    assert evaluate(expression) == value


def test_the_calculator_answers_bad_calls_with_an_error_message():
    env = Calculator({}, max_calls=3)
    reply = env.step("<calc>6 * 7</calc> and <calc>1 / 0</calc>")
    assert reply == Reply(text="6 * 7 = 42\n1 / 0: error: division by zero", tool_calls=2, tool_errors=1)
    reply = env.step("<calc>__import__('os')</calc><calc>2 ** 999</calc>")
    assert reply.text == ("__import__('os'): error: Call is not arithmetic\n"
                          "2 ** 999: error: no calls left") and reply.tool_errors == 2
    assert env.step("<answer>42</answer>") == Reply(done=True)
    assert "2 ** 999 has more than 64 digits" in Calculator({}).step("<calc>2 ** 999</calc>").text


@pytest.mark.parametrize("expression, error", [
    ("(((9**64)**64)**64)**64", "** 64 has more than 64 digits"),  # refused before it is computed
    ("(-8)**0.5 % 2", "the result is not a real number"),  # a complex number: was a TypeError
    ("(-8)**(1/3)", "the result is not a real number"),  # was shown to the model as a complex number
    ("10**40 * 10**40", "a number of more than 64 digits"),
    ("1e300 * 1e300", "a number of more than 64 digits"),  # floats too: never inf
    ("-" * 600 + "1", "longer than 500 characters"),  # the parser would recurse or run out of memory
])
def test_every_bad_expression_is_a_tool_error_that_leaves_the_valid_call_beside_it(expression, error):
    reply = Calculator({}).step(f"<calc>{expression}</calc> then <calc>6 * 7</calc>")
    assert reply.text.splitlines() == [f"{expression}: error: {reply.text.split(': error: ')[1].splitlines()[0]}",
                                       "6 * 7 = 42"]
    assert error in reply.text and (reply.tool_calls, reply.tool_errors) == (2, 1)
