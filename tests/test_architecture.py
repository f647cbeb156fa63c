"""The module boundaries docs/architecture.md describes, checked on the real imports."""

import subprocess
import sys

from conftest import REPO

from common import model_files as models
from grpo import objective
from grpo.config import option_lists
from grpo.model import logprobs
from grpo.sampler import rollout

IMPORTED_AFTER = '''
import sys
import {worker}
from grpo.config import load_config
load_config(None, [])  # validation imports the option lists' owners
print(" ".join(sorted(m for m in sys.modules if m.split(".")[0] in ("grpo", "data", "rewards", "{other}"))))
'''


def imported_by(worker: str, other: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", IMPORTED_AFTER.format(worker=worker, other=other)], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return set(out.split())


def test_the_sampler_imports_nothing_of_the_trainer_and_the_trainer_no_engine():
    sampler = imported_by("sampling_worker", "training_worker")
    assert {"grpo.wire.delivery", "grpo.sampler.step", "rewards.sandbox"} <= sampler  # engines load when chosen
    assert not sampler & {"training_worker", "grpo.workers.trainer", "grpo.trainer.step", "grpo.trainer.outputs"}
    trainer = imported_by("training_worker", "sampling_worker")
    assert {"grpo.wire.delivery", "grpo.trainer.step", "grpo.trainer.outputs"} <= trainer
    assert not trainer & {"sampling_worker", "grpo.workers.sampler", "grpo.sampler.step",
                          "grpo.sampler.rollout.hf_engine", "grpo.sampler.rollout.vllm_engine", "rewards.sandbox"}


def test_each_choice_is_validated_against_the_list_its_implementing_module_owns():
    lists = option_lists()
    assert lists["training.aggregation"] is objective.AGGREGATIONS
    assert lists["training.kl_estimator"] is objective.KL_ESTIMATORS
    assert lists["training.advantage_scale"] is objective.ADVANTAGE_SCALES
    assert lists["sampling.engine"] == tuple(rollout.ENGINES)
    assert lists["sampling.old_logps"] is logprobs.OLD_LOGPS_SOURCES
    assert lists["model.dtype"] == tuple(models.DTYPES)


def imported_modules(path) -> set[str]:
    """Every module a file imports (at the top or inside functions), by absolute name."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def imports_between(importer: str, imported: tuple[str, ...]) -> dict[str, set[str]]:
    """{file of `importer` (a package folder): the modules under `imported` it imports}, files that import
    none left out."""
    found = {}
    for path in sorted((REPO / importer).rglob("*.py")):
        hits = {name for name in imported_modules(path)
                if any(name == prefix or name.startswith(prefix + ".") for prefix in imported)}
        if hits:
            found[str(path.relative_to(REPO))] = hits
    return found


def test_the_top_level_packages_import_one_way():
    """grpo uses rewards, data and common; rewards uses data and common; data uses common; common none."""
    assert imports_between("common", ("grpo", "rewards", "data")) == {}
    assert imports_between("data", ("grpo", "rewards")) == {}
    assert imports_between("rewards", ("grpo",)) == {}
    assert imports_between("grpo", ("rewards",))  # the check above sees imports (it is not vacuous)


def test_the_config_stands_above_what_it_validates():
    """The config asks the modules below it for their options (option_lists), so none of them loads
    it: they take its types from grpo/settings; only the commands, the API and the workers' mains do."""
    for below in ("grpo/sampler", "grpo/trainer", "grpo/wire", "grpo/weights", "grpo/model", "grpo/objective",
                  "grpo/environments", "grpo/run", "grpo/settings", "rewards", "data", "common"):
        assert imports_between(below, ("grpo.config", "grpo.workers", "grpo.commands", "grpo.api")) == {}, below


def test_the_wire_imports_neither_the_objective_nor_the_model_and_they_not_the_wire():
    assert imports_between("grpo/wire", ("grpo.objective", "grpo.model", "grpo.trainer", "grpo.sampler")) == {}
    assert imports_between("grpo/objective", ("grpo.wire",)) == {}
    assert imports_between("grpo/model", ("grpo.wire",)) == {}


def test_each_seam_names_implementations_that_give_its_interface():
    """The registries of docs/architecture.md: every name's implementation has what its seam calls."""
    import importlib
    import inspect

    from grpo.sampler.rollout import ENGINES, RolloutEngine
    from grpo.weights import CHANNELS
    from grpo.wire.transport import TRANSPORTS

    engine_members = {"build", "generate", "stage_weights", "load_weights", "close"}
    for name, path in ENGINES.items():
        if name == "vllm":  # its module imports vLLM, which has its own environment (make test-vllm checks it)
            continue
        module, _, cls = path.partition(":")
        engine = getattr(importlib.import_module(module), cls)
        assert engine_members <= set(dir(engine)) and isinstance(engine.generates_with_scoring_model, bool), name
        assert set(inspect.signature(engine.build).parameters) == {"cfg", "model", "tokenizer"}
    assert engine_members <= set(dir(RolloutEngine))
    for scheme, module in TRANSPORTS.items():
        transport = importlib.import_module(module)
        assert callable(transport.connect) and callable(transport.bind), scheme
        assert {"send", "close"} <= set(dir(transport.Sender)) and {"receive", "close"} <= set(dir(transport.Receiver))
    for name, module in CHANNELS.items():
        channel = importlib.import_module(module)
        assert callable(channel.publisher) and callable(channel.watcher), name


def test_no_module_over_450_lines_and_no_function_over_70():
    import ast

    packages = ("grpo", "rewards", "data", "common", "scripts")
    files = [path for package in packages for path in (REPO / package).rglob("*.py")]
    long_modules, long_functions = [], []
    for path in files:
        text = path.read_text()
        if len(text.splitlines()) > 450:
            long_modules.append(f"{path.relative_to(REPO)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 70:
                long_functions.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: "
                                      f"{node.end_lineno - node.lineno + 1} lines")
    assert (long_modules, long_functions) == ([], [])
