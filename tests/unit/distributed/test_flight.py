"""distributed/flight.py: the recorder is on unless the operator sized it, and a dump keeps
what recover compares under the name recover reads."""

from __future__ import annotations

from mscale.distributed import flight
from mscale.recover.diagnose.evidence import _FLIGHT


def test_on_by_default_and_an_operators_size_stands():
    env: dict = {}
    flight.enable(env)
    assert env == {flight.BUFFER_ENV: str(flight.DEFAULT_ENTRIES),
                   flight.DUMP_ON_TIMEOUT_ENV: "1"} and flight.enabled(env)
    for theirs in ({flight.BUFFER_ENV: "0", flight.DUMP_ON_TIMEOUT_ENV: "0"},
                   {flight.LEGACY_BUFFER_ENV: "0", flight.DUMP_ON_TIMEOUT_ENV: "0"},
                   {flight.BUFFER_ENV: "50", flight.DUMP_ON_TIMEOUT_ENV: "1"}):
        env = dict(theirs)
        flight.enable(env)
        assert env == theirs
    assert not flight.enabled({flight.BUFFER_ENV: "0"})
    assert not flight.enabled({flight.LEGACY_BUFFER_ENV: "x"})
    assert flight.enabled({flight.LEGACY_BUFFER_ENV: "20000"})


def test_the_dump_name_is_one_recover_reads():
    m = _FLIGHT.search(flight.dump_name(12))
    assert m and int(m.group("rank")) == 12 and m.group("attempt") is None


def test_torchs_own_dump_goes_to_the_runs_logs_under_its_attempt(tmp_path):
    """NCCL's watchdog may end a timed-out process before train can dump: torch's dump on a
    timeout is then the record, named so that recover reads it for its attempt alone."""
    env: dict = {}
    prefix = flight.point_torch_dump(str(tmp_path / "logs"), 3, env)
    assert prefix == str(tmp_path / "logs" / "nccl_trace_attempt3_rank_")
    assert all(env[name] == prefix for name in flight.DUMP_FILE_ENVS)
    m = _FLIGHT.search((prefix + "17").rsplit("/", 1)[-1])  # torch appends the rank
    assert m and (m.group("attempt"), m.group("rank")) == ("3", "17")
    theirs = {flight.DUMP_FILE_ENVS[1]: "/scratch/fr_"}  # an operator's place stands
    assert flight.point_torch_dump(str(tmp_path), 3, theirs) is None
    assert theirs == {flight.DUMP_FILE_ENVS[1]: "/scratch/fr_"}
    assert flight.point_torch_dump("s3://bucket/run/logs", 3, env := {}) is None and env == {}
    assert flight.point_torch_dump(f"file://{tmp_path}/logs", 1, env) == \
        str(tmp_path / "logs" / "nccl_trace_attempt1_rank_")


def test_a_dump_keeps_every_groups_newest_entry_and_the_newest_overall():
    entries = [{"process_group": ["dp", ""], "collective_seq_id": 1}]
    entries += [{"process_group": ["tp", ""], "collective_seq_id": i} for i in range(200)]
    entries += [{"process_group": ["pp", ""], "collective_seq_id": 0, "is_p2p": True}]
    kept = flight.trimmed(entries)
    assert len(kept) == flight.KEEP_NEWEST + 1
    assert kept[0] == entries[0]  # dp's only entry, far back
    assert kept[-1] == entries[-1] and kept[-2]["collective_seq_id"] == 199
    assert flight.trimmed([]) == []


def test_no_record_without_a_process_group(monkeypatch, tmp_path):
    monkeypatch.setenv(flight.BUFFER_ENV, "100")
    assert flight.record() is None
    assert flight.write_dump(str(tmp_path), 0) is None and not list(tmp_path.iterdir())
