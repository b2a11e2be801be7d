"""``mscale recover`` in-process over faked stages: the group's default command, exit codes 0/1/2
per verdict and 3 for bad input, --json's one document, the readable report, --execute."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from mscale.recover import stages
from mscale.recover.decision import CheckpointChoice, Diagnosis, Evidence, Exclusions, Replan

from tests.conftest import PLANS

NODES = ["node1", "node2", "node3", "node4"]


@pytest.fixture
def run(tmp_path):
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    shutil.copy(PLANS / "cpu-tiny.yaml", run / "plan.yaml")
    argv = [sys.executable, "-c", "import sys; print('relaunched', sys.argv[1:]); "
            "sys.exit(0)", "mscale", "train", str(run / "plan.yaml"), "--run-dir", str(run),
            "--local", "8"]
    start = {"kind": "start", "source": "train", "time": 1.0, "evidence": {
        "launcher": "local", "launch": {"argv": argv, "cwd": str(tmp_path),
                                        "plan": str(run / "plan.yaml"), "local": 8,
                                        "nodes": NODES, "slurm": None}}}
    (run / "events.jsonl").write_text(json.dumps(start) + "\n")
    return run


@pytest.fixture
def state(run, monkeypatch):
    """What the faked stages answer; tests change it before invoking the CLI."""
    s = {"diagnosis": Diagnosis(
            cls="gpu", symptom="crash", summary="rank 5 on node3 was killed by SIGKILL",
            evidence=[Evidence(source="events.jsonl", text="rank 5 killed by SIGKILL", rank=5,
                               node="node3")],
            suspect_ranks=[5], suspect_nodes=["node3"], failed_step=12),
         "choice": CheckpointChoice(path=str(run / "ckpt/step-000010"), step=10,
                                    reason="newest committed that verifies"),
         "exclusions": Exclusions(), "replan": None}
    monkeypatch.setattr(stages, "diagnose", lambda d: s["diagnosis"])
    monkeypatch.setattr(stages, "choose_checkpoint", lambda r, d, verify="quick": s["choice"])
    monkeypatch.setattr(stages, "decide_exclusions",
                        lambda r, d, recheck=None, plan=None, **_: s["exclusions"])
    monkeypatch.setattr(stages, "replan", lambda r, p, e, allow_batch_change=False, ran=None,
                        write=True: s["replan"])
    monkeypatch.setattr(stages, "data_skip_for", lambda d, c, skips=None: None)
    return s


def degrade(run, state):
    state["exclusions"] = Exclusions(nodes=["node3"], reasons={"node3": "killed (SIGKILL)"})
    state["replan"] = Replan(plan_path=str(run / "recover/plan-0001.yaml"),
                             nodes=["node1", "node2"], world=4, layout="tp2 pp2 dp1",
                             old_layout="tp2 pp2 dp2", old_step_time_s=1.0,
                             new_step_time_s=1.5, global_batch=16, unused_nodes=["node4"])


def test_default_command_takes_the_run_dir_and_prints_the_report(cli, run, state):
    code, out, err = cli("recover", str(run))
    assert code == 0, out + err
    assert out.startswith(f"recover {run}: RELAUNCHABLE (exit 0)")
    assert "diagnosis: gpu / crash — rank 5 on node3" in out
    assert "  events.jsonl [rank 5, node3]: rank 5 killed by SIGKILL" in out
    assert "checkpoint: " in out and "(step 10) — newest committed" in out
    assert f"relaunch (local, from {run.parent}):" in out and "dry run: nothing written" in out
    assert not (run / "recover").exists()
    code2, out2, _ = cli("recover", "diagnose", str(run))  # the default command by name
    assert (code2, out2) == (code, out)


def test_a_long_line_many_ranks_wrote_keeps_its_ranks_and_drops_the_source_location(
        cli, run, state):
    gloo = ("network: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
            "pair.cc:553] Connection closed by peer [127.0.0.1]:56194. This is typically caused"
            " by a remote worker crashing. Check the logs of the remote worker before reporting")
    state["diagnosis"].evidence.append(Evidence(source="logs/rank1.error.json", text=gloo,
                                                rank=1, node="node1", also_ranks=[0, 2, 7]))
    code, out, err = cli("recover", str(run))
    line = next(x for x in out.splitlines() if "rank1.error.json" in x)
    assert "pair.cc" not in line and "Connection closed by peer" in line
    assert line.endswith("… [+3 more rank(s): 0,2,7]") and len(line) <= 160


def test_a_finished_run_says_so_instead_of_relaunchable(cli, run, state):
    state["diagnosis"] = Diagnosis(cls="none", symptom="finished", summary="The run finished")
    code, out, err = cli("recover", str(run))
    assert code == 0, out + err
    assert out.startswith(f"recover {run}: FINISHED, nothing to recover (exit 0)")
    assert "relaunch" not in out.split("why:")[1].replace("nothing to recover", "")


def test_degraded_is_exit_1_with_exclusions_and_the_re_plan_cost(cli, run, state):
    degrade(run, state)
    code, out, err = cli("recover", str(run), "--no-recheck")
    assert code == 1, out + err
    assert "exclusions: 1 node(s)\n  node3: killed (SIGKILL)" in out
    assert "re-plan: tp2 pp2 dp2 -> tp2 pp2 dp1, 4 ranks on 2 node(s)" in out
    assert "predicted step time 1 s -> 1.5 s (+50%); global batch 16 kept" in out
    assert "left idle: node4" in out and "--local 4" in out
    assert "suspect nodes not re-checked (--no-recheck)" in out


def test_json_is_one_document_and_unrecoverable_is_exit_2(cli, run, state):
    state["diagnosis"] = Diagnosis(cls="user_code", symptom="bad_input", summary="bad config")
    code, out, err = cli("recover", "--json", str(run))  # an option before the run dir
    assert code == 2, out + err
    doc = json.loads(out)
    assert doc["verdict"] == "unrecoverable" and doc["exit_code"] == 2 and doc["command"] == []
    assert doc["decision"] is None and doc["launch_exit_code"] is None
    code, out, err = cli("recover", str(run))
    assert code == 2 and "--execute would only record this decision" in out and "relaunch (" \
        not in out


@pytest.mark.parametrize("args, says", [
    (["/no/such/run"], "run directory not found"),
    (["--verify", "deep", "RUN"], "'deep' is not one of 'quick', 'full'"),
    (["EMPTY"], "not a run directory"),
    (["FILE"], "a file, not a run directory"),
    (["memory://runs/r1"], "lives only inside the process"),
])
def test_bad_input_is_exit_3(cli, run, tmp_path, args, says):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    args = [{"RUN": str(run), "EMPTY": str(tmp_path / "empty"),
             "FILE": str(tmp_path / "file")}.get(a, a) for a in args]
    code, out, err = cli("recover", *args)
    assert code == 3 and says in err and "Traceback" not in err and "fix: " in err
    code, out, _ = cli("recover", *args, "--json")
    assert code == 3 and says in json.loads(out)["error"]["message"]


def test_execute_writes_the_decision_and_runs_the_command(cli, run, state, capfd):
    degrade(run, state)
    state["replan"].plan_path = None  # the fake re-plan writes no file
    code, out, err = cli("recover", str(run), "--execute", "--json", "--no-recheck")
    assert code == 0, out + err  # degraded, and the job recover ran trained to the end
    doc = json.loads(out)  # the relaunched command's output went to stderr, not into the document
    assert doc["launch_exit_code"] == 0 and doc["decision"].endswith("decision-0001.json")
    assert (run / "recover/decision-0001.json").exists()
    assert "relaunched" in capfd.readouterr().err
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert events[-1]["kind"] == "recover" and events[-1]["source"] == "recover"


@pytest.mark.parametrize("rc, code, says", [
    (0, 0, "exited with code 0: it trained to the end"),  # not the verdict's 1: the job's end
    (1, 1, "exited with code 1: stopped early on request"),
    (2, 2, "exited with code 2: stopped on a NaN/Inf loss"),
    (3, 3, "exited with code 3: failed"),
    (130, 130, "exited with code 130: interrupted"),
    (-2, 130, "was killed by SIGINT: interrupted (Ctrl-C)"),  # a Ctrl-C as it ended
    (-9, 3, "exited with code -9: killed by signal 9"),
    (255, 3, "exited with code 255: ended abnormally"),
])
def test_execute_ends_with_the_relaunched_jobs_own_code(cli, run, state, monkeypatch, rc, code,
                                                        says):
    """A relaunch halted on request is no failure of recover's (it was exit 3 for any code); a
    relaunch that trained to the end is exit 0, whatever the verdict (a degraded one kept 1, and
    a script could not tell it from a halt)."""
    import time

    from mscale.recover import decide

    def launch(plan, stdout=None):
        if rc == 1:  # train's own record of the halt: what tells it from torchrun's 1
            with open(run / "events.jsonl", "a") as f:
                f.write(json.dumps({"kind": "stop", "source": "train", "time": time.time(),
                                    "evidence": {"code": 1}}) + "\n")
        return rc

    monkeypatch.setattr(decide, "apply_plan", lambda plan: None)
    monkeypatch.setattr(decide, "launch", launch)
    got, out, err = cli("recover", str(run), "--execute", "--no-recheck")
    assert got == code and f"recover: the relaunched job {says}" in err, out + err
    got, out, _ = cli("recover", str(run), "--execute", "--no-recheck", "--json")
    doc = json.loads(out)
    assert got == doc["exit_code"] == code and doc["launch_exit_code"] == rc


def test_an_exit_1_without_trains_halt_is_a_failure(cli, run, state, monkeypatch):
    """torchrun exits 1 for any worker's failure: without train's stop record of code 1 that is
    no halt on request."""
    from mscale.recover import decide

    monkeypatch.setattr(decide, "apply_plan", lambda plan: None)
    monkeypatch.setattr(decide, "launch", lambda plan, stdout=None: 1)
    got, out, err = cli("recover", str(run), "--execute", "--no-recheck")
    assert got == 3 and "exited with code 1 without a halt recorded by train" in err, err


@pytest.mark.parametrize("submitter", ["sbatch", "/usr/bin/scontrol"])
def test_a_failed_submission_is_exit_3_not_read_as_the_jobs_code(cli, run, state, monkeypatch,
                                                                 submitter):
    """sbatch/scontrol return at once: their 1 is a failed submission (a job already pending,
    a bad option), not train's 'stopped on request'."""
    from mscale.recover import decide

    real = decide.plan_recovery

    def planned(*a, **k):
        plan = real(*a, **k)
        plan.command = [submitter, "requeue", "88"]
        return plan

    monkeypatch.setattr(decide, "plan_recovery", planned)
    monkeypatch.setattr(decide, "apply_plan", lambda plan: None)
    monkeypatch.setattr(decide, "launch", lambda plan, stdout=None: 1)
    code, out, err = cli("recover", str(run), "--execute", "--no-recheck")
    name = submitter.rsplit("/", 1)[-1]
    assert code == 3 and f"recover: the relaunch command ({name}) failed with code 1" in err, err


