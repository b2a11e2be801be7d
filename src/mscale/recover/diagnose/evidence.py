"""Everything a failed run left behind, read boundedly and scoped to its last attempt.

`collect(run_dir)` lists and reads, never trusting a file to be whole or small
(`mscale.recover.diagnose.read`): ``events.jsonl`` (the attempt's window), the per-rank error files
(`mscale.train.failure`) and logs, torchelastic error files (``logs/**/error.json``), SLURM output
files, flight-recorder dumps (JSON read; a pickle is named as present and never unpickled), the
last metrics record, ``preflight.json``, ``quarantine.json`` and the plan. Missing files are
normal (watch or preflight may never have run); a damaged one becomes a `problems` line.

The last attempt: the run id of the newest train lifecycle event (start/stop/hang) names it;
its window of events begins at its ``start`` event (or, when it failed before writing one, after
the previous attempt's last event). Files count as this attempt's when they are newer than the
attempt's beginning (`Attempt.begins`): error files left by an earlier attempt stay on disk (a
rank that did not fail again does not rewrite its file) and must not be blamed twice.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import re
from dataclasses import dataclass, field
from functools import cached_property

from mscale.config.plan import Plan, load_plan
from mscale.distributed.flight import ATTEMPT_KEY
from mscale.errors import MscaleError
import mscale.recover.diagnose.read as rd
from mscale.recover.decision import Evidence
from mscale.runs.rundir import RunDir

BEGIN_SLACK_S = 60.0
"""Files up to this long before the attempt's start event still belong to it: ranks fail while
rank 0 writes the start, and node clocks differ by seconds."""
LIFECYCLE = ("start", "stop", "hang")

_RANK_LOG = re.compile(r"^logs/rank(\d+)\.log$")
_RANK_ERR = re.compile(r"^logs/rank(\d+)\.error\.json$")
_ELASTIC = re.compile(r"(^|/)error\.json$")
_SLURM = re.compile(r"(^|/)slurm-[^/]*\.out$")
_FLIGHT = re.compile(r"(nccl_trace_(attempt(?P<attempt>\d+)_)?rank_|trace_rank_|"
                     r"flight_?recorder[_-]?(rank[_-]?)?)(?P<rank>\d+)[^/]*$", re.IGNORECASE)
"""train's JSON dump (``flight_recorder_rank<N>.json``), torch's own on an NCCL timeout
(``nccl_trace_rank_<N>``; ``nccl_trace_attempt<K>_rank_<N>`` where train pointed it:
distributed/flight.py `point_torch_dump`), and like names."""


@dataclass
class Attempt:
    """The last attempt of the run, as events.jsonl tells it."""

    number: int | None = None
    """Its attempt number (the start event's, else one past the last start)."""
    run_id: str | None = None
    """The launcher's id of the attempt (``local-…``, ``slurm-JOB.STEP``, ``torchrun-…``)."""
    start: dict | None = None
    """Its ``start`` event, None when it failed before writing one."""
    events: list[dict] = field(default_factory=list)
    """Its events, oldest first."""
    begins: float | None = None
    """Unix time after which a file belongs to this attempt; None: any file does."""

    @property
    def launch(self) -> dict:
        """The recorded launch (``start`` evidence ``launch``: argv, nodes, slurm), or {}."""
        value = evidence_of(self.start).get("launch")
        return value if isinstance(value, dict) else {}

    @property
    def launcher(self) -> str | None:
        value = evidence_of(self.start).get("launcher")
        return value if isinstance(value, str) else None


@dataclass
class RunEvidence:
    """What `collect` found; `mscale.recover.diagnose.facts` turns it into findings."""

    root: str
    """The run directory (path or URL)."""
    attempt: Attempt
    """The last attempt and its events."""
    error_files: dict[int, dict] = field(default_factory=dict)
    """This attempt's ``logs/rank<N>.error.json`` records, by rank."""
    elastic: list[tuple[rd.FileInfo, dict]] = field(default_factory=list)
    """torchelastic error files of this attempt, with their records."""
    logs: dict[int, rd.FileInfo] = field(default_factory=dict)
    """This attempt's ``logs/rank<N>.log`` files, by rank (not read until asked)."""
    slurm: list[rd.FileInfo] = field(default_factory=list)
    """SLURM output files of this attempt (``slurm-*.out`` in the run or logs directory)."""
    flight: list[tuple[rd.FileInfo, int, dict | None]] = field(default_factory=list)
    """Flight-recorder dumps: (file, rank, JSON document or None for a pickle, never read)."""
    last_metrics: dict | None = None
    """The newest metrics record (any attempt: the last step the run completed)."""
    preflight: dict | None = None
    """``preflight.json`` as read (any age: context only)."""
    quarantine: dict | None = None
    """``quarantine.json`` as read."""
    plan: Plan | None = None
    """``plan.yaml``: the plan the last attempt trained with (train records it there)."""
    problems: list[Evidence] = field(default_factory=list)
    """Damaged or oversized files: evidence too."""
    _tails: dict[str, list[str]] = field(default_factory=dict, repr=False)

    def lines(self, info: rd.FileInfo) -> list[str]:
        """The last lines of a log (`read.LOG_TAIL_BYTES`), read once."""
        if info.url not in self._tails:
            try:
                text, _ = rd.read_tail(info.url)
            except rd.Problem as e:
                self.problem(info.source, str(e))
                text = ""
            self._tails[info.url] = text.splitlines()
        return self._tails[info.url]

    def problem(self, source: str, text: str) -> None:
        self.problems.append(Evidence(source=source, text=text[:300]))

    @property
    def world(self) -> int | None:
        """Ranks of the attempt's plan, when there is a plan."""
        return self.plan.layout.world_size if self.plan is not None else None

    def node_of(self, rank: int | None) -> str | None:
        """The node a rank ran on: the recorded launch's node list; under srun or torchrun the
        rank's own error file (its real host name); else the plan's placement (the names
        ``--local`` gives its pretend nodes)."""
        if rank is None:
            return None
        per_node = self.plan.cluster.gpus_per_node if self.plan is not None else None
        launched = self.attempt.launch.get("nodes")
        if isinstance(launched, list) and launched and per_node:
            return self._pick(rank, launched, per_node)
        own = (self.error_files.get(rank) or {}).get("node")
        own = own if isinstance(own, str) and own else None
        if own and self.attempt.launcher not in (None, "local"):
            return own
        if self.plan is not None:
            return self._pick(rank, self._plan_nodes, per_node) or own
        return own

    @cached_property
    def _plan_nodes(self) -> list[str]:
        """The plan's node names in placement order (a hostlist expanded once)."""
        assert self.plan is not None
        return (self.plan.placement.nodes if self.plan.placement is not None
                else self.plan.cluster.node_names())

    def _pick(self, rank: int, names: list, per_node: int | None) -> str | None:
        if not per_node or rank < 0 or (self.world is not None and rank >= self.world):
            return None
        index = rank // per_node
        return str(names[index]) if index < len(names) else None


def collect(run_dir: str) -> RunEvidence:
    """Read the run directory's evidence of its last attempt (module docstring)."""
    run = RunDir(run_dir)
    events, problems = rd.read_jsonl_tail(run.events, rd.JSONL_TAIL_BYTES)
    ev = RunEvidence(root=run.root, attempt=last_attempt(events))
    for p in problems:
        ev.problem("events.jsonl", p)
    ev.plan = _plan(ev, run)
    _logs_dir(ev, rd.listing(run.root, "logs"))
    ev.slurm += [f for f in rd.listing(run.root, "", maxdepth=1)
                 if _SLURM.search(f.source) and _fresh(ev, f.mtime)]
    ev.last_metrics = _last_metrics(ev, run)
    ev.preflight = _json_file(ev, run.preflight, "preflight.json")
    ev.quarantine = _json_file(ev, run.quarantine, "quarantine.json")
    return ev


def last_attempt(events: list[dict]) -> Attempt:
    """The last attempt's window of ``events`` (module docstring)."""
    train = [(i, e) for i, e in enumerate(events)
             if e.get("source", "train") == "train" and e.get("kind") in LIFECYCLE]
    ids = [(i, _run_id(e)) for i, e in train if _run_id(e)]
    starts = [(i, e) for i, e in train if e.get("kind") == "start"]
    last_id = ids[-1][1] if ids else None
    mine = [(i, e) for i, e in starts if _run_id(e) == last_id] if last_id else starts[-1:]
    if mine:
        begin, start = mine[-1]
    else:  # it failed before writing its start: begin after the previous attempt's last event
        begin = next((i + 1 for i, rid in reversed(ids) if rid != last_id), 0)
        start = None
    before = [t for i, e in train if i < begin and isinstance(t := e.get("time"), (int, float))]
    begins = max(before) if before else None  # the previous attempt's end
    if start is not None and isinstance(start.get("time"), (int, float)):
        begins = max(begins or 0.0, start["time"] - BEGIN_SLACK_S) if begins is not None \
            else start["time"] - BEGIN_SLACK_S
    # no train record at all: nothing says which attempt this is (not "1": its metrics may hold
    # many attempts' steps)
    number = _attempt_number(start, starts) if train else None
    return Attempt(number=number, run_id=last_id or (_run_id(start) if start else None),
                   start=start, events=events[begin:], begins=begins)


def evidence_of(event: dict | None) -> dict:
    """An event's ``evidence``, or {} when it has none or a damaged one."""
    value = (event or {}).get("evidence")
    return value if isinstance(value, dict) else {}


def _run_id(event: dict) -> str | None:
    value = evidence_of(event).get("run_id")
    return value if isinstance(value, str) and value else None


def _attempt_number(start: dict | None, starts: list[tuple[int, dict]]) -> int | None:
    if start is not None:
        n = evidence_of(start).get("attempt")
        return n if isinstance(n, int) else len(starts)
    numbered = [a for _, e in starts if isinstance(a := evidence_of(e).get("attempt"), int)]
    return max([len(starts), *numbered]) + 1


def _fresh(ev: RunEvidence, when: float | None) -> bool:
    """Whether a file (or record) of this time belongs to the last attempt."""
    return ev.attempt.begins is None or when is None or when > ev.attempt.begins


def _plan(ev: RunEvidence, run: RunDir) -> Plan | None:
    info = rd.stat(run.plan, "plan.yaml")
    if info is None:
        return None
    if info.size > rd.JSON_CAP_BYTES:
        ev.problem("plan.yaml", f"{info.size} bytes, over the {rd.JSON_CAP_BYTES}-byte cap: "
                                "not read")
        return None
    try:
        return load_plan(run.plan, check=False)
    except (MscaleError, ValueError, OSError) as e:
        ev.problem("plan.yaml", f"unreadable plan: {str(e).splitlines()[0]}")
        return None


def _logs_dir(ev: RunEvidence, files: list[rd.FileInfo]) -> None:
    """Sort the files under logs/ into rank logs, error files, torchelastic error files, SLURM
    outputs and flight-recorder dumps, keeping this attempt's."""
    errors = _read_error_files(ev, files)
    for f in files:
        if m := _RANK_LOG.match(f.source):
            if _fresh(ev, f.mtime):
                ev.logs[int(m.group(1))] = f
        elif (m := _RANK_ERR.match(f.source)) and f.source in errors:
            _error_file(ev, f, int(m.group(1)), errors[f.source])
        elif _ELASTIC.search(f.source):
            _elastic_file(ev, f)
        elif _SLURM.search(f.source):
            if _fresh(ev, f.mtime):
                ev.slurm.append(f)
        elif m := _FLIGHT.search(f.source.rsplit("/", 1)[-1]):
            named = int(m.group("attempt")) if m.group("attempt") else None
            if _fresh(ev, f.mtime) and named in (None, ev.attempt.number):
                _flight_file(ev, f, int(m.group("rank")))


ERROR_FILE_READERS = 16
"""Error files read at once. After a job-wide timeout every rank writes one: 12,288 files, whose
reads one after another are minutes on an object store (a round trip or two each)."""
MTIME_SLACK_S = 600.0
"""How far a file's modification time (the file server's clock) may lag the attempt's start
(rank 0's clock) before the file is taken for an earlier attempt's and not read."""


def _read_error_files(ev: RunEvidence, files: list[rd.FileInfo]) -> dict[str, object]:
    """source → what `rd.read_json` gave (a record, or the `rd.Problem` it raised) for each
    ``rank<N>.error.json`` this attempt may have written: one modified well before the attempt
    began (`MTIME_SLACK_S`: the storage's clock is not rank 0's) holds an older attempt's error,
    so it is not read at all; the record's own time still decides for the rest."""
    begins = ev.attempt.begins
    wanted = [f for f in files if _RANK_ERR.match(f.source)
              and (begins is None or f.mtime is None or f.mtime > begins - MTIME_SLACK_S)]

    def read(f: rd.FileInfo) -> object:
        try:
            return rd.read_json(f)
        except rd.Problem as e:
            return e
    with ThreadPoolExecutor(min(ERROR_FILE_READERS, max(1, len(wanted)))) as pool:
        return dict(zip((f.source for f in wanted), pool.map(read, wanted)))


def _record(ev: RunEvidence, f: rd.FileInfo, what: str, read: object = None) -> dict | None:
    """A JSON object file of the logs directory, or None; damage is a problem of this attempt
    only when the file is (an older attempt's broken file is not this failure's evidence).
    ``read``: the file's `rd.read_json` result or `rd.Problem`, when already read."""
    try:
        if isinstance(read, rd.Problem):
            raise read
        rec = read if read is not None else rd.read_json(f)
    except rd.Problem as e:
        if _fresh(ev, f.mtime):
            ev.problem(f.source, str(e))
        return None
    if not isinstance(rec, dict):
        if _fresh(ev, f.mtime):
            ev.problem(f.source, f"not {what} (a JSON object was expected)")
        return None
    return rec


def _error_file(ev: RunEvidence, f: rd.FileInfo, rank: int, read: object) -> None:
    rec = _record(ev, f, "an error record", read)
    if rec is None:
        return
    when = rec.get("time") if isinstance(rec.get("time"), (int, float)) else f.mtime
    if _fresh(ev, when):
        ev.error_files[rank] = {**rec, "_source": f.source}


def _elastic_file(ev: RunEvidence, f: rd.FileInfo) -> None:
    rec = _record(ev, f, "a torchelastic error record")
    if rec is None:
        return
    msg = rec.get("message")
    extra = msg.get("extraInfo") if isinstance(msg, dict) else None
    stamp = (extra or {}).get("timestamp") if isinstance(extra, dict) else None
    try:
        when = float(stamp) if stamp is not None else f.mtime
    except (TypeError, ValueError):
        when = f.mtime
    if _fresh(ev, when):
        ev.elastic.append((f, rec))


def _flight_file(ev: RunEvidence, f: rd.FileInfo, rank: int) -> None:
    """A JSON dump is read (capped); a pickled one (torch's own, on an NCCL timeout) is only
    named: unpickling runs code. One that names its attempt (`flight.ATTEMPT_KEY`, train's own;
    or in its file name, where train pointed torch's) counts for that attempt only."""
    try:
        head = rd.read_head(f.url).lstrip()
    except rd.Problem as e:
        ev.problem(f.source, str(e))
        return
    if not head.startswith(b"{"):
        ev.flight.append((f, rank, None))
        return
    try:
        doc = rd.read_json(f, rd.FLIGHT_CAP_BYTES)
    except rd.Problem as e:
        ev.problem(f.source, f"flight-recorder dump {e}")
        return
    if not isinstance(doc, dict):
        ev.flight.append((f, rank, None))
        return
    attempt = doc.get(ATTEMPT_KEY)
    if isinstance(attempt, int) and ev.attempt.number is not None \
            and attempt != ev.attempt.number:
        return  # an earlier attempt's, written within the slack of this one's start
    ev.flight.append((f, rank, doc))


def _last_metrics(ev: RunEvidence, run: RunDir) -> dict | None:
    records, problems = rd.read_jsonl_tail(run.metrics, rd.METRICS_TAIL_BYTES)
    for p in problems:
        if "read limit" not in p:
            ev.problem("metrics.jsonl", p)
    steps = [r for r in records if isinstance(r.get("step"), int)]
    return steps[-1] if steps else None


def _json_file(ev: RunEvidence, url: str, source: str) -> dict | None:
    info = rd.stat(url, source)
    if info is None:
        return None
    try:
        doc = rd.read_json(info)
    except rd.Problem as e:
        ev.problem(source, str(e))
        return None
    if not isinstance(doc, dict):
        ev.problem(source, "not a JSON object")
        return None
    return doc
