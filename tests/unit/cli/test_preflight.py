"""``mscale preflight``'s parsing: --level is a choice that --help lists, and a bad value is the
usual one-line usage error, exit 3, before the plan is even read."""

import json

import pytest

from tests.conftest import PLANS


def test_help_lists_the_levels(cli):
    code, out, _ = cli("preflight", "--help")
    assert code == 0 and "quick|full" in out


@pytest.mark.parametrize("as_json", [False, True])
def test_a_bad_level_is_a_one_line_usage_error(cli, tmp_path, as_json):
    args = ["preflight", str(PLANS / "cpu-tiny.yaml"), "--run-dir", str(tmp_path / "r"),
            "--level", "deep"] + (["--json"] if as_json else [])
    code, out, err = cli(*args)
    assert code == 3
    if as_json:
        error = json.loads(out)["error"]
        assert error["field"] == "--level" and "'deep' is not one of 'quick', 'full'" in \
            error["message"]
        return
    assert err.startswith("error: --level: Invalid value for '--level': 'deep' is not one of "
                          "'quick', 'full'.\n  fix: see `mscale preflight --help`")
    assert "Value error" not in err and err.count("\n") == 2 and out == ""
    assert not (tmp_path / "r").exists()
