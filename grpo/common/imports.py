"""Code named in the config by import path: a reward, an environment, an OpenEnv class.

`package.module:name` is imported from PYTHONPATH or the working folder (`user_code_importable`);
`path/to/file.py:name` is imported from that file, once, under a name of its own. Either fails with one message that
names the config key, the path and why.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import zlib
from pathlib import Path


class ImportPathError(ValueError):
    """An import path in the config that cannot be imported; the message names the key and the path."""


def is_import_path(name: str) -> bool:
    return ":" in name


_IMPORTING: list[str] = []  # the user files being executed now, innermost last


def importing_user_code() -> str | None:
    """The user file whose import is running now, if any (grpo.launch refuses to start a run from it)."""
    return _IMPORTING[-1] if _IMPORTING else None


def _module_of(path: str):
    if path.endswith(".py"):  # a file: imported under its own name, once
        file = Path(path).expanduser().resolve()
        name = f"grpo_user_code.{file.stem}_{zlib.crc32(str(file).encode()):08x}"
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, file)
            if spec is None or not file.is_file():
                raise FileNotFoundError(f"no file {file}")
            module = importlib.util.module_from_spec(spec)
            _IMPORTING.append(str(file))
            try:
                spec.loader.exec_module(module)
            finally:
                _IMPORTING.pop()
            sys.modules[name] = module
        return sys.modules[name]
    return importlib.import_module(path)


def import_object(name: str, key: str):
    """The callable an import path names (for the config key `key`); ImportPathError otherwise."""
    module_path, _, attribute = name.rpartition(":")
    try:
        function = getattr(_module_of(module_path), attribute)
    except Exception as e:  # ImportError, SyntaxError in the module, AttributeError, ...
        raise ImportPathError(f"{key}: cannot import {name!r} ({type(e).__name__}: {e}); give "
                              "'package.module:name' importable from the working folder or PYTHONPATH, "
                              "or 'path/to/file.py:name'") from None
    if not callable(function):
        raise ImportPathError(f"{key}: {name!r} is a {type(function).__name__}, not a function or class")
    return function


USER_PATH_ENV = "GRPO_USER_PATH"  # folders of the user's code given to grpo.launch (os.pathsep-separated)


def user_code_importable() -> None:
    """`package.module:name` in the config imports from the working folder and GRPO_USER_PATH too (last
    on sys.path). The project installs `grpo` alone, so no user package (rewards, data, common) is shadowed
    by one of ours, nor shadows it."""
    for folder in [os.getcwd(), *filter(None, os.environ.get(USER_PATH_ENV, "").split(os.pathsep))]:
        if folder not in sys.path:
            sys.path.append(folder)
