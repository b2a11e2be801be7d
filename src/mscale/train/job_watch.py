"""Say how a local training job ended: the ``stop``/``hang`` event and the ``--json`` summary.

Starting and watching the workers is `mscale.distributed.launch.run_local_workers` (shared with
preflight); this module turns its `JobResult` into train's records.
"""

from __future__ import annotations

from mscale.config.plan import Plan
from mscale.config.records import Event
from mscale.distributed.watcher import JobResult, describe_exit
from mscale.distributed.stops import ended_by_stop
from mscale.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, MscaleError
from mscale.runs.atomic import read_jsonl
from mscale.runs.rundir import RunDir
from mscale.train.failure import AFTERMATH

__all__ = ["JobResult", "agreed_stop", "record_failure", "record_interruption", "stopped_by_operator",
           "summary_document"]


def record_failure(run: RunDir, plan: Plan, result: JobResult, run_id: str, logs: str,
                   errors: dict[int, dict], started: float | None = None) -> str:
    """Write the job's ``stop``/``hang`` event; returns the console line that says what happened.
    ``errors``: this job's error files (`read_error_files` since its start); ``started``: the
    launch's wall-clock start, to tell this job's last step from an earlier attempt's."""
    from mscale.topology.placement import placement_for

    placement = placement_for(plan)
    names = plan.cluster.node_names()
    node = lambda r: names[placement.node(r)]  # noqa: E731
    first = result.failed_rank
    assert first is not None
    kind = errors.get(first, {}).get("kind") or (
        "killed" if result.returncodes[first] < 0 else "no error file; its output says why")
    timed_out = sorted(r for r, e in errors.items() if e.get("kind") == "timeout")
    hung = result.stopped_at_failure or ([r for r in result.alive_at_failure
                                          if r not in timed_out] if kind == "timeout" else [])
    how = describe_exit(result.returncodes[first])
    # a hang when peers timed out on a rank still there: the first rank seen to end may be one
    # whose connection closed as a timed-out peer exited (kind network), on a loaded machine
    # the same poll sees them all ended
    if hung and (kind == "timeout" or timed_out):
        state = " (process stopped)" if result.stopped_at_failure else ""
        waited = timed_out[0] if timed_out else first
        line = (f"failed: hang — rank(s) {_ranks(hung)} on {_nodes(hung, node)} stopped answering"
                f"{state}; rank {waited} and others timed out waiting for them")
        event_kind, implicated = "hang", hung
    else:
        detail = errors.get(first, {}).get("message")
        why = "" if kind == "killed" else f" ({kind}" + (f": {detail}" if detail else "") + ")"
        line = f"failed: rank {first} on {node(first)} {how} first{why}; the other workers were stopped"
        event_kind, implicated = "stop", [first]
    evidence = {"run_id": run_id, "first_failed_rank": first, "how": how, "kind": kind,
                "returncodes": result.returncodes, "alive_at_failure": result.alive_at_failure,
                "stopped_at_failure": result.stopped_at_failure, "timed_out": timed_out,
                "error_files": {r: f"logs/rank{r}.error.json" for r in sorted(errors)},
                "logs": logs}
    where = _append(run, Event(source="train", kind=event_kind, severity="critical",
                               step=last_step_since(run, started), ranks=implicated,
                               nodes=sorted({node(r) for r in implicated}),
                               message=line, evidence=evidence))
    return f"{line}; {where}; worker logs in {logs}"


TAIL_BYTES = 1 << 20
"""How much of metrics.jsonl's end `last_step_since` reads (a 12,288-rank record is ~200 KB)."""