def test_the_group_still_routes_its_own_subcommands(cli):
    code, out, _ = cli("recover", "--help")
    assert code == 0 and "supervise" in out and "diagnose" in out
    # the group's own help lists no option of its default command (--json, --verify, ...):
    # it says where they are, or a newcomer finds only --help there
    assert "every option: `mscale recover diagnose --help`" in " ".join(out.split())
    code, out, _ = cli("recover", "diagnose", "--help")
    assert code == 0 and "quick|full" in out  # --verify's choices
    code, out, _ = cli("recover", "supervise", "--help")
    assert code == 0 and "Usage: mscale recover supervise" in out


@pytest.mark.parametrize("name", ["diagnose", "supervise"])
def test_a_run_directory_named_like_a_subcommand_is_still_the_run_directory(cli, run, state,
                                                                             monkeypatch, name):
    named = run.parent / name
    run.rename(named)
    monkeypatch.chdir(named.parent)
    code, out, err = cli("recover", name)
    assert code == 0, out + err
    assert out.startswith(f"recover {name}: RELAUNCHABLE (exit 0)")


def test_execute_with_no_recorded_launch_relaunches_nothing_and_says_so(cli, run, state,
                                                                        monkeypatch):
    """A run whose start event recorded no launch (it failed before writing one): --execute has
    nothing to run, so it must not end 0 as if the job were back."""
    from mscale.recover import decide

    (run / "events.jsonl").write_text("")
    monkeypatch.setattr(decide, "apply_plan", lambda plan: None)
    monkeypatch.setattr(decide, "launch", lambda plan, stdout=None: pytest.fail("launched"))
    code, out, _ = cli("recover", str(run), "--no-recheck")
    assert code == 0 and "mscale recover supervise -- CMD" in out  # the dry run: a usable fix
    assert "RecoverOptions" not in out and "add --execute to act" not in out
    assert out.splitlines()[0].endswith("by hand: recover has no launch command to run")
    assert "--execute would only record this decision and exit 3" in out
    code, out, err = cli("recover", str(run), "--execute", "--no-recheck")
    assert code == 3 and "recover: nothing relaunched" in err, out + err
    assert out.splitlines()[0].endswith("RELAUNCHABLE by hand (exit 3: nothing relaunched, "
                                        "recover has no launch command to run)")
    code, out, err = cli("recover", str(run), "--execute", "--no-recheck", "--json")
    assert code == 3 and json.loads(out)["exit_code"] == 3
    assert "recover: nothing relaunched" in err  # the reason, beside the document


def test_execute_for_a_job_slurm_queued_again_keeps_its_verdict(cli, run, state, monkeypatch):
    """A batch job already back in SLURM's queue (a requeue) needs no command: --execute said
    "the run recorded no launch command" and ended 3, though the job would resume by itself."""
    from mscale.recover import decide
    from mscale.recover.relaunch import Relaunch

    queued = Relaunch("slurm", [], ["SLURM has queued job 7 again itself (JobState=PENDING, "
                                    "Restarts=1): when it starts it resumes from the latest "
                                    "checkpoint; nothing to submit (`squeue -j 7` shows it)"])
    monkeypatch.setattr(decide, "relaunch", lambda *a, **k: queued)
    monkeypatch.setattr(decide, "apply_plan", lambda plan: None)
    monkeypatch.setattr(decide, "launch", lambda plan, stdout=None: pytest.fail("launched"))
    code, out, err = cli("recover", str(run), "--execute", "--no-recheck")
    assert code == 0 and "no launch command" not in err, out + err
    assert "nothing to submit" in out
