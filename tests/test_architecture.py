"""The module boundaries docs/architecture.md describes, checked on the real imports."""

import subprocess
import sys

import pytest
from conftest import REPO

from grpo.settings import Config
from grpo.settings.tree import choices_of

IMPORTED_AFTER = '''
import sys
import {worker}
from grpo.config import load_config
load_config(None, [])
print(" ".join(sorted(m for m in sys.modules if m.split(".")[0] in ("grpo", "{other}"))))
'''


def imported_by(worker: str, other: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", IMPORTED_AFTER.format(worker=worker, other=other)], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return set(out.split())


@pytest.mark.slow  # imports each worker in a Python of its own
def test_the_sampler_imports_nothing_of_the_trainer_and_the_trainer_no_engine():
    sampler = imported_by("sampling_worker", "training_worker")
    # engines: when chosen
    assert {"grpo.wire.delivery", "grpo.sampler.sampling_step", "grpo.rewards.sandbox"} <= sampler
    assert not sampler & {"training_worker", "grpo.workers.trainer", "grpo.trainer.training_step",
                          "grpo.trainer.saving"}
    trainer = imported_by("training_worker", "sampling_worker")
    assert {"grpo.wire.delivery", "grpo.trainer.training_step", "grpo.trainer.saving"} <= trainer
    assert not trainer & {"sampling_worker", "grpo.workers.sampler", "grpo.sampler.sampling_step",
                          "grpo.sampler.rollout.hf_engine", "grpo.sampler.rollout.vllm_engine", "grpo.rewards.sandbox"}


def test_each_declared_choice_list_is_what_its_implementing_module_offers():
    """The settings declare each choice (grpo/settings): a list that a module below the settings
    implements (a registry of names) agrees with it, so a name added to one and not the other fails
    here; every other list is defined once, in grpo/settings/choices.py, and imported where used."""
    from grpo.common.model_files import DTYPES
    from grpo.data.problems import ANSWER_FORMATS
    from grpo.environments.tool_calls import PARSERS
    from grpo.model.loading import TEMPLATES
    from grpo.rewards.registry import ON_FAILURE
    from grpo.sampler.rollout import ENGINES
    from grpo.settings import SHIPPED_CHAT_TEMPLATES, TRANSPORT_SCHEMES, choices
    from grpo.weights import CHANNELS
    from grpo.wire.transport import TRANSPORTS

    implemented = {"model.dtype": tuple(DTYPES), "sampling.dtype": ("auto", *DTYPES),
                   "data.answer_format": ANSWER_FORMATS, "sampling.engine": tuple(ENGINES),
                   "env.tool_parser": tuple(PARSERS), "rewards.on_failure": ON_FAILURE,
                   "weights.channel": tuple(CHANNELS)}
    for key, offered in implemented.items():
        assert choices_of(Config, key) == offered, key
    assert SHIPPED_CHAT_TEMPLATES == tuple(TEMPLATES) and TRANSPORT_SCHEMES == tuple(TRANSPORTS)
    declared = {"sampling.old_logps": choices.OLD_LOGPS_SOURCES, "training.aggregation": choices.AGGREGATIONS,
                "training.kl_estimator": choices.KL_ESTIMATORS, "training.importance_sampling": choices.IS_MODES,
                "training.advantage_scale": choices.ADVANTAGE_SCALES, "training.lr_schedule": choices.SCHEDULES,
                "logging.backend": choices.TRACKERS, "logging.wandb_mode": choices.WANDB_MODES,
                "env.network": choices.NETWORK_MODES, "rewards.network": choices.NETWORK_MODES}
    for key, listed in declared.items():
        assert choices_of(Config, key) is listed, key
    from grpo.objective.advantages import ESTIMATORS
    from grpo.objective.losses import LOSSES

    # training.advantage and training.loss also take an import path, so they are checked by the config's rules
    assert choices.ADVANTAGE_ESTIMATORS == ("grpo", *ESTIMATORS) and choices.POLICY_LOSSES == tuple(LOSSES)


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


REST_OF_GRPO = tuple(f"grpo.{name}" for name in ("agent", "api", "cli", "commands", "config", "environments", "model",
                                                  "objective", "run", "sampler", "settings", "trainer", "weights",
                                                  "wire", "workers"))


def test_the_packages_import_one_way():
    """The rest of grpo uses grpo.rewards, grpo.data and grpo.common; grpo.rewards uses grpo.data and
    grpo.common; grpo.data uses grpo.common; grpo.common none of them."""
    assert imports_between("grpo/common", ("grpo.rewards", "grpo.data") + REST_OF_GRPO) == {}
    assert imports_between("data", ("grpo.rewards",) + REST_OF_GRPO) == {}
    assert imports_between("rewards", REST_OF_GRPO) == {}
    assert imports_between("grpo/sampler", ("grpo.rewards",))  # the check above sees imports (it is not vacuous)


def test_the_config_stands_at_the_foundation():
    """Loading, the typed tree and validation import nothing of the trainer above them: what a config
    names (rewards, environments, tools, templates) is imported by grpo/run/preflight.py."""
    above = ("grpo.sampler", "grpo.trainer", "grpo.wire", "grpo.weights", "grpo.model", "grpo.objective",
             "grpo.environments", "grpo.run", "grpo.workers", "grpo.commands", "grpo.api", "grpo.rewards")
    assert imports_between("grpo/settings", above + ("grpo.config",)) == {}
    assert imports_between("grpo/config", above) == {  # whether a reward name is a service's
        "grpo/config/rules.py": {"grpo.rewards.services", "grpo.rewards.services.is_service_name"}}
    assert imports_between("grpo/run", ("grpo.config",))  # the check above sees imports (it is not vacuous)


def test_the_wire_imports_neither_the_objective_nor_the_model_and_they_not_the_wire():
    assert imports_between("grpo/wire", ("grpo.objective", "grpo.model", "grpo.trainer", "grpo.sampler")) == {}
    assert imports_between("grpo/objective", ("grpo.wire",)) == {}
    assert imports_between("grpo/model", ("grpo.wire",)) == {}


def test_each_seam_names_implementations_that_give_its_interface():
    """The registries of docs/architecture.md: every name's implementation has what its seam calls."""
    import importlib
    import inspect

    from grpo.commands.launchers import LAUNCHERS
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
    for name, module in LAUNCHERS.items():
        launcher = importlib.import_module(module)
        assert list(inspect.signature(launcher.launch).parameters) == ["options", "cfg", "args", "dry_run"], name
        assert callable(launcher.take_options) and launcher.OPTIONS_HELP.startswith("  --"), name
        assert all(flag.startswith("--") and flag in launcher.OPTIONS_HELP for flag in launcher.FLAGS), name


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


def test_an_engine_is_one_line_in_each_table_and_the_config_reads_its_traits(monkeypatch):
    """A new engine joins with its import path (ENGINES) and its traits (ENGINE_TRAITS, whose names are
    sampling.engine's choices): the config's rules read what it supports, with nothing else to edit."""
    import grpo.settings.engines as engines
    from grpo.config import load_config
    from grpo.sampler.rollout import ENGINES
    from grpo.settings.tree import ConfigError

    assert tuple(ENGINES) == engines.ENGINE_NAMES == choices_of(Config, "sampling.engine")
    traits = {**engines.ENGINE_TRAITS, "hf": engines.EngineTraits(adapter_extras=False, stop_with_in_flight=False)}
    monkeypatch.setattr("grpo.config.rules.ENGINE_TRAITS", traits)  # the HF engine, as if it served no DoRA
    with pytest.raises(ConfigError, match=r"sampling.engine=hf cannot serve an adapter with lora.use_dora=true"):
        load_config(None, ["lora.use_dora=true"])
    with pytest.raises(ConfigError, match=r"sampling.stop with sampling.in_flight_updates on hf"):
        load_config(None, ["sampling.stop=[x]", "sampling.in_flight_updates=true"])


def test_a_launcher_is_one_line_in_its_table(monkeypatch, capsys):
    """A new launcher joins with its module and one line in LAUNCHERS: `grpo train --<name>` hands it its
    own flags and the loaded config, `grpo train --help` shows its flags, and two launchers are refused."""
    import types

    from grpo.commands.launchers import LAUNCHERS
    from grpo.commands.train import main

    launched = []
    dummy = types.ModuleType("dummy_launcher")
    dummy.OPTIONS_HELP = "  --dummy         start the run nowhere (--region R)"
    dummy.FLAGS = ("--region",)
    dummy.take_options = lambda argv: ({"region": argv[argv.index("--region") + 1]},
                                       argv[:argv.index("--region")] + argv[argv.index("--region") + 2:])
    dummy.launch = lambda options, cfg, args, dry_run: (launched.append((options, cfg.training.steps, args, dry_run))
                                                        or 5)
    monkeypatch.setitem(sys.modules, "dummy_launcher", dummy)
    monkeypatch.setitem(LAUNCHERS, "dummy", "dummy_launcher")

    assert main(["--dummy", "--region", "eu", "--dry-run", "training.steps=3"]) == 5
    assert launched == [({"region": "eu"}, 3, ["training.steps=3"], True)]
    assert main(["--help"]) == 0
    assert "  --dummy         start the run nowhere (--region R)\n" in capsys.readouterr().out
    assert main(["--dummy", "--slurm", "--region", "eu"]) == 2
    assert capsys.readouterr().err == "error: --dummy and --slurm: a run has one launcher\n"
    assert main(["--region", "eu"]) == 2
    assert capsys.readouterr().err == ("error: --region is an option of grpo train --dummy, not of a run on this "
                                       "machine (grpo train without a launcher flag)\n")
    assert launched == [({"region": "eu"}, 3, ["training.steps=3"], True)]


def test_every_test_file_is_in_the_map_of_tests_readme():
    """tests/README.md maps each module to its test file: every file is there, and only files that exist."""
    import re

    listed = set(re.findall(r"^\| `(test_\w+\.py)` \|", (REPO / "tests" / "README.md").read_text(), re.M))
    assert listed == {path.name for path in (REPO / "tests").glob("test_*.py")}
