"""`mscale plan --calibrate`: hand-written preflight.json and metrics.jsonl files replace the
datasheet rates; bad files are refused with the file and the field."""

import json

import pytest

from mscale.config import ClusterConfig, LayoutConfig, ModelConfig, TrainingConfig
from mscale.config.vectors import encode_vector
from mscale.errors import MscaleError
from mscale.planner.calibrate import fit_speed, load_calibration
from mscale.planner.cost import Problem, evaluate
from mscale.planner.kernels import gemm_efficiency

from tests.conftest import PLANS

GPT = ["--cluster", str(PLANS / "clusters" / "a100-12288.yaml"),
       "--model", str(PLANS / "models" / "gpt-175b.yaml"),
       "--training", str(PLANS / "training" / "gpt-175b.yaml")]
LAYOUT = ["--tp", "8", "--pp", "8", "--vpp", "6", "--micro-batch", "1", "--zero", "1",
          "--recompute", "full"]


def preflight(tmp_path, gemm=180.0, tp_bus=200.0, dp_bus=20.0):
    doc = {"schema_version": 1, "world": 16, "layout": {"tp": 8, "pp": 1, "dp": 2},
           "results": [], "status": "OK",
           "measured": {"gemm_tflops": {"median": gemm, "min": gemm * 0.97, "dtype": "bf16",
                                        "n": 8192},
                        "busbw_gbps": {"tp": {"allgather": tp_bus, "reduce_scatter": tp_bus * 1.1},
                                       "dp": {"allreduce": dp_bus}},
                        "p2p_gbps": {"pp": {"p2p": 15.0}}}}
    f = tmp_path / "preflight.json"
    f.write_text(json.dumps(doc))
    return f


def metrics(tmp_path, step_s: float, steps: int = 12, ranks: int = 2):
    """A run's metrics: ``ranks`` 2 as plain lists; more (a run of the GPT cluster's 12,288
    GPUs) as schema-2 vectors, which train writes from 1,024 ranks on."""
    lines = []
    for s in range(1, steps + 1):
        t = step_s * (3 if s <= 5 else 1)  # warm-up steps are slower and must be left out
        vec = {"step_time": [t * 0.99] + [t] * (ranks - 1), "compute_time": [t] * ranks,
               "comm_wait": [0] * ranks, "data_time": [0] * ranks}
        if ranks > 2:
            vec = {k: encode_vector(v, "<f8", 1, "zstd") for k, v in vec.items()}
        lines.append(json.dumps({"schema_version": 1 if ranks <= 2 else 2, "step": s,
                                 "loss": 2.0, "grad_norm": 1.0, "clip_threshold": 1.0,
                                 "lr": 1e-4, "tokens": 1, "tokens_per_s": 1, **vec,
                                 "extra": {"gc": True} if s == 9 else {}}))
    f = tmp_path / "metrics.jsonl"
    f.write_text("\n".join(lines) + "\n")
    return f


def gpt_problem(**kw) -> Problem:
    from mscale.config.base import load_model
    return Problem(load_model(ModelConfig, PLANS / "models" / "gpt-175b.yaml"),
                   load_model(TrainingConfig, PLANS / "training" / "gpt-175b.yaml"),
                   load_model(ClusterConfig, PLANS / "clusters" / "a100-12288.yaml"), **kw)


def test_preflight_replaces_gemm_and_link_rates(tmp_path):
    cal = load_calibration([str(preflight(tmp_path))])
    pb = gpt_problem(calibration=cal)
    dev = pb.device
    # the model now reproduces the measured GEMM at the measured shape
    assert float(gemm_efficiency(dev, 8192, 8192, 8192)) * 312 == pytest.approx(180.0)
    assert pb.links.fast == 200e9 and pb.links.nic == 20e9 and pb.links.inter_pod <= 15e9
    lo = LayoutConfig(tp=8, pp=8, dp=192, vpp=6, sequence_parallel=True, recompute="full")
    slower = evaluate(pb, lo)
    datasheet = evaluate(gpt_problem(), lo)
    assert slower.step_time > datasheet.step_time and slower.t_model > datasheet.t_model


def test_metrics_step_time_is_reproduced(tmp_path):
    cal = load_calibration([str(metrics(tmp_path, 12.0))])
    assert cal.step_time_s == pytest.approx(12.0)  # warm-up and the GC step left out
    lo = LayoutConfig(tp=8, pp=8, dp=192, vpp=6, sequence_parallel=True, recompute="full")
    fit_speed(cal, lambda c: evaluate(gpt_problem(calibration=c), lo).step_time)
    assert evaluate(gpt_problem(calibration=cal), lo).step_time == pytest.approx(12.0, rel=1e-3)
    assert cal.speed < 1


