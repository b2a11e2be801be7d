"""``mscale watch`` in-process on simulated traces: exit codes, the layout from flags or the run's
plan, --json/--jsonl/--prometheus/--report, acting on a run directory, and bad input (exit 3)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time

import pytest

from mscale.watch.sim import simulate

from tests.conftest import PLANS


def write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


FLAGS = ["--tp", "2", "--pp", "2", "--ranks-per-node", "4", "--hostlist", "gpu[1-4]"]


def trace(tmp_path, *inject, name="m.jsonl", world=16, rpn=4, steps=60):
    return write(tmp_path / name, simulate(world, tp=2, pp=2, ranks_per_node=rpn, steps=steps,
                                           seed=3, inject=inject))


def test_healthy_trace_exits_0_with_an_empty_verdict(cli, tmp_path):
    code, out, err = cli("watch", trace(tmp_path), "--once", "--json", *FLAGS)
    assert code == 0, out + err
    doc = json.loads(out)
    assert doc["exit_code"] == 0 and doc["findings"] == [] and doc["latest"]["step"] == 60


def test_slow_device_named_with_its_node_exit_1(cli, tmp_path):
    path = trace(tmp_path, {"cause": "slow_device", "step": 20, "target": 5})
    code, out, err = cli("watch", path, "--once", "--jsonl", *FLAGS)
    assert code == 1, out + err
    [line] = [json.loads(x) for x in out.splitlines()]
    assert line["kind"] == "straggler" and line["ranks"] == [5] and line["nodes"] == ["gpu2"]
    assert line["cause"] == "slow_device" and line["slowdown_pct"] > 5
    code, out, _ = cli("watch", path, "--once")  # no layout: every rank on its own, still named
    assert code == 1 and "rank 5" in out and out.startswith("step ")


def test_json_and_jsonl_together_are_refused(cli, tmp_path):
    """Both write stdout: the finding lines, then the document, in one stream that neither a
    JSON nor a JSONL reader could parse, exit 0."""
    code, out, err = cli("watch", trace(tmp_path), "--once", "--json", "--jsonl", *FLAGS)
    assert code == 3 and "Traceback" not in err, out + err
    doc = json.loads(out)  # --json on the line: the error is one JSON document too
    assert doc["error"]["field"] == "--jsonl" and "--json" in doc["error"]["message"]


def test_nan_is_critical(cli, tmp_path):
    code, out, _ = cli("watch", trace(tmp_path, {"cause": "nan", "step": 30}), "--once",
                       "--json", *FLAGS)
    doc = json.loads(out)
    assert code == 2 and doc["exit_code"] == 2
    assert [f["kind"] for f in doc["findings"]] == ["nan"]


@pytest.fixture
def run(tmp_path):
    """A finished run directory (no lock, a stop event) of the cpu-tiny plan, rank 3 slow."""
    run = tmp_path / "run"
    (run / "control").mkdir(parents=True)
    shutil.copy(PLANS / "cpu-tiny.yaml", run / "plan.yaml")
    write(run / "metrics.jsonl", simulate(8, tp=2, pp=2, ranks_per_node=2, steps=60, seed=1,
                                          inject=[{"cause": "slow_device", "step": 15,
                                                   "target": 3}]))
    write(run / "events.jsonl", [{"source": "train", "kind": "start", "time": 1.0},
                                 {"source": "train", "kind": "stop", "time": 2.0, "step": 60}])
    return run


def test_acts_on_a_run_directory_once_and_writes_every_sink(cli, run, tmp_path):
    prom, page = tmp_path / "out" / "watch.prom", tmp_path / "out" / "watch.html"
    code, out, err = cli("watch", str(run), "--once", "--prometheus", str(prom), "--report",
                         str(page))
    assert code == 1, out + err
    assert "rank 3 (node2)" in out  # the plan's rank map: rank 3 is on node2 of node[1-4]
    [entry] = json.loads((run / "quarantine.json").read_text())["entries"]
    assert entry["node"] == "node2" and entry["evidence"]["ranks"] == [3]
    assert not (run / "control" / "checkpoint").exists()  # the job is not running: no request
    watch_events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()
                    if '"watch"' in x]
    assert [e["kind"] for e in watch_events] == ["straggler", "info"]
    assert "mscale_watch_severity" in prom.read_text() and "<svg" in page.read_text()
    code, _, _ = cli("watch", str(run), "--once")  # again: reported, not recorded twice
    assert code == 1 and (run / "events.jsonl").read_text().count('"watch"') == 2


def test_no_act_leaves_the_run_directory_alone(cli, run):
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    code, _, _ = cli("watch", str(run), "--once", "--no-act")
    assert code == 1
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_a_failed_save_is_a_warning_until_a_relaunch_starts_a_new_attempt(cli, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(PLANS / "cpu-tiny.yaml", run / "plan.yaml")
    write(run / "metrics.jsonl", simulate(8, tp=2, pp=2, ranks_per_node=2, steps=10, seed=1))
    failed = {"source": "train", "kind": "checkpoint_failed", "severity": "critical", "step": 4,
              "ranks": [0, 1], "time": 3.0, "message": "checkpoint step-000004 failed on 2 "
              "rank(s): OSError: [Errno 5] Input/output error; training continues, latest stays "
              "step-000002", "evidence": {"latest": "step-000002"}}
    lifecycle = [{"source": "train", "kind": "start", "time": 1.0}, failed,
                 {"source": "train", "kind": "stop", "time": 9.0, "step": 10,
                  "evidence": {"code": 0}}]
    write(run / "events.jsonl", lifecycle)
    code, out, err = cli("watch", str(run), "--once", "--json")
    assert code == 1, out + err
    [f] = json.loads(out)["findings"]
    assert f["kind"] == "checkpoint" and f["severity"] == "warning" and f["ranks"] == [0, 1]
    assert "Input/output error" in f["message"] and f["last_step"] == 4
    assert (run / "events.jsonl").read_text().count('"watch"') == 0  # the job's own record
    code, out, _ = cli("watch", str(run), "--once")
    assert code == 1 and "checkpoint step-000004 failed" in out
    write(run / "events.jsonl", lifecycle + lifecycle[:1] + lifecycle[2:])  # a clean relaunch
    code, out, err = cli("watch", str(run), "--once", "--json")
    assert code == 0 and json.loads(out)["findings"] == [], out + err


def test_once_names_a_live_job_that_stopped_writing_as_a_hang(cli, tmp_path):
    """The job holds its lock (its heartbeat is fresh) but its last record is an hour old:
    critical, exit 2, whether watch has never seen the file before or not."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(PLANS / "cpu-tiny.yaml", run / "plan.yaml")
    now = time.time()
    records = simulate(8, tp=2, pp=2, ranks_per_node=2, steps=10, seed=1)
    write(run / "metrics.jsonl", [{**r, "time": now - 3600 + r["step"]} for r in records])
    write(run / "events.jsonl", [{"source": "train", "kind": "start", "time": now - 3700}])
    (run / "lock.json").write_text(json.dumps({
        "run_id": "r", "host": socket.gethostname(), "pid": os.getpid(), "since": now - 3700,
        "heartbeat": now, "lease_s": 120.0, "token": "t"}))
    code, out, err = cli("watch", str(run), "--once", "--no-act", "--json")
    assert code == 2, out + err
    [hang] = [f for f in json.loads(out)["findings"] if f["kind"] == "hang"]
    assert hang["severity"] == "critical" and hang["evidence"]["idle_s"] > 3500


