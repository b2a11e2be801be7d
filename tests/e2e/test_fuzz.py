"""Bad input to every command ends in a report, never a traceback, a hang or damage.

Over 200 cases (fuzz_cases.py, fuzz_ckpt_cases.py) over `plan`, `train` (before its workers
start), `ckpt ls`, `ckpt verify` and `ckpt convert`: files that are binary, UTF-16, empty, nested
200k deep, directories, FIFOs or on an unknown fsspec protocol; numbers that are 0, negative,
NaN, infinite or absurdly large; checkpoints whose metadata is well-formed but wrong. Each must
exit 3 (or its documented code: 2 for a damaged checkpoint), name the file and field at fault,
end with a ``fix:`` line, and leave every input file as it was (no stray ``foo:`` directory).

Most cases run in process through `mscale.cli.main.run` (fast); those that might hang or
exhaust memory today, and a dozen more, run through the real binary under a time and memory cap.
A few start real workers (``--local 2``) for what only a worker can find.

A case whose fix is still pending is listed in `PENDING` under its owner and marked
xfail(strict): when the fix lands, it passes, strict turns that into a failure, and the line
must go.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
from pathlib import Path

import pytest

from tests.e2e.fuzz_cases import Case, plan_cases, train_cases
from tests.e2e.fuzz_ckpt_cases import convert_cases, ls_cases, verify_cases
from tests.e2e.fuzz_inputs import MSCALE, Workspace, build_base, snapshot

pytestmark = pytest.mark.e2e

LIMIT_S = 30
"""A bad number must fail in seconds, not search or allocate for minutes."""
LIMIT_BYTES = 4 << 30
"""Address-space cap of a real-binary run: a bad size must not take the machine's memory."""

PENDING: dict[str, list[str]] = {
}
"""Cases that fail today, by the owner of the fix (case ids)."""

_OWNER = {case_id: owner for owner, ids in PENDING.items() for case_id in ids}
CASES = [*plan_cases(), *train_cases(), *ls_cases(), *verify_cases(), *convert_cases()]


def _params(cases: list[Case]) -> list:
    return [pytest.param(c, id=c.id, marks=[pytest.mark.xfail(
        strict=True, reason=f"owner: {_OWNER[c.id]}")] if c.id in _OWNER else [])
        for c in cases]


class WorkersStarted(BaseException):
    """An in-process case got as far as starting worker processes: bad input must fail first.
    (A BaseException, so that the CLI's catch-all cannot turn it into an exit code.)"""


@pytest.fixture(scope="session")
def base(tmp_path_factory):
    b = build_base(tmp_path_factory.mktemp("fuzz-base"))
    return b, snapshot(b.root)


@contextlib.contextmanager
def memory_cap(extra: int = LIMIT_BYTES):
    """Cap this process's address space at its current size plus ``extra`` while a case runs:
    a regression that allocates without bound raises MemoryError (the case fails) instead of
    drawing the OOM killer onto pytest or onto whatever else runs on the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * resource.getpagesize()
    cap = size + extra if hard == resource.RLIM_INFINITY else min(size + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def run_in_process(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    from mscale.cli.main import run

    def refuse(*args, **kwargs):
        raise WorkersStarted(f"a process was started for {argv}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    capsys.readouterr()
    with memory_cap():
        code = run(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))


def run_binary(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """The real `mscale`, in its own session so that a timeout kills whatever it started."""
    p = subprocess.Popen([MSCALE, *argv], cwd=cwd, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=_cap_memory)
    try:
        out, err = p.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"still running after {LIMIT_S} s: {argv}\n{out[-2000:]}{err[-2000:]}")
    return p.returncode, out, err


def check_report(case: Case, ws: Workspace, argv: list[str], code: int, out: str,
                 err: str) -> None:
    """The contract of a bad input's report (module docstring)."""
    text = out + err
    assert code in case.codes(), f"exit {code}, expected {case.codes()}:\n{text[-3000:]}"
    assert "Traceback" not in text and "internal error" not in text, text[-3000:]
    if code == 0:
        return
    if "--json" in argv:
        doc = json.loads(out)  # one document, nothing else on stdout
        if "error" in doc:
            assert doc["error"]["code"] == code and doc["error"]["fix"], doc
    elif code == 3 or err.startswith(("error", "warning")):
        assert err.startswith(("error", "warning")) and "\n  fix: " in err, err
    if ws.bad:
        named = ws.bad in text or (code != 3 and os.path.basename(ws.bad) in text)
        assert named, f"the report does not name {ws.bad}:\n{text[-3000:]}"
    if case.field:
        assert case.field in text, f"the report does not name field {case.field}:\n{text[-3000:]}"


