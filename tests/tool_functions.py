"""Tools for the tests, named by path: env.tools=[tests/tool_functions.py:<function>]."""


def lookup(key: str) -> dict:
    """Look a key up in a small table.

    Args:
        key: The key to look up.
    """
    return {key: [1, 2]}


def undocumented(key: str) -> str:
    return key
