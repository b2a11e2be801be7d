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


def test_every_preflight_option_is_one_field_whose_docstring_is_the_flags_help(cli):
    from mscale.cli.options import flags
    from mscale.preflight.options import PreflightOptions

    code, out, _ = cli("preflight", "--help")
    assert code == 0
    text = " ".join(out.replace("│", " ").split())
    declared = flags(PreflightOptions)
    assert {f.flag for f in declared} == {"--level", "--timeout", "--json", "--prometheus",
                                          "--sysfs-root", "--storage-url", "--inject-slow"}
    for f in declared:
        hidden = f.extra.get("hidden", False)
        assert (f.flag in text) != hidden, f.flag
        if not hidden:
            assert " ".join(f.info.description.split())[:40] in text, f.flag


def test_the_local_launcher_hands_each_worker_its_options_whole(monkeypatch):
    """The workers get the launcher's options through one JSON variable (minus --json: the
    launcher prints the document), not re-spelled as flags."""
    from mscale.cli.options import build
    from mscale.preflight import options
    from mscale.preflight.local import worker_args, worker_env

    opts = build(options.PreflightOptions, {"level": "full", "timeout_s": 7.0, "as_json": True,
                                            "inject_slow": ["5:4"], "storage_url": "memory://s"},
                 run_dir="r", plan_path="p.yaml")
    env = worker_env(opts, "/logs")
    assert worker_args("p.yaml", opts)[2:] == ["--run-dir", "r"]
    monkeypatch.setenv(options.OPTIONS_ENV, env[options.OPTIONS_ENV])
    got = options.options_from_env()
    assert got == opts.model_copy(update={"as_json": False})
    assert got.inject_slow == {5: 4.0} and env["MSCALE_PREFLIGHT_LOGS"] == "/logs"


@pytest.mark.parametrize("target", ["plan", "preflight.json", "quarantine.json"])
def test_a_textfile_that_would_replace_an_input_is_refused_first(cli, tmp_path, target):
    """--prometheus naming the plan wrote the textfile over it at the end of the run (and the
    report or quarantine.json, which recover reads, likewise)."""
    plan = tmp_path / "plan.yaml"
    plan.write_text((PLANS / "cpu-tiny.yaml").read_text())
    run = tmp_path / "r"
    run.mkdir()
    (run / "quarantine.json").write_text('{"entries": []}')
    path = plan if target == "plan" else run / target
    before = path.read_text() if path.exists() else None
    code, _, err = cli("preflight", str(plan), "--run-dir", str(run), "--local", "8",
                       "--prometheus", str(path))
    assert code == 3 and "error: " in err and "--prometheus: this is the " in err, err
    assert (path.read_text() if path.exists() else None) == before
    assert sorted(p.name for p in run.iterdir()) == ["quarantine.json"]
