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


def test_a_rename_that_does_not_replace_is_an_error_not_a_silent_no_op():
    """webhdfs answers a rename onto an existing file with `false` and fsspec moves on: `latest`
    would never advance past the first checkpoint, and every resume would abandon the rest."""
    import io

    from mscale.runs.atomic import _put_whole

    class NoReplace:  # the calls `_put_whole` makes, over a dict
        protocol = "webhdfs"

        def __init__(self):
            self.files = {}

        def open(self, path, mode):
            fs = self

            class W(io.BytesIO):
                def close(self):
                    fs.files[path] = self.getvalue()
                    super().close()
            return W()

        def mv(self, src, dst):
            if dst not in self.files:  # onto an existing file: refused, silently
                self.files[dst] = self.files.pop(src)

        def exists(self, path):
            return path in self.files

        def rm(self, path):
            del self.files[path]

    fs = NoReplace()
    _put_whole(fs, "/run/ckpt/latest", b"step-000002\n")
    try:
        _put_whole(fs, "/run/ckpt/latest", b"step-000004\n")
    except OSError as e:
        assert "left the old file in place" in str(e)
    else:
        raise AssertionError("the failed replace was silent")
    assert fs.files == {"/run/ckpt/latest": b"step-000002\n"}  # no temporary left behind
