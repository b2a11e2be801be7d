import json
import os

from mscale.runs.atomic import append_line, read_jsonl, write_text_atomic


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "a" / "f.json"
    write_text_atomic(str(p), "one")
    write_text_atomic(str(p), "two")
    assert p.read_text() == "two"
    assert os.listdir(p.parent) == ["f.json"]


def test_fsspec_memory_url():
    write_text_atomic("memory://run/x.txt", "hello")
    import fsspec

    with fsspec.open("memory://run/x.txt", "r") as f:
        assert f.read() == "hello"


def test_jsonl_skips_only_a_torn_last_line(tmp_path):
    p = str(tmp_path / "m.jsonl")
    append_line(p, json.dumps({"step": 1}))
    append_line(p, json.dumps({"step": 2}))
    with open(p, "a") as f:
        f.write('{"step": 3, "lo')  # a crash mid-append
    assert [r["step"] for r in read_jsonl(p)] == [1, 2]


def test_a_line_separator_inside_a_string_does_not_split_a_record(tmp_path):
    """JSON writes U+2028, U+2029 and U+0085 raw inside strings; str.splitlines cut the record
    there, and events.jsonl became unreadable for every reader (next attempt, recover, pins)."""
    from mscale.config.records import Event

    f = tmp_path / "events.jsonl"
    for text in ("a\u2028b", "c\u2029d", "e\u0085f"):
        append_line(str(f), Event(source="train", kind="info", message=text).model_dump_json())
    assert [r["message"] for r in read_jsonl(str(f))] == ["a\u2028b", "c\u2029d", "e\u0085f"]