def _workspace(tmp_path: Path, base) -> Workspace:
    root = tmp_path / "ws"
    root.mkdir()
    return Workspace(root, base[0])


def _run_case(case: Case, tmp_path, base, monkeypatch, capsys, binary: bool) -> None:
    ws = _workspace(tmp_path, base)
    monkeypatch.chdir(ws.root)
    argv = case.build(ws)
    before = snapshot(ws.root)
    if binary or case.isolate:
        code, out, err = run_binary(argv, ws.root)
    else:
        code, out, err = run_in_process(argv, monkeypatch, capsys)
    check_report(case, ws, argv, code, out, err)
    assert snapshot(ws.root) == before, "the command changed or created files"
    assert snapshot(base[0].root) == base[1], "the command changed a shared input"


@pytest.mark.timeout(2 * LIMIT_S)  # a hang fails the case instead of stalling the suite
@pytest.mark.parametrize("case", _params(CASES))
def test_bad_input(case, tmp_path, base, monkeypatch, capsys):
    _run_case(case, tmp_path, base, monkeypatch, capsys, binary=False)


@pytest.mark.parametrize("case", _params([c for c in CASES if c.subprocess]))
def test_bad_input_real_binary(case, tmp_path, base, monkeypatch, capsys):
    _run_case(case, tmp_path, base, monkeypatch, capsys, binary=True)


def test_the_suite_is_broad():
    """Every command is fuzzed, every case id is unique, and PENDING names only real cases."""
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) > 150
    for prefix in ("plan-", "train-", "ls-", "verify-", "convert-"):
        assert sum(i.startswith(prefix) for i in ids) >= 10, prefix
    assert set(_OWNER) <= set(ids)


def _tokens_beyond_vocab(ws: Workspace) -> list[str]:
    """Token ids of 300 for a vocabulary of 256: `--local` finds them before starting workers
    (the first MiB of every source is checked); under srun every worker finds them the same way."""
    import struct

    tokens = ws.put("tokens.bin", struct.pack("<4096H", *([300] * 4096)))
    plan = ws.variant(ws.base.plan2, "plan.yaml", {"training.data": {
        "kind": "tokens", "path": tokens, "dtype": "uint16"}})
    ws.mark(tokens)
    return ["train", plan, "--run-dir", str(ws.root / "job"), "--local", "2", "--steps", "1"]


def _resume_flipped_shard(ws: Workspace) -> list[str]:
    """A committed checkpoint with one bit flipped in a shard: found when the workers load it."""
    from tests.e2e.fuzz_ckpt_cases import shard

    ckpt = shard("flipped")(ws)
    return ["train", str(ws.base.plan2), "--run-dir", str(ws.root / "job"), "--local", "2",
            "--steps", "6", "--resume", ckpt]


@pytest.mark.parametrize("build,codes", [(_tokens_beyond_vocab, (3,)),
                                         (_resume_flipped_shard, (2, 3))],
                         ids=["tokens-beyond-vocab", "resume-flipped-shard"])
def test_bad_input_found_by_workers(build, codes, tmp_path, base):
    """Two real jobs (--local 2) whose bad input is found in the file's contents: nothing runs
    on, the report names the file, and the inputs are untouched."""
    ws = _workspace(tmp_path, base)
    argv = build(ws)
    before = snapshot(ws.root)
    p = subprocess.run([MSCALE, *argv], cwd=ws.root, capture_output=True, text=True, timeout=180)
    assert p.returncode in codes, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    assert os.path.basename(ws.bad) in p.stdout + p.stderr, p.stdout + p.stderr
    after = {k: v for k, v in snapshot(ws.root).items() if not k.startswith("job")}
    assert after == before