def test_cli_calibrates_and_says_from_what(cli, tmp_path):
    pf, mt = preflight(tmp_path), metrics(tmp_path, 12.0, ranks=12288)
    code, out, err = cli("plan", *GPT, *LAYOUT, "--calibrate", str(pf), "--calibrate", str(mt),
                         "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["stack"] == "mscale" and len(doc["calibration"]) == 3
    assert doc["given"]["cost"]["step_time"] == pytest.approx(12.0, rel=1e-3)


def test_a_cpu_preflight_is_refused_for_a_gpu_cluster(cli, tmp_path):
    """Its fp32 GEMM at 0.09 TFLOP/s made a GPU plan predict minutes a step, exit 0."""
    pf = preflight(tmp_path, gemm=0.09)
    doc = json.loads(pf.read_text())
    doc["measured"]["gemm_tflops"]["dtype"] = "float32"
    pf.write_text(json.dumps(doc))
    code, _, err = cli("plan", *GPT, "--calibrate", str(pf))
    assert code == 3 and "Traceback" not in err, err
    assert f"{pf}: measured.gemm_tflops.dtype: its GEMM ran in float32 (preflight on CPUs)" in err


def test_a_cpu_preflight_calibrates_a_cpu_cluster(cli, tmp_path):
    """The CPU flow of docs/preflight.md: a 2-core preflight's fp32 GEMM (0.1 TFLOP/s at n=384)
    is a rate the cpu preset's roofline can reach, so the plan is calibrated from it (the
    preset's memory bandwidth was 0.67 GB/s, which no measured CPU GEMM fits under)."""
    pf = preflight(tmp_path, gemm=0.1024)
    doc = json.loads(pf.read_text())
    doc["measured"]["gemm_tflops"].update(dtype="float32", n=384)
    pf.write_text(json.dumps(doc))
    cpu = ["--cluster", str(PLANS / "clusters" / "cpu-4x2.yaml"), "--model",
           str(PLANS / "models" / "tiny.yaml"), "--training",
           str(PLANS / "training" / "cpu-demo.yaml")]
    code, out, err = cli("plan", *cpu, "--calibrate", str(pf), "--json")
    assert code == 0, err
    assert json.loads(out)["calibration"], out


def test_a_runs_step_time_is_not_fitted_to_another_dp(cli, tmp_path):
    """--layout's dp is derived for the cluster given; a run's metrics were measured at its
    own dp: fitting one to the other is refused, not silently wrong."""
    layout = tmp_path / "ran.yaml"
    layout.write_text("tp: 8\npp: 8\nvpp: 6\ndp: 96\nmicro_batch: 1\nzero_stage: 1\n"
                      "recompute: full\n")  # the run had half of this cluster's GPUs
    code, _, err = cli("plan", *GPT, "--layout", str(layout), "--calibrate",
                       str(metrics(tmp_path, 12.0)))
    assert code == 3 and "the run ran at dp=96, this cluster's layout has dp=192" in err, err


def test_a_runs_step_time_is_not_fitted_to_a_job_of_another_size(cli, tmp_path):
    """A 4-process CPU run's 0.22 s a step, fitted to 1,024 H100s at the layout of
    plans/llama-70b-h100-1024.yaml (its dp agreed), made every kernel rate 3.3 million times
    faster and the plan predict 156% MFU, exit 0. A mixed file (a re-plan) is refused too."""
    plan = PLANS / "llama-70b-h100-1024.yaml"
    llama = ["--cluster", str(PLANS / "clusters" / "h100-1024.yaml"),
             "--model", str(PLANS / "models" / "llama-70b.yaml"),
             "--training", str(PLANS / "training" / "llama-70b.yaml")]
    mt = metrics(tmp_path, 0.22, ranks=4)
    code, _, err = cli("plan", *llama, "--layout", str(plan), "--calibrate", str(mt))
    assert code == 3 and "Traceback" not in err, err
    assert (f"{mt}: step_time: the run had 4 ranks, the layout it is fitted to has 1024 "
            "(tp·pp·dp)") in err, err
    lines = metrics(tmp_path, 1.0).read_text().splitlines()
    lines[-1] = lines[-1].replace('"step_time": [0.99, 1.0]', '"step_time": [0.99, 1.0, 1.0]')
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join(lines) + "\n")
    with pytest.raises(MscaleError, match="its records have 2 and 3 ranks"):
        load_calibration([str(mixed)])


def test_metrics_without_a_layout_is_refused(cli, tmp_path):
    code, _, err = cli("plan", *GPT, "--calibrate", str(metrics(tmp_path, 12.0)))
    assert code == 3 and "--layout" in err and "Traceback" not in err


@pytest.mark.parametrize("text, message", [
    ('{"measured": {"gemm_tflops": {"median": -3}}}', "positive"),
    ('{"world": 8}', "no 'measured'"),
    ('{"measured": {}}', "nothing the planner can use"),
    ("", "empty"),
    ('{"step": 1, "step_time": "x"}\n{"step": 2}\n', "step_time"),
])
def test_bad_calibration_files(tmp_path, text, message):
    f = tmp_path / "bad.json"
    f.write_text(text)
    with pytest.raises(MscaleError, match=message) as e:
        load_calibration([str(f)])
    assert e.value.file == str(f)