@pytest.mark.parametrize("args,needle", [
    (["{tmp}/nope"], "no such run directory"),
    (["{tmp}/nope.jsonl"], "no such metrics file"),
    (["{run}", "--report", "{tmp}"], "--report names a directory"),
    (["{run}", "--hang-s", "0"], "--hang-s"),
    (["{run}", "--interval", "0"], "--interval"),
    (["{run}", "--tp", "3"], "tp"),
    (["{run}", "--ranks-per-node", "3"], "error: --ranks-per-node: --ranks-per-node 3 does not"),
    (["{empty}"], "not a run directory: no plan.yaml, lock.json, metrics.jsonl or events.jsonl"),
    (["{started}"], "no metrics records"),
    (["{small}"], "the records have 4 ranks and plan.yaml 8, and no layout of 4 ranks"),
    (["{run}", "--hostlist", "gpu[1-"], "--hostlist: bad hostlist 'gpu[1-': unbalanced brackets"),
    (["{run}", "--tp", "2", "--hostlist", "gpu[1-3]"],  # the plan's 2 ranks a node: 4 nodes
     "--hostlist: the hostlist names 3 nodes, the layout needs 4"),
])
def test_bad_input_exits_3_in_one_line(cli, run, tmp_path, args, needle):
    empty = tmp_path / "empty"
    empty.mkdir()
    small = tmp_path / "small"
    small.mkdir()
    shutil.copy(PLANS / "cpu-tiny.yaml", small / "plan.yaml")
    write(small / "metrics.jsonl", simulate(4, tp=2, ranks_per_node=2, steps=3))
    started = tmp_path / "started"  # a run whose job has not written a step yet
    started.mkdir()
    shutil.copy(PLANS / "cpu-tiny.yaml", started / "plan.yaml")
    fill = {"tmp": str(tmp_path), "run": str(run), "empty": str(empty), "small": str(small),
            "started": str(started)}
    code, out, err = cli("watch", *[a.format(**fill) for a in args], "--once", "--no-act")
    assert code == 3, out + err
    assert needle in err and "Traceback" not in err and err.startswith("error: ")


