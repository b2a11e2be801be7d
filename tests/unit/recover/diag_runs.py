"""Fabricated run directories for the diagnosis tests, in the shapes the real writers produce.

The records copy what `mscale train --local 4` wrote when a rank was killed, stopped (SIGSTOP),
fed a NaN, halted and finished (train/job_watch.py's stop/hang events, train/failure.py's error
files, train/loop.py's start/stop/nan events, watch/actions.py's findings), with times chosen by
the test so that attempts can be told apart. ``run`` is a fixture (an empty `Run`): a module
imports it by name, as recover's tests hold runs of several shapes, each module's own ``run``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.conftest import PLANS

T0 = 1_796_000_000.0
"""A fixed epoch for fabricated times."""

GLOO_RESET = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537]"
              " Read error [127.0.0.1]:45453: Connection reset by peer. This is typically caused by"
              " a remote worker hanging or bugs in the application.")
GLOO_CLOSED = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]"
               " Connection closed by peer [127.0.0.1]:4273. This is typically caused by a remote"
               " worker crashing.")
GLOO_TIMEOUT = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                "unbound_buffer.cc:78] Timed out waiting 4000ms for recv operation to complete")
MSCALE_FRAMES = (
    'Traceback (most recent call last):\n'
    '  File "/work/main/src/mscale/train/worker.py", line 45, in run_worker\n'
    '    code = train(plan, options, env)\n'
    '  File "/work/main/src/mscale/train/loop.py", line 145, in _loop\n'
    '    result = train_step(engine, step, timer)\n'
    '  File "/work/main/src/mscale/parallel/data.py", line 240, in finish\n'
    '    h.wait()\n')


class Run:
    """One fabricated run directory: a plan of 4 ranks on node1..node2 (2 per node)."""

    def __init__(self, root: Path, nodes: str = "node[1-2]", tp: int = 2, dp: int = 2,
                 gpus_per_node: int = 2):
        self.root = root
        (root / "logs").mkdir(parents=True, exist_ok=True)
        data = yaml.safe_load((PLANS / "cpu-tiny.yaml").read_text())
        data["cluster"]["hostlist"] = nodes
        data["cluster"]["gpus_per_node"] = gpus_per_node
        data["layout"].update({"tp": tp, "pp": 1, "dp": dp})
        (root / "plan.yaml").write_text(yaml.safe_dump(data))
        self.path = str(root)

    def event(self, kind: str, t: float, source: str = "train", **fields) -> dict:
        rec = {"schema_version": 1, "time": T0 + t, "source": source, "kind": kind,
               "severity": fields.pop("severity", "info"), "ranks": fields.pop("ranks", []),
               "nodes": fields.pop("nodes", []), "message": fields.pop("message", ""),
               "evidence": fields.pop("evidence", {}), **fields}
        with open(self.root / "events.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        return rec

    def start(self, t: float, attempt: int = 1, run_id: str | None = None,
              launcher: str = "local", launch: dict | None = None) -> str:
        run_id = run_id or f"local-{attempt:04d}"
        evidence = {"run_id": run_id, "attempt": attempt, "launcher": launcher,
                    "layout": {"tp": 2, "pp": 1, "dp": 2}, "device": "cpu"}
        if launch is not None:
            evidence["launch"] = launch
        self.event("start", t, message=f"training cpu-tiny on 4 processes ({launcher})",
                   evidence=evidence)
        return run_id

    def finish(self, t: float, code: int, step: int, run_id: str, reason: str | None = None,
               signal: str | None = None):
        evidence = {"code": code, "last_step": step, "run_id": run_id}
        if reason:
            evidence["reason"] = reason
        if signal:
            evidence["signal"] = signal
        return self.event("stop", t, step=step, severity="info" if code == 0 else "warning",
                          message=f"training process exited with code {code}"
                                  + (f" ({reason})" if reason else ""), evidence=evidence)

    def launcher_stop(self, t: float, run_id: str, first: int, how: str, kind: str,
                      returncodes: list, timed_out=(), stopped=(), hang: list | None = None):
        """job_watch.record_failure's event: ``stop`` naming the first failed rank, or ``hang``
        naming the hung ranks."""
        evidence = {"run_id": run_id, "first_failed_rank": first, "how": how, "kind": kind,
                    "returncodes": returncodes, "alive_at_failure": list(stopped),
                    "stopped_at_failure": list(stopped), "timed_out": list(timed_out),
                    "error_files": {}, "logs": f"{self.path}/logs"}
        ranks = hang if hang is not None else [first]
        nodes = [f"node{r // 2 + 1}" for r in ranks]
        return self.event("hang" if hang is not None else "stop", t, severity="critical",
                          ranks=ranks, nodes=nodes, message=f"failed: rank {first} {how}",
                          evidence=evidence)

    def error_file(self, rank: int, t: float, kind: str, message: str,
                   traceback: str | None = None, node: str = "vm") -> None:
        exc = message.split(":", 1)[0]
        rec = {"rank": rank, "node": node, "time": T0 + t, "kind": kind, "exception": exc,
               "message": message, "traceback": traceback or (MSCALE_FRAMES + message + "\n")}
        (self.root / "logs" / f"rank{rank}.error.json").write_text(json.dumps(rec, indent=1))

    def log(self, rank: int, text: str, t: float | None = None) -> Path:
        path = self.root / "logs" / f"rank{rank}.log"
        path.write_text(text)
        if t is not None:
            os.utime(path, (T0 + t, T0 + t))
        return path

    def file(self, rel: str, text: str | bytes, t: float | None = None) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        if t is not None:
            os.utime(path, (T0 + t, T0 + t))
        return path

    def metrics(self, steps: range, t: float = 0.0) -> None:
        with open(self.root / "metrics.jsonl", "a") as f:
            for s in steps:
                f.write(json.dumps({"schema_version": 1, "step": s, "time": T0 + t + s,
                                    "loss": 5.0, "grad_norm": 0.8, "clip_threshold": 1.0,
                                    "lr": 1e-4, "tokens": 1024, "tokens_per_s": 3000.0,
                                    "step_time": [0.3] * 4, "compute_time": [0.2] * 4,
                                    "comm_wait": [0.05] * 4, "data_time": [0.01] * 4}) + "\n")


@pytest.fixture
def run(tmp_path) -> Run:
    """An empty run directory of the cpu-tiny plan to write a failure into."""
    return Run(tmp_path / "run")


def started(run: Run, steps: int = 3) -> str:
    """Attempt 1 started and recorded ``steps`` steps; returns its run id."""
    rid = run.start(0.0)
    run.metrics(range(1, steps + 1), t=1.0)
    return rid
