"""Fake samplers (real sockets, real weights watching, generation replaced by a wait) feeding the
real trainer: the trainer idles less as samplers are added, as docs/scaling.md's model says."""

import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))
from simulate_scaling import predicted_step_s, simulate  # noqa: E402


def test_the_model_worked_numbers():
    # trainer-bound, sampler-bound and staleness-bound
    assert predicted_step_s(generate_s=1.0, train_s=2.0, latency_s=0.1, staleness=1, samplers=1) == 2.0
    assert predicted_step_s(generate_s=4.0, train_s=1.0, latency_s=0.0, staleness=3, samplers=2) == 2.0
    assert predicted_step_s(generate_s=4.0, train_s=1.0, latency_s=1.0, staleness=1, samplers=4) == 3.0


def test_the_trainer_idles_less_as_samplers_are_added(tmp_path, tiny_model_dir):
    runs = [simulate(n, generate_s=3.0, staleness=3, steps=14, ranks=1, model_dir=tiny_model_dir,
                     run_dir=tmp_path / f"run{n}") for n in (1, 2, 4)]
    idle = [r["idle"] for r in runs]
    assert idle[0] > idle[1] > idle[2], runs
    for r in runs:
        assert r["staleness_max"] <= 3
        assert abs(r["step_s"] - r["predicted_step_s"]) < 0.3 * r["predicted_step_s"], r