@pytest.mark.parametrize("flag,name", [("--report", "watch.html"),
                                       ("--prometheus", "mscale.prom")])
def test_a_directory_for_an_output_file_is_told_a_file_name_of_its_kind(cli, run, tmp_path,
                                                                         flag, name):
    code, out, err = cli("watch", str(run), "--once", "--no-act", flag, str(tmp_path))
    assert code == 3, out + err
    assert f"e.g. {tmp_path / name}" in err and "plan.yaml" not in err


def test_a_record_with_a_short_vector_names_the_metrics_file(cli, tmp_path):
    """The file was null ("error: compute_time: step 8: ..."): every other metrics error names
    it, and the user has to find the line to move away."""
    records = simulate(8, tp=2, pp=2, ranks_per_node=2, steps=10, seed=1)
    records[7]["compute_time"] = records[7]["compute_time"][:1]
    path = write(tmp_path / "m.jsonl", records)
    code, out, err = cli("watch", path, "--once", "--no-act", "--json")
    assert code == 3, out + err
    error = json.loads(out)["error"]
    assert error["file"] == path and error["field"] == "compute_time"


def test_once_refuses_a_directory_that_is_not_a_run_naming_it_and_the_fix(cli, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = cli("watch", str(empty), "--once")
    assert code == 3 and out == ""
    first, fix = err.splitlines()
    assert first == (f"error: {empty}: not a run directory: no plan.yaml, lock.json, "
                     "metrics.jsonl or events.jsonl")
    assert fix.startswith("  fix: pass the --run-dir of an `mscale train` run")


def test_every_file_watch_writes_is_named_on_stderr(cli, run, tmp_path):
    prom, page = tmp_path / "out" / "watch.prom", tmp_path / "out" / "watch.html"
    code, out, err = cli("watch", str(run), "--once", "--no-act", "--json", "--prometheus",
                         str(prom), "--report", str(page))
    assert code == 1, out + err
    json.loads(out)  # stdout stays the one JSON document
    assert err.splitlines() == [f"wrote Prometheus textfile: {prom}",
                                f"wrote watch report: {page}"]
    assert prom.exists() and page.exists()


def test_sigterm_stops_a_live_watch_as_ctrl_c_does(cli, tmp_path, monkeypatch):
    """systemd, Kubernetes and SLURM stop a live watch with SIGTERM: it ends with the verdict of
    what it judged, its line and its report, not a silent death by the signal (exit 143)."""
    import signal

    from mscale.watch.follow import Follower

    path = trace(tmp_path, steps=20)
    polls = []
    real = Follower.poll

    def poll(self):
        polls.append(1)
        if len(polls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        if len(polls) > 200:  # the signal did not stop it: fail now, not at the suite's timeout
            pytest.fail("SIGTERM did not stop the live watch")
        return real(self)

    monkeypatch.setattr(Follower, "poll", poll)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a shell starts it (conftest restores)
    before = signal.getsignal(signal.SIGTERM)
    report = tmp_path / "w.html"
    code, out, err = cli("watch", path, *FLAGS, "--interval", "0.05", "--hang-s", "1e12",
                         "--report", str(report))
    assert code == 0 and "step 20 |" in out, out + err
    assert report.exists() and f"wrote watch report: {report}" in err
    assert signal.getsignal(signal.SIGTERM) is before  # given back
