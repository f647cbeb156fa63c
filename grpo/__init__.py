"""A two-process off-policy GRPO/GSPO trainer: the library behind the `grpo` command and the two workers.

The Python API (grpo/api.py): `grpo.launch(config, overrides)` starts a run and returns its handle;
`grpo.evaluate(...)` and `grpo.export(...)` do what the commands of those names do."""

import importlib.abc
import importlib.util
import sys
from pathlib import Path

if sys.version_info < (3, 11):  # asyncio's and concurrent.futures' timeouts are TimeoutError from 3.11 on
    raise ImportError(f"grpo needs Python 3.11 or newer; this is {sys.version.split()[0]} ({sys.executable})")


class _CheckoutPackages(importlib.abc.MetaPathFinder):
    """grpo.rewards and grpo.data in a checkout used without installing it (PYTHONPATH=<checkout>, as a
    vLLM environment may): the folders beside grpo/, as pyproject.toml's package-dir installs them. Last
    on sys.meta_path: an install (wheel or editable) is found first."""

    ROOT = Path(__file__).resolve().parent.parent

    def find_spec(self, fullname, path=None, target=None):
        name = fullname.removeprefix("grpo.")
        folder = self.ROOT / name
        if fullname == name or "." in name or name not in ("rewards", "data") or \
                not (self.ROOT / "pyproject.toml").is_file() or not (folder / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


if not any(isinstance(finder, _CheckoutPackages) for finder in sys.meta_path):
    sys.meta_path.append(_CheckoutPackages())

API = ("launch", "evaluate", "export", "Run", "RunFailed", "import_path")


def __getattr__(name: str):
    """The API loads on first use, so the workers' imports of grpo.* do not pay for it."""
    if name in API:
        from grpo import api

        return getattr(api, name)
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")
