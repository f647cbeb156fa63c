"""The module boundaries docs/architecture.md describes, checked on the real imports."""

import subprocess
import sys

from grpo import objective
from grpo.config import option_lists
from grpo.model import loading as models, logprobs
from grpo.sampler import rollout
from conftest import REPO

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
    assert not sampler & {"training_worker", "grpo.trainer.step", "grpo.trainer.outputs"}
    trainer = imported_by("training_worker", "sampling_worker")
    assert {"grpo.wire.delivery", "grpo.trainer.step", "grpo.trainer.outputs"} <= trainer
    assert not trainer & {"sampling_worker", "grpo.sampler.step", "grpo.sampler.rollout.hf_engine",
                          "grpo.sampler.rollout.vllm_engine", "rewards.sandbox"}


def test_each_choice_is_validated_against_the_list_its_implementing_module_owns():
    lists = option_lists()
    assert lists["training.aggregation"] is objective.AGGREGATIONS
    assert lists["training.kl_estimator"] is objective.KL_ESTIMATORS
    assert lists["training.advantage_scale"] is objective.ADVANTAGE_SCALES
    assert lists["sampling.engine"] is rollout.ENGINES
    assert lists["sampling.old_logps"] is logprobs.OLD_LOGPS_SOURCES
    assert lists["model.dtype"] == tuple(models.DTYPES)
