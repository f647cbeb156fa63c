"""A two-process off-policy GRPO/GSPO trainer: the library behind the `grpo` command and the two workers.

The Python API (grpo/api.py): `grpo.launch(config, overrides)` starts a run and returns its handle;
`grpo.evaluate(...)` and `grpo.export(...)` do what the commands of those names do."""

import sys

if sys.version_info < (3, 11):  # asyncio's and concurrent.futures' timeouts are TimeoutError from 3.11 on
    raise ImportError(f"grpo needs Python 3.11 or newer; this is {sys.version.split()[0]} ({sys.executable})")

API = ("launch", "evaluate", "export", "Run", "RunFailed", "import_path")


def __getattr__(name: str):
    """The API loads on first use, so the workers' imports of grpo.* do not pay for it."""
    if name in API:
        from grpo import api

        return getattr(api, name)
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")
