"""The Python API, for notebooks and scripts: what `grpo train`, `grpo evaluate` and `grpo export` do.

    import grpo
    run = grpo.launch("config.yaml", {"training.steps": 50, "rewards.names": [my_reward]})
    run.wait()                      # or run.stop(): the trainer checkpoints, a later launch resumes
    run.metrics()[-1]["reward"]     # the rows of runs/<name>/metrics.jsonl
    grpo.evaluate(run=run.run_dir, limit=100)["answer_accuracy"]
    grpo.export(run.run_dir, "exported/", merge=True)

A run's processes are the command's: `launch` starts `grpo train` as a child process (it starts the
sampler(s) and the DeepSpeed trainer), so a notebook's kernel holds no model and no process group.
Overrides are dotted keys with Python values, or `key=value` strings as on the command line; a
reward, environment or tool may be given as a module-level function or class, whose import path is
written into the config (a lambda or a function defined inside another cannot be imported by the
run's processes: a clear error).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from grpo.common.imports import USER_PATH_ENV, importing_user_code
from grpo.common.run_folder import RunFolder

Overrides = Mapping[str, Any] | Sequence[str] | None


class RunFailed(RuntimeError):
    """The run's launcher exited with a failure; `code` is its exit code (docs/running.md lists them)."""

    def __init__(self, code: int, run_dir: Path, tail: str):
        super().__init__(f"the run in {run_dir} failed (exit code {code}); its last lines:\n{tail}")
        self.code = code


def import_path(obj: Any) -> str:
    """`package.module:name` of a module-level function or class, as the config names code; a path
    to its file where it was defined in a script run as __main__. ValueError for what the run's
    processes could not import (a lambda, a closure, a method, a notebook cell's function)."""
    name, module = getattr(obj, "__qualname__", None), getattr(obj, "__module__", None)
    if not callable(obj) or not name or not module:
        raise ValueError(f"{obj!r} is not a function or class: give it, or its import path 'package.module:name'")
    if "<" in name or "." in name:  # <lambda>, f.<locals>.g, Class.method
        raise ValueError(f"{name} cannot be imported by the run's processes (a lambda, a function defined inside "
                         "another, or a method): define it at the top level of a module and pass that function")
    if module == "__main__":
        file = getattr(sys.modules["__main__"], "__file__", None)
        if not file:
            raise ValueError(f"{name} is defined in this notebook or interactive session, which the run's processes "
                             "cannot import: put it in a .py file, import it from there and pass that function")
        return f"{Path(file).resolve()}:{name}"
    return f"{module}:{name}"


def module_root(obj: Any) -> str | None:
    """The folder from which the module of `obj` imports, when the run's processes need it added to
    their path (GRPO_USER_PATH): none for an installed package (a site-packages folder there would mix
    two environments' packages in a vLLM sampler)."""
    module = sys.modules.get(getattr(obj, "__module__", ""), None)
    file = getattr(module, "__file__", None)
    if module is None or not file or module.__name__ == "__main__":
        return None
    depth = module.__name__.count(".") + (Path(file).name == "__init__.py")
    root = Path(file).resolve().parents[depth]
    installed = {Path(sysconfig.get_paths()[kind]).resolve() for kind in ("purelib", "platlib", "stdlib")}
    return None if root in installed or root.name in ("site-packages", "dist-packages") else str(root)


def _code_in(value: Any) -> list:
    if isinstance(value, (types.FunctionType, type)):
        return [value]
    if isinstance(value, (list, tuple)):
        return [code for item in value for code in _code_in(item)]
    if isinstance(value, dict):
        return [code for item in value.values() for code in _code_in(item)]
    return []


def _as_config_value(value: Any, key: str) -> Any:
    if isinstance(value, (types.FunctionType, type)):
        return import_path(value)
    if isinstance(value, (list, tuple)):
        return [_as_config_value(item, key) for item in value]
    if isinstance(value, dict):
        return {k: _as_config_value(item, key) for k, item in value.items()}
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if type(value).__module__ == "numpy" and hasattr(value, "item"):  # a numpy scalar
        return value.item()
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise TypeError(f"overrides: {key} is a {type(value).__name__} ({value!r}); give a number, string, bool, list, "
                    "dict, path, or a module-level function or class")


def _as_text(value: Any) -> str:
    """`value` as the command line's YAML reads it back: a string that YAML would read as something
    else (a number, a bool, a comment, a mapping, trailing dots or spaces) is quoted."""
    if isinstance(value, str):
        try:
            if yaml.safe_load(value) == value:
                return value
        except yaml.YAMLError:
            pass
        return json.dumps(value, ensure_ascii=False)
    return yaml.safe_dump(value, default_flow_style=True, width=10**9).strip().removesuffix("...").strip()


