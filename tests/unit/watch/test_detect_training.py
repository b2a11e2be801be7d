"""Loss and gradient-norm rules: NaN/Inf, gradient-norm spikes, divergence with its first bad
step."""

import numpy as np
import pytest

from mscale.watch.judge import Watcher
from mscale.watch.sim import Injection, generate
from mscale.watch.window import SCALARS


def run(inject=(), steps=150, seed=1, edit=None):
    t = generate(8, tp=2, pp=1, ranks_per_node=4, steps=steps, seed=seed, inject=inject)
    window = t.window()
    if edit:
        edit(window)
    w = Watcher(t.layout)
    return w.feed(window), w


def test_grad_spike_once_per_burst_and_not_in_warm_up():
    fs, _ = run([Injection("grad_spike", 3), Injection("grad_spike", 60),
                 Injection("grad_spike", 61), Injection("grad_spike", 120)])
    spikes = [f for f in fs if f.kind == "grad_spike"]
    assert [f.first_step for f in spikes] == [60, 120]  # step 3 is warm-up; 60-61 one burst
    assert spikes[0].last_step == 61 and spikes[0].severity == "warning"
    assert spikes[0].evidence["ratio"] > 5 and "60" in spikes[0].message


def test_nan_and_inf():
    fs, w = run([Injection("nan", 90)])
    (f,) = fs
    assert f.kind == "nan" and f.severity == "critical" and f.first_step == 90
    assert set(f.evidence["fields"]) == {"loss", "grad_norm"} and "90" in f.message
    assert w.summary()["worst"] == "critical"

    def inf_grad(win):
        win.scalars[40, SCALARS.index("grad_norm")] = np.inf
    (f,) = run(edit=inf_grad)[0]
    assert f.first_step == 41 and f.evidence["fields"] == ["grad_norm"]

    def bad_timing(win):
        win.ranks[70, 1, 3] = np.nan
    (f,) = run(edit=bad_timing)[0]
    assert f.first_step == 71 and f.evidence["fields"] == ["per-rank timings"]


def test_a_field_the_trainer_never_reports_is_not_nan():
    def no_loss(win):
        win.scalars[:, SCALARS.index("loss")] = np.nan
    assert run(edit=no_loss)[0] == []


def test_divergence_names_the_first_bad_step_for_the_rollback():
    fs, _ = run([Injection("divergence", 80, magnitude=0.02)], steps=200)
    (f,) = fs
    assert f.kind == "divergence" and f.severity == "critical"
    assert 78 <= f.first_step <= 85 and f.evidence["first_bad_step"] == f.first_step
    assert f.evidence["detected_at"] > f.first_step
    assert f"before step {f.first_step}" in f.advice


def test_a_single_loss_spike_is_not_a_divergence():
    def blip(win):
        win.scalars[100:102, SCALARS.index("loss")] *= 3
    assert run(edit=blip, steps=200)[0] == []


@pytest.mark.parametrize("seed", [2, 3])
def test_healthy_training_is_quiet(seed):
    assert run(steps=600, seed=seed)[0] == []


def test_a_nan_findings_values_are_numbers_and_json_null_not_strings():
    """docs/watch.md: NaN and infinity are written as null; a finite value stays a number (jq
    `.evidence.grad_norm > 1` must work), not the string "nan" or "0.59"."""
    import io
    import json

    from mscale.watch import sinks
    from mscale.watch.config import WatchConfig
    from mscale.watch.detect.training import TrainingRules

    rules = TrainingRules(WatchConfig())
    rules.nan(1, {"loss": 2.0, "grad_norm": 1.0}, True)
    f = rules.nan(2, {"loss": float("nan"), "grad_norm": 0.59}, True)
    out = io.StringIO()
    sinks.write_jsonl(out, [f])
    ev = json.loads(out.getvalue())["evidence"]
    assert ev["loss"] is None and ev["grad_norm"] == 0.59 and ev["fields"] == ["loss"]