def last_step_since(run: RunDir, since: float | None) -> int | None:
    """The last step ``metrics.jsonl`` records, when its record was written at or after ``since``
    (this launch's, not an earlier attempt's); None otherwise, or when unreadable. The event
    then says where the job was, as rank 0's own stop does (watch's summary.job.step)."""
    import json

    from mscale.runs.atomic import fs_and_path
    from mscale.train.failure import CLOCK_SLACK_S

    if since is None:
        return None
    try:
        fs, path = fs_and_path(run.metrics)
        size = fs.size(path)
        tail = fs.cat_file(path, start=max(0, size - TAIL_BYTES))
    except (OSError, ValueError):
        return None
    for line in reversed(tail.splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line, or the first one cut by the tail
        step, when = (rec.get("step"), rec.get("time")) if isinstance(rec, dict) else (None, None)
        if isinstance(step, int) and isinstance(when, (int, float)):
            return step if when >= since - CLOCK_SLACK_S else None
    return None


def stopped_by_operator(result: JobResult, errors: dict[int, dict]) -> bool:
    """Whether the job's abnormal ends are the operator's stop (`JobResult.stop_signal`, which
    came before any of them) and nothing else: every worker's code is what a stop does
    (`stops.ended_by_stop`), or 3 with an error file of a kind a stopped peer leaves behind (a
    lost connection, a timeout). A crash, an OOM kill, a bad input in the same minutes is a
    failure, reported as one."""
    if result.stop_signal is None or result.failed_rank is None:
        return False
    for rank, code in enumerate(result.returncodes):
        if ended_by_stop(code, result.forced):
            continue
        if code == EXIT_BAD_INPUT and errors.get(rank, {}).get("kind") in AFTERMATH:
            continue
        return False
    return True


def agreed_stop(run: RunDir, result: JobResult, run_id: str, errors: dict[int, dict]) -> bool:
    """Whether every worker exited with the one code rank 0's own ``stop`` event of this run
    records, none having written an error file: a stop the ranks agreed on at a step boundary (a
    full disk, a failed final save), which rank 0 has already said and recorded. No rank failed
    first, so the launcher names none (a node excluded for it would be the wrong one)."""
    codes = set(result.returncodes)
    if len(codes) != 1 or errors:
        return False
    try:
        events = read_jsonl(run.events)
    except Exception:  # noqa: BLE001 - unreadable: rank 0's last line may still say it
        events = []
    own = [e.get("evidence") or {} for e in events if e.get("kind") == "stop"
           and isinstance(e.get("evidence"), dict) and e["evidence"].get("run_id") == run_id
           and "code" in e["evidence"]]
    if own:
        return own[-1]["code"] in codes
    # A full disk (or a filesystem gone read-only) is the stop that cannot write its own event
    # and error files: every rank exits 3 at one boundary after rank 0's `stop_line`. Without
    # this, the launcher called it "rank 0 exited with code 3 first" and blamed its node.
    return codes == {EXIT_BAD_INPUT} and result.rank0_last_line.startswith("stopped at step ")


def record_interruption(run: RunDir, result: JobResult, run_id: str, logs: str) -> str:
    """The operator stopped the job (`JobResult.stop_signal`) and some workers ended before they
    could save a checkpoint: a second Ctrl-C, or a stop during start-up. Nobody failed, so no
    rank or node is named: the ``stop`` event says ``interrupted``, which recover reads as a
    stop on request. Returns the console line."""
    from mscale.ckpt import catalog

    how = ("a second Ctrl-C stopped the workers at once, without a checkpoint" if result.forced
           else f"the workers ended on {result.stop_signal} before they could save a checkpoint")
    try:  # what --resume auto loads: latest, or a committed checkpoint newer than it
        resumed = catalog.auto_choice(catalog.entries(run.ckpt, sizes=False),
                                      catalog.read_latest(run.ckpt))
        last = (f"the last checkpoint is {catalog.join(run.ckpt, resumed)}; the same command "
                "resumes from it") if resumed else "no checkpoint was saved yet"
    except MscaleError as e:  # a damaged pointer: the next start names it too (exit 3)
        last = f"{catalog.join(run.ckpt, catalog.LATEST)} cannot be read ({e.message})"
    line = f"interrupted: {how}; {last}"
    evidence = {"run_id": run_id, "reason": "interrupted", "signal": result.stop_signal,
                "forced": result.forced, "code": EXIT_INTERRUPTED,
                "returncodes": result.returncodes, "logs": logs}
    where = _append(run, Event(source="train", kind="stop", severity="warning", message=line,
                               evidence=evidence))
    return f"{line}; {where}"


def _append(run: RunDir, event: Event) -> str:
    """Append the launcher's stop event; where its evidence is, for the console line (printed
    whether or not the event could be written)."""
    try:
        run.append_record(run.events, event)
        return f"evidence in {run.events}"
    except Exception as e:  # noqa: BLE001 - the console line must still be printed
        return f"the stop event could not be written ({e})"


def _ranks(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks)


def _nodes(ranks: list[int], node) -> str:
    return ",".join(sorted({node(r) for r in ranks}))


def summary_document(run: RunDir, run_id: str, result: JobResult) -> dict:
    """``mscale train --local N --json``: rank 0's closing figures and how the job ended."""
    doc: dict = {"run_dir": run.root, "run_id": run_id, "code": result.code,
                 "returncodes": result.returncodes, "failed_rank": result.failed_rank}
    try:
        events = read_jsonl(run.events)
    except Exception:  # noqa: BLE001 - the document says what it could not read
        events, doc["events_error"] = [], "events.jsonl could not be read"
    for ev in events:
        ev_run = ev.get("evidence", {}).get("run_id")
        if ev_run == run_id and ev.get("kind") in ("stop", "hang"):
            key = "summary" if "code" in ev.get("evidence", {}) else "failure"
            doc[key] = ev.get("evidence") if key == "summary" else ev
    return doc
