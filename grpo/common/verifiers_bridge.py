"""A verifiers environment by name: `data.path: verifiers:<env>` reads its dataset, `agent.verifiers: <env>` runs
its rollouts as agent sessions. verifiers lives in an environment of its own (`make install-verifiers` builds
.venv-verifiers); the trainer runs verifiers_env.py there as a program and never imports verifiers."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

PREFIX = "verifiers:"
VENV = Path(".venv-verifiers")  # in the working folder, as sampling.vllm.python's .venv-vllm
SCRIPT = Path(__file__).with_name("verifiers_env.py")
ROWS_TIMEOUT_S = 600.0
INSTALL_HINT = ("make install-verifiers (it builds .venv-verifiers with verifiers 0.3.1; then install your "
                "environment there: .venv-verifiers/bin/pip install <it>)")


class VerifiersError(Exception):
    """verifiers is not installed, or the environment would not load or give its rows."""


def is_verifiers(path: str) -> bool:
    return path.startswith(PREFIX)


def env_of(path: str) -> str:
    return path.removeprefix(PREFIX)


def verifiers_python() -> Path:
    """The interpreter of .venv-verifiers, absolute: VerifiersError saying how to make it when it is not there."""
    python = (VENV / "bin" / "python").absolute()
    if not python.exists():
        raise VerifiersError(f"a verifiers environment needs {python}: {INSTALL_HINT}")
    return python


def env_reference(env: str) -> str:
    """An environment's id as given, or its .py file made absolute (the script runs in another folder)."""
    return str(Path(env).expanduser().resolve()) if env.endswith(".py") else env


def script_words(what: str, env: str, args: dict, last: str) -> list[str]:
    """The command line of verifiers_env.py: `rows` (last = the split) or `rollout` (last = the model's name)."""
    return [str(verifiers_python()), str(SCRIPT), what, env_reference(env), json.dumps(args), last]


def readable_for(env: str) -> list[str]:
    """What a jailed rollout reads besides the system's files: this script, .venv-verifiers (verifiers and what was
    installed there), the Python it was made from (its standard library), and the environment's folder: a file's,
    or an installed environment's where it is not in .venv-verifiers (an editable install's source folder)."""
    paths = [str(SCRIPT), str(VENV.absolute()), *base_python(VENV / "pyvenv.cfg")]
    if env.endswith(".py"):
        paths.append(str(Path(env_reference(env)).parent))
    else:
        paths += module_folder(env)
    return paths


FIND_MODULE = ("import importlib.util, sys; s = importlib.util.find_spec(sys.argv[1]); "
               "print(s.origin if s and s.origin else '')")


def module_folder(env: str) -> list[str]:
    """The folder an installed environment's module is imported from, where it lies outside .venv-verifiers; []
    where it is inside, or not found (its rows then say so). verifiers imports `my-env` as `my_env`."""
    name = env.replace("-", "_").split("/")[-1]
    if not name.isidentifier():  # a dotted name would import its parent package here, outside the jail
        return []
    try:  # -I: not this working folder nor PYTHONPATH first on the path; what the rollout imports in its jail
        done = subprocess.run([str(verifiers_python()), "-I", "-c", FIND_MODULE, name], capture_output=True, text=True,
                              timeout=60, check=False)
    except (subprocess.TimeoutExpired, OSError):
        return []
    origin = done.stdout.strip() if done.returncode == 0 else ""
    if not origin or not Path(origin).is_file():
        return []
    folder = Path(origin).resolve().parent
    return [] if folder.is_relative_to(VENV.absolute().resolve()) else [str(folder)]


def base_python(config: Path) -> list[str]:
    """The installation a venv was made from (pyvenv.cfg's `home` is its bin folder), where it says so."""
    try:
        lines = config.read_text().splitlines()
    except OSError:
        return []
    homes = [line.split("=", 1)[1].strip() for line in lines if line.split("=", 1)[0].strip() == "home"]
    return [str(Path(homes[0]).parent)] if homes and Path(homes[0]).is_dir() else []


def env_rows(env: str, args: dict, split: str) -> list[dict]:
    """The rows of the environment's dataset (`train`) or its eval dataset (any other split), as verifiers formats
    them: `prompt` (its chat messages, system prompt and few-shot turns included), `answer`, and `info`, `task`,
    `example_id` where it has them."""
    which = "train" if split == "train" else "eval"
    try:
        done = subprocess.run(script_words("rows", env, args, which), capture_output=True, text=True,
                              timeout=ROWS_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise VerifiersError(f"verifiers environment {env!r} gave no {which} rows in {ROWS_TIMEOUT_S:g} s "
                             "(its load_environment, or its dataset's make)") from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-12:])
        raise VerifiersError(f"verifiers environment {env!r} would not give its {which} rows (exit status "
                             f"{done.returncode}):\n{tail}")
    try:
        return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise VerifiersError(f"verifiers environment {env!r} printed what is not a row: {e}") from None