def cli_overrides(overrides: Overrides) -> tuple[list[str], list[str]]:
    """(`key=value` strings as the command line takes them, folders the code given imports from)."""
    if overrides is None:
        return [], []
    if isinstance(overrides, str):
        raise TypeError("overrides: a dict of dotted keys, or a list of 'key=value' strings, not one string")
    if not isinstance(overrides, Mapping):
        return [str(text) for text in overrides], []
    texts, roots = [], []
    for key, value in overrides.items():
        roots += [root for code in _code_in(value) if (root := module_root(code)) and root not in roots]
        texts.append(f"{key}={_as_text(_as_config_value(value, key))}")
    return texts, roots


@dataclass
class Run:
    """A started run: its launcher process, its folder and what it has printed so far."""

    run_dir: Path
    process: subprocess.Popen
    output: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def wait(self, timeout: float | None = None, check: bool = True) -> int:
        """The launcher's exit code once it has stopped all the run's processes; RunFailed for a
        failure when `check` (subprocess.TimeoutExpired after `timeout` seconds, the run going on)."""
        code = self.process.wait(timeout)
        if self._reader is not None:
            self._reader.join()
        if check and code != 0:
            raise RunFailed(code, self.run_dir, "".join(self.output[-20:]))
        return code

    def stop(self, timeout: float | None = None) -> int:
        """Stop the run as Ctrl-C does (the trainer saves a checkpoint; a later launch resumes) and
        return the launcher's exit code (130)."""
        if self.running:
            self.process.send_signal(signal.SIGINT)
        return self.wait(timeout, check=False)

    def metrics(self) -> list[dict]:
        """The rows of metrics.jsonl so far (training steps and evaluations), a row being written left out."""
        path = RunFolder(self.run_dir).metrics
        if not path.is_file():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # the line the trainer is writing now
                break
        return rows


def launch(config: str | os.PathLike | None = "config.yaml", overrides: Overrides = None, *,
           echo: bool = True) -> Run:
    """Start a run as `grpo train --config CONFIG key=value ...` does and return its handle at once.
    A mistake in the config raises ConfigError here, before anything starts. `echo` prints the
    launcher's progress lines as they come (they are kept in `Run.output` either way)."""
    from grpo.commands.processes import checkout_root
    from grpo.config import parse_cli
    from grpo.run.preflight import named_code_problems

    if importing_user_code():
        raise RuntimeError(f"grpo.launch was called while the run's config imported {importing_user_code()} (the file "
                           "that defines a reward, environment or tool): put the launch under "
                           "`if __name__ == \"__main__\":` so that importing the file does not start a run")
    texts, roots = cli_overrides(overrides)
    args = (["--config", os.fspath(config)] if config is not None else []) + texts
    # as the launcher reads it: a missing --config file is an error, no --config: ./config.yaml
    cfg = parse_cli(args, checks=[named_code_problems])
    env = dict(os.environ, PYTHONSAFEPATH="1")  # the working folder never shadows our packages (Python >= 3.11)
    if checkout_root():  # not installed: the launcher imports grpo from the checkout
        env["PYTHONPATH"] = os.pathsep.join([checkout_root(), *filter(None, [env.get("PYTHONPATH")])])
    if roots:  # the given code's folders, imported last (grpo/common/imports.py: user_code_importable)
        env[USER_PATH_ENV] = os.pathsep.join([*roots, *filter(None, [env.get(USER_PATH_ENV)])])
    process = subprocess.Popen([sys.executable, "-u", "-m", "grpo.commands.train", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env)
    run = Run(Path(cfg.run_dir).absolute(), process)
    run._reader = threading.Thread(target=_follow, args=(process, run.output, echo), daemon=True)
    run._reader.start()
    return run


def _follow(process: subprocess.Popen, output: list[str], echo: bool) -> None:
    for line in process.stdout:
        output.append(line)
        if echo:
            print(line, end="", flush=True)


def evaluate(run: str | os.PathLike | None = None, *, version: int | None = None,
             config: str | os.PathLike | None = None, weights: str | os.PathLike | None = None,
             limit: int | None = None, batch_size: int = 16, split: str = "test", overrides: Overrides = None) -> dict:
    """Held-out accuracy in this process, as `grpo evaluate` computes it: a run's published version
    (`run`, `version`), a weights folder, or the base model of `config`. The summary, with the scored
    samples under "samples"."""
    from argparse import Namespace

    from grpo.commands.evaluate import evaluate as evaluate_samples
    from grpo.commands.evaluate import resolve_inputs

    texts, _ = cli_overrides(overrides)
    args = Namespace(run=Path(run) if run is not None else None, version=version, config=config,
                     weights=Path(weights) if weights is not None else None)
    cfg, weights_folder, _ = resolve_inputs(args, texts)
    result, samples = evaluate_samples(cfg, weights_folder, limit, batch_size, split)
    return {**result, "samples": samples}


def export(run: str | os.PathLike, out: str | os.PathLike, *, version: int | None = None, merge: bool = False,
           force: bool = False, dtype: str = "float32") -> dict:
    """A run's published version as a model folder, as `grpo export` writes it; what was written."""
    from grpo.commands.export import export as export_folder

    return export_folder(Path(run), version, Path(out), merge, force, dtype)
