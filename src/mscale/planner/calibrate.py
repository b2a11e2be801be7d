"""``mscale plan --calibrate FILE``: measured rates in place of datasheet ones.

Two kinds of measurement, told apart by their content:

- a ``preflight.json`` (config/preflight.py, `PreflightReport.measured`): the GEMM TFLOP/s each
  device reached on an n×n×n bf16 GEMM sets the GEMM ceiling (the model's efficiency at that
  shape then equals the measurement); bus bandwidth of the ``tp`` group's all-gather /
  reduce-scatter replaces the fast-domain bandwidth, the ``dp`` group's the per-GPU NIC share,
  the ``pp`` pairs' p2p bandwidth the inter-pod share too when lower (GB/s busbw as nccl-tests
  defines it, already an achieved rate: LINK_EFFICIENCY is not applied again).
- a run's ``metrics.jsonl`` (config/records.py, `MetricsRecord`) with the layout it ran (the given
  layout, ``--layout plan.yaml``): the median step time, warm-up and flagged (GC, checkpoint)
  steps left out, scales every kernel rate by one factor so that the model reproduces it. The
  step is each rank's ``step_time`` less its ``data_time``: the model prices compute and
  communication, and a loader that fell behind is not the kernels' doing.

Both may be given; preflight is applied first, then the step-time factor on top.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field

from mscale.config.json_reader import parse_json
from mscale.config.files import read_text
from mscale.config.vectors import decode_vector, is_encoded
from mscale.errors import MscaleError
from mscale.planner.comm import Links
from mscale.planner.kernels import Device, gemm_ceiling_for

WARMUP_STEPS = 5
"""Leading steps of a run left out of its median step time (allocator, compilation, caches)."""
MAX_METRICS_BYTES = 256 << 20
"""Largest metrics.jsonl read (~10^5 steps at 12,288 ranks in the compact encoding)."""


@dataclass
class Calibration:
    """Measured values; None keeps the datasheet figure. Applied by cost.Problem."""

    gemm_tflops: float | None = None
    """Median GEMM TFLOP/s per device (preflight), at ``gemm_n``."""
    gemm_n: int = 8192
    gemm_dtype: str | None = None
    """The element type the GEMM ran in, as preflight names it (``bfloat16`` on GPUs,
    ``float32`` on CPUs): `check_matches` refuses a rate of the other kind of machine."""
    tp_gb_per_s: float | None = None
    dp_gb_per_s: float | None = None
    pp_gb_per_s: float | None = None
    step_time_s: float | None = None
    """Measured median step time of ``layout`` (metrics.jsonl)."""
    ranks: int | None = None
    """How many ranks the measured run had (its per-rank vectors' length): `check_world`
    refuses a run of another size than the layout it is fitted to."""
    metrics_source: str | None = None
    """The metrics.jsonl ``step_time_s`` came from (the file `check_world`'s refusal names)."""
    speed: float = 1.0
    """Factor on every kernel rate, solved by `fit_speed` from ``step_time_s``."""
    sources: list[str] = field(default_factory=list)
    """What was read, for the report: one line per file."""
    gemm_source: str | None = None
    """The preflight report the GEMM figure came from."""

    def device(self, dev: Device) -> Device:
        """``dev`` with measured rates."""
        if self.gemm_tflops is not None:
            try:
                ceiling = gemm_ceiling_for(dev, self.gemm_n, self.gemm_tflops)
            except ValueError as e:
                raise MscaleError(str(e), file=self.gemm_source, field="measured.gemm_tflops",
                                  fix="check the preflight report's GEMM figure and its n, and "
                                      "that it was measured on this cluster's kind of device"
                                  ) from None
            dev = dataclasses.replace(dev, gemm_max=ceiling)
        if self.speed != 1.0:
            dev = dataclasses.replace(dev, gemm_max=dev.gemm_max * self.speed,
                                      hbm=dev.hbm * self.speed,
                                      attention_scale=dev.attention_scale * self.speed)
        return dev

    def links(self, links: Links) -> Links:
        """``links`` with measured bandwidths (bytes/s)."""
        upd = {}
        if self.tp_gb_per_s:
            upd["fast"] = self.tp_gb_per_s * 1e9
        if self.dp_gb_per_s:
            upd["nic"] = self.dp_gb_per_s * 1e9
        if self.pp_gb_per_s:
            upd["inter_pod"] = min(links.inter_pod, self.pp_gb_per_s * 1e9)
        return dataclasses.replace(links, **upd) if upd else links


PRECISION_OF = {"bfloat16": "bf16", "bf16": "bf16", "float32": "fp32", "fp32": "fp32",
                "float16": "fp16", "fp16": "fp16"}
"""Preflight's GEMM element type → the training precision it measures."""


def check_matches(cal: Calibration, gpu: str) -> None:
    """Refuse a GEMM rate measured on another kind of machine than the cluster's: preflight runs
    its GEMM in bf16 on GPUs and fp32 on CPUs, so a CPU report (0.09 TFLOP/s) given for an H100
    cluster made a 13B plan predict 414 s a step and rank another layout first, without a word."""
    if cal.gemm_dtype is None:
        return
    measured = PRECISION_OF.get(cal.gemm_dtype.lower())
    want = "fp32" if gpu.lower().startswith("cpu") else "bf16"  # "cpu", or a spec "cpu-..."
    if measured != want:
        where = "CPUs" if measured == "fp32" else "GPUs"
        raise MscaleError(f"its GEMM ran in {cal.gemm_dtype} (preflight on {where}); a "
                          f"{gpu} cluster's rate is measured in {want}", file=cal.gemm_source,
                          field="measured.gemm_tflops.dtype",
                          fix="calibrate with a preflight run on this cluster's own nodes")


def check_world(cal: Calibration, world: int) -> None:
    """Refuse a run's step time measured at another number of ranks than the layout it is fitted
    to: a 4-process CPU run's 0.22 s, fitted to 1,024 H100s, made every kernel rate 3.3 million
    times faster and the plan predict 156% MFU, exit 0."""
    if cal.ranks is not None and cal.ranks != world:
        raise MscaleError(f"the run had {cal.ranks} ranks, the layout it is fitted to has "
                          f"{world} (tp·pp·dp): its step time measures another job",
                          file=cal.metrics_source, field="step_time",
                          fix="calibrate with the metrics.jsonl of a run of this cluster's "
                              "size, with that run's layout (--layout RUN/plan.yaml)")


def load_calibration(paths: list[str]) -> Calibration:
    """Read every file (preflight.json or metrics.jsonl) into one Calibration."""
    cal = Calibration()
    seen: dict[str, str] = {}  # kind → the file of that kind already read
    for path in paths:
        text = read_text(path, limit=MAX_METRICS_BYTES)
        first = text.lstrip()[:1]
        if not first:
            raise MscaleError("empty calibration file", file=path,
                              fix="give a preflight.json or a run's metrics.jsonl")
        lines = [ln for ln in text.split("\n") if ln.strip()]  # JSONL: "\n" ends a record
        metrics = len(lines) > 1 and lines[0].lstrip().startswith("{") and '"step"' in lines[0]
        _one_of_a_kind(seen, "a run's metrics.jsonl" if metrics else "a preflight report", path)
        if metrics:
            _read_metrics(cal, lines, path)
        else:
            _read_preflight(cal, parse_json(text, path), path)
    return cal


def _one_of_a_kind(seen: dict[str, str], kind: str, path: str) -> None:
    """Refuse a second file of a kind: each overwrote the first's figures field by field (a
    GEMM from one preflight, bandwidths from another), while the console named both as
    applied."""
    if kind in seen:
        raise MscaleError(f"{kind} again: {seen[kind]} was given first, and the two would mix "
                          "their figures", file=path, field="--calibrate",
                          fix="give one preflight.json and/or one metrics.jsonl")
    seen[kind] = path


def _number(value, path: str, field_name: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and value <= 0):
        raise MscaleError(f"{field_name} must be a positive number, got {value!r}", file=path,
                          field=field_name, fix="give the measured value (see config/preflight.py)")
    return float(value)


def _read_preflight(cal: Calibration, doc, path: str) -> None:
    if not isinstance(doc, dict) or not isinstance(doc.get("measured"), dict):
        raise MscaleError("not a preflight report: no 'measured' mapping", file=path,
                          field="measured", fix="give the preflight.json that `mscale preflight` "
                          "wrote, or a run's metrics.jsonl")
    m = doc["measured"]
    used = []
    if "gemm_tflops" in m:
        g = m["gemm_tflops"] if isinstance(m["gemm_tflops"], dict) else {}
        cal.gemm_tflops = _number(g.get("median"), path, "measured.gemm_tflops.median")
        cal.gemm_n = int(_number(g.get("n", cal.gemm_n), path, "measured.gemm_tflops.n"))
        cal.gemm_dtype = str(g["dtype"]) if g.get("dtype") is not None else None
        cal.gemm_source = path
        used.append(f"GEMM {cal.gemm_tflops:g} TFLOP/s at n={cal.gemm_n}")
    bus = m.get("busbw_gbps", {}) if isinstance(m.get("busbw_gbps", {}), dict) else {}
    for kind, attr in (("tp", "tp_gb_per_s"), ("dp", "dp_gb_per_s")):
        ops = bus.get(kind)
        if isinstance(ops, dict):
            vals = [_number(ops[op], path, f"measured.busbw_gbps.{kind}.{op}")
                    for op in ("allgather", "reduce_scatter", "allreduce") if op in ops]
            if vals:
                setattr(cal, attr, min(vals))
                used.append(f"{kind} busbw {min(vals):g} GB/s")
    p2p = m.get("p2p_gbps", {})
    if isinstance(p2p, dict) and isinstance(p2p.get("pp"), dict) and p2p["pp"]:
        cal.pp_gb_per_s = min(_number(v, path, "measured.p2p_gbps.pp") for v in p2p["pp"].values())
        used.append(f"pp p2p {cal.pp_gb_per_s:g} GB/s")
    if not used:
        raise MscaleError("the preflight report measured nothing the planner can use", file=path,
                          field="measured", fix="run `mscale preflight` with the GEMM and network "
                          "checks (level quick or full)")
    cal.sources.append(f"{path}: " + ", ".join(used))


def _read_metrics(cal: Calibration, lines: list[str], path: str) -> None:
    times, waits, sizes = [], [], set()
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise MscaleError(f"line {i + 1} is not JSON: {e.msg}", file=path,
                              fix="give a metrics.jsonl written by `mscale train`") from None
        extra = rec.get("extra") if isinstance(rec, dict) else None
        step = _vector(rec, "step_time", i, path)
        if rec.get("step", 0) <= WARMUP_STEPS or (extra or {}).get("gc") \
                or (extra or {}).get("checkpoint"):
            continue
        sizes.add(len(step))
        data = _vector(rec, "data_time", i, path, required=False) or [0.0] * len(step)
        if any(t == t for t in step):
            # the model prices compute and communication, not a wait for input: a run whose
            # loader fell behind would otherwise make every kernel look slower than it is
            worked = [t - (min(d, t) if d == d else 0.0) for t, d in zip(step, data) if t == t]
            times.append(max(worked))  # synchronous training: the step ends with the last rank
            waits.append(max(t for t in step if t == t) - max(worked))
    if not times:
        raise MscaleError(f"no steps after the first {WARMUP_STEPS} to measure", file=path,
                          fix="give the metrics of a run that took more steps")
    if len(sizes) > 1:  # a re-plan in one file: the medians would mix two jobs
        raise MscaleError(f"its records have {' and '.join(map(str, sorted(sizes)))} ranks: "
                          "steps of jobs of different sizes", file=path, field="step_time",
                          fix="calibrate with the metrics of one attempt, at one size")
    cal.ranks, cal.metrics_source = sizes.pop(), path
    cal.step_time_s = statistics.median(times)
    wait = statistics.median(waits)
    left_out = f" (data wait {wait:.3g} s a step left out)" if wait >= 0.01 * cal.step_time_s \
        else ""
    cal.sources.append(f"{path}: median step {cal.step_time_s:.4g} s{left_out} over "
                       f"{len(times)} steps")


def _vector(rec: object, name: str, i: int, path: str, required: bool = True) -> list[float]:
    """A record's per-rank vector as a list of numbers, a version-2 record's encoded form
    (config/vectors.py, written from `COMPACT_MIN_RANKS` ranks on) decoded."""
    value = rec.get(name) if isinstance(rec, dict) else None
    if value is None and not required:
        return []
    if is_encoded(value):
        try:
            decoded = decode_vector(value, field=name)
        except MscaleError as e:
            raise MscaleError(f"line {i + 1}: {e.message}", file=path, field=name,
                              fix="give a metrics.jsonl written by `mscale train`") from None
        return decoded.tolist()  # NaN where the writer had no figure for a rank
    if not isinstance(value, list):
        raise MscaleError(f"line {i + 1} has no per-rank {name} list", file=path, field=name,
                          fix="give a metrics.jsonl written by `mscale train`")
    return [_number(v, path, name, positive=required) for v in value]


def fit_speed(cal: Calibration, step_of) -> None:
    """Solve ``cal.speed`` so that ``step_of(cal)`` (the given layout's predicted step time with
    this calibration) equals the measured step time. Compute scales as 1/speed and
    communication not at all, so a few fixed-point steps converge."""
    if cal.step_time_s is None:
        return
    for _ in range(8):
        predicted = step_of(cal)
        ratio = predicted / cal.step_time_s
        if abs(ratio - 1) < 1e-4:
            break
        cal.speed *= ratio
    cal.sources.append(f"kernel rates × {cal.speed:.3f} to reproduce the measured step time")