def test_two_files_of_one_kind_are_refused(tmp_path):
    """Two preflight reports mixed field by field (the second's GEMM, the first's bandwidths
    where the second had none), and the console said both were applied."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = preflight(tmp_path / "a"), preflight(tmp_path / "b", gemm=100.0)
    with pytest.raises(MscaleError, match="a preflight report again") as e:
        load_calibration([str(first), str(second)])
    assert e.value.file == str(second) and str(first) in e.value.message
    with pytest.raises(MscaleError, match="metrics.jsonl again"):
        load_calibration([str(metrics(tmp_path / "a", 12.0)), str(metrics(tmp_path / "b", 9.0))])
    both = load_calibration([str(first), str(metrics(tmp_path, 12.0))])  # one of each: fine
    assert both.gemm_tflops == 180.0 and both.step_time_s == pytest.approx(12.0)


def test_cli_stack_option(cli):
    code, out, err = cli("plan", *GPT, "--stack", "megatron-lm", "--json", "--top", "1")
    assert code == 0, err
    assert json.loads(out)["stack"] == "megatron-lm"
    code, _, err = cli("plan", *GPT, "--stack", "nope")
    assert code == 3 and "unknown stack" in err


def test_a_real_h200_run_is_reproduced():
    """bench/data/h200_gpu1b_metrics.jsonl: plans/gpu-1b-h200.yaml trained 20 steps on one H200
    (2026-11). Uncalibrated, the mscale profile predicts two thirds of its step time less the
    0.185 s it waited for data (docs/plan.md, "This engine on one H200"); calibrated, the model
    reproduces the 0.532 s it worked."""
    from mscale.config.base import load_model
    from mscale.config.plan import Plan
    from tests.conftest import REPO
    plan = load_model(Plan, PLANS / "gpu-1b-h200.yaml")
    cal = load_calibration([str(REPO / "bench" / "data" / "h200_gpu1b_metrics.jsonl")])
    assert cal.step_time_s == pytest.approx(0.532, abs=0.005)  # 0.716 s, less the data wait

    def problem(c=None):  # an eager run: compiled blocks came later
        return Problem(plan.model, plan.training, plan.cluster, stack="mscale-eager",
                       calibration=c)

    raw = evaluate(problem(), plan.layout).step_time
    assert 0.3 < raw < 0.45  # the datasheet model is optimistic for this engine
    fit_speed(cal, lambda c: evaluate(problem(c), plan.layout).step_time)
    assert evaluate(problem(cal), plan.layout).step_time == pytest.approx(0.532, abs=0.005)
    assert 0.6 < cal.speed < 0.75


def test_the_data_wait_is_left_out_of_the_fitted_step(tmp_path):
    """The model prices compute and communication: a loader that fell behind (the first H200
    run waited 0.185 s a step for data) must not be read as slower kernels."""
    f = metrics(tmp_path, 12.0)
    recs = [json.loads(line) for line in f.read_text().splitlines()]
    for r in recs:
        r["step_time"] = [r["step_time"][0] + 2.5, r["step_time"][1] + 3.0]
        r["data_time"] = [2.5, 3.0]
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cal = load_calibration([str(f)])
    assert cal.step_time_s == pytest.approx(12.0)  # the slowest rank's step, less its own wait
    assert "data wait 3 s a step left out" in cal.sources[0]


def test_a_compact_record_is_read_as_the_lists_it_encodes(tmp_path):
    """From 1,024 ranks train writes each vector encoded (schema 2): calibrating on such a
    run's metrics once failed with 'no per-rank step_time list'."""
    from mscale.config.records import MetricsRecord

    lines = []
    for s in range(1, 13):
        t = 12.0 * (3 if s <= 5 else 1)
        rec = MetricsRecord(schema_version=2, step=s, loss=2.0, grad_norm=1.0, clip_threshold=1.0,
                            lr=1e-4, tokens=1, tokens_per_s=1.0, step_time=[t * 0.99, t + 1.0],
                            compute_time=[t, t], comm_wait=[0.0, 0.0], data_time=[0.0, 1.0])
        lines.append(rec.model_dump_json())
    assert '"step_time":{' in lines[0]  # encoded, not a list
    f = tmp_path / "metrics.jsonl"
    f.write_text("\n".join(lines) + "\n")
    cal = load_calibration([str(f)])
    assert cal.step_time_s == pytest.approx(12.0, rel=1e-3)


def test_a_gemm_figure_the_roofline_cannot_reach_names_the_report(cli, tmp_path):
    """The refusal names the preflight report it came from, as every bad-input error does."""
    pf = preflight(tmp_path)
    doc = json.loads(pf.read_text())
    doc["measured"]["gemm_tflops"]["n"] = 64  # 180 TFLOP/s on a 64×64×64 GEMM: memory-bound
    pf.write_text(json.dumps(doc))
    code, _, err = cli("plan", *GPT, "--calibrate", str(pf))
    assert code == 3 and "Traceback" not in err, err
    assert err.startswith(f"error: {pf}: measured.gemm_tflops: 180 TFLOP/s at n=64"), err
