"""The CLI contract every command shares (main.py, app.py, output.py): exit codes, the one-line
error, --json error documents, the catch-all, --debug anywhere, help that is not cut short."""

import json
import re
import subprocess
import sys

import pytest

from mscale.errors import MscaleError

from tests.conftest import PLANS

CPU = ["--cluster", str(PLANS / "clusters" / "cpu-4x2.yaml"),
       "--model", str(PLANS / "models" / "tiny.yaml"),
       "--training", str(PLANS / "training" / "cpu-demo.yaml")]


def test_usage_error_exits_3(cli):
    code, _, _ = cli("no-such-command")
    assert code == 3


def test_version(cli):
    code, out, _ = cli("--version")
    assert code == 0 and out.startswith("mscale ")


def test_error_is_a_json_document_with_json_and_text_without(cli, tmp_path):
    missing = str(tmp_path / "nope.yaml")
    code, out, err = cli("plan", "--cluster", missing, *CPU[2:], "--json")
    assert code == 3 and err == ""
    doc = json.loads(out)["error"]
    assert doc == {"code": 3, "file": missing, "field": None, "message": "file not found",
                   "fix": doc["fix"]} and doc["fix"]
    code, out, err = cli("plan", "--cluster", missing, *CPU[2:])
    assert code == 3 and out == ""
    assert err == f"error: {missing}: file not found\n  fix: {doc['fix']}\n"


@pytest.mark.parametrize("args,field", [(["plan", "--bogus"], "--bogus"),
                                        (["plan", *CPU, "--top", "zero"], "--top"),
                                        (["ckpt", "verify"], "path")])
def test_usage_error_with_json_is_a_document(cli, args, field):
    code, out, err = cli(*args, "--json")
    doc = json.loads(out)["error"]
    assert code == 3 and doc["code"] == 3 and "Traceback" not in out + err
    assert doc["field"] == field and doc["message"] and "--help" in doc["fix"]


def _broken_search(monkeypatch):
    import mscale.planner.choose

    def search(pb):
        raise ZeroDivisionError("division by zero\nsecond line")

    monkeypatch.setattr(mscale.planner.choose, "search", search)


def test_unexpected_exception_is_one_line_and_exit_3(cli, monkeypatch):
    _broken_search(monkeypatch)
    code, out, err = cli("plan", *CPU)
    assert code == 3 and out == ""
    assert err == ("error: internal error: ZeroDivisionError: division by zero second line "
                   "(run with --debug for the traceback)\n")


def test_unexpected_exception_with_json(cli, monkeypatch):
    _broken_search(monkeypatch)
    code, out, _ = cli("plan", *CPU, "--json")
    doc = json.loads(out)["error"]
    assert code == 3 and doc["message"].startswith("internal error: ZeroDivisionError")
    assert "--debug" in doc["fix"]


@pytest.mark.parametrize("raised", [KeyboardInterrupt, EOFError])
def test_ctrl_c_is_one_line_and_130_and_an_eof_is_no_ctrl_c(cli, monkeypatch, raised):
    """click turns both into an Abort; only the Ctrl-C is an interruption."""
    import mscale.planner.choose

    def search(*a, **k):
        raise raised()

    monkeypatch.setattr(mscale.planner.choose, "search", search)
    code, out, err = cli("plan", *CPU)
    if raised is KeyboardInterrupt:
        assert (code, out, err) == (130, "", "interrupted (Ctrl-C) before the command finished\n")
        code, out, err = cli("plan", *CPU, "--json")  # stdout is still one document
        assert code == 130 and json.loads(out)["error"]["code"] == 130
    else:
        assert code == 3 and err.lstrip("\n").startswith("error: internal error: EOFError")


def test_ctrl_c_while_parsing_or_printing_help_is_one_line_and_130(cli, monkeypatch):
    """Outside a command's callback typer turned the KeyboardInterrupt into exit 130 with no
    line (a Ctrl-C sent as `mscale plan --help` printed)."""
    from typer import _click as click

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(click.Command, "get_help", interrupted)
    code, out, err = cli("plan", "--help")
    assert (code, err) == (130, "interrupted (Ctrl-C) before the command finished\n"), out


def test_a_ctrl_c_after_the_command_ended_keeps_its_code(monkeypatch):
    """A Ctrl-C as the command ends (`recover --execute` passing one on to a relaunch that is
    just finishing) raised where nothing caught it: Python then ends the process by SIGINT, exit
    -2 and no line. The command has said how it ended; its code stands."""
    import os
    import signal

    from mscale.cli import main as cli_main

    def late_ctrl_c_at_exit(code):
        os.kill(os.getpid(), signal.SIGINT)  # delivered before this returns
        raise SystemExit(code)

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(cli_main, "run", lambda: 1)
    monkeypatch.setattr(cli_main.sys, "exit", late_ctrl_c_at_exit)
    try:
        cli_main.main()
    except SystemExit as e:
        ended = e.code
    except KeyboardInterrupt:  # caught here: left to pytest it would stop the whole session
        ended = "KeyboardInterrupt"
    finally:
        signal.signal(signal.SIGINT, before)
    assert ended == 1


LATE_MARK = """
import sys
from mscale.cli import main as cli_main
def run():
    try:
        exec("raise KeyboardInterrupt")  # a Ctrl-C inside a dataclass's generated code
    except KeyboardInterrupt:
        return cli_main._interrupted(False)
cli_main.run = run
cli_main.main()
"""


def test_a_ctrl_c_caught_inside_generated_code_still_exits_130_not_by_sigint(tmp_path):
    """CPython marks a KeyboardInterrupt that leaves code run from a string as unhandled, even
    when it is caught further out, and a ``python -m`` program (as `mscale`'s own relaunches
    run) is then killed by SIGINT at exit: -2, not the 130 the interrupted line promised (2 to
    7 of 40 Ctrl-Cs sent to `mscale plan --help`)."""
    import os

    (tmp_path / "late_mark.py").write_text(LATE_MARK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    p = subprocess.run([sys.executable, "-m", "late_mark"], capture_output=True, text=True,
                       timeout=60, env=env, cwd=tmp_path)
    assert p.returncode == 130, p.stderr
    assert p.stderr == "interrupted (Ctrl-C) before the command finished\n"


def test_a_stdout_closed_by_its_reader_is_141_not_the_warning_1(cli, monkeypatch):
    """`mscale plan ... | head -1` exited 1, mscale's "warning": click answers EPIPE with
    sys.exit(1). 141 is what a shell reports for a command whose pipe's reader went away."""
    import errno

    import mscale.planner.choose

    def search(*a, **k):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")  # a write after head exited

    monkeypatch.setattr(mscale.planner.choose, "search", search)
    code, _, _ = cli("plan", *CPU)
    assert code == 141

    def rich_print(*a, **k):  # rich's Console: SystemExit(1) while handling the EPIPE
        try:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        except BrokenPipeError:
            raise SystemExit(1) from None

    monkeypatch.setattr(mscale.planner.choose, "search", rich_print)
    code, _, _ = cli("plan", *CPU)
    assert code == 141


def test_ctrl_c_while_the_cli_loads_is_one_line_and_130(cli, monkeypatch):
    import mscale.cli.app

    def register():
        raise KeyboardInterrupt  # where the command modules are imported

    monkeypatch.setattr(mscale.cli.app, "register", register)
    assert cli("plan", *CPU) == (130, "", "interrupted (Ctrl-C) before the command finished\n")


def _schema_error_of_a_ctrl_c() -> Exception:
    """pydantic-core's own SchemaError for a Ctrl-C while it builds a validator: Python code it
    runs then (here the regex compile of a ``pattern``) raises the KeyboardInterrupt, which it
    folds into its message, with no cause or context to follow."""
    import re

    from pydantic_core import SchemaValidator, core_schema

    compile_ = re.compile

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt

    re.compile = ctrl_c
    try:
        SchemaValidator(core_schema.str_schema(pattern="a+", regex_engine="python-re"))
    except Exception as e:  # noqa: BLE001 - the SchemaError is what the test needs
        return e
    finally:
        re.compile = compile_
    raise AssertionError("pydantic-core no longer turns the Ctrl-C into a SchemaError")


@pytest.mark.parametrize("where", ["command", "loading", "chained"])
def test_a_ctrl_c_that_pydantic_wrapped_is_one_line_and_130_not_bad_input(cli, monkeypatch,
                                                                          where):
    """Seen in a stress run of Ctrl-C near start-up: `SchemaError ... KeyboardInterrupt`,
    reported as an internal error with exit 3."""
    import mscale.cli.app
    import mscale.planner.choose

    wrapped = _schema_error_of_a_ctrl_c()
    assert type(wrapped).__name__ == "SchemaError" and "KeyboardInterrupt" in str(wrapped)

    def raise_it(*a, **k):
        if where == "chained":  # a later error raised while the Ctrl-C was being handled
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise RuntimeError("schema not built")  # noqa: B904 - as pydantic does
        raise wrapped

    if where == "loading":
        monkeypatch.setattr(mscale.cli.app, "register", raise_it)
    else:
        monkeypatch.setattr(mscale.planner.choose, "search", raise_it)
    code, out, err = cli("plan", *CPU)
    assert (code, out, err) == (130, "", "interrupted (Ctrl-C) before the command finished\n")


def test_debug_reraises_before_or_after_the_command(cli, monkeypatch):
    _broken_search(monkeypatch)
    for args in (["--debug", "plan", *CPU], ["plan", "--debug", *CPU], ["plan", *CPU, "--debug"]):
        with pytest.raises(ZeroDivisionError):
            cli(*args)


def test_debug_after_a_nested_command_reraises_mscale_errors(cli, tmp_path):
    with pytest.raises(MscaleError):
        cli("ckpt", "verify", str(tmp_path / "none"), "--debug")
    code, _, err = cli("ckpt", "verify", str(tmp_path / "none"))  # and is not left on
    assert code == 3 and err.startswith("error: ")


def test_debug_in_the_real_binary_shows_the_traceback_and_keeps_the_code(tmp_path):
    p = subprocess.run([sys.executable, "-m", "mscale.cli.main", "plan", "--debug",
                        "--cluster", str(tmp_path / "none.yaml"), *CPU[2:]],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and "Traceback" in p.stderr and "MscaleError" in p.stderr


@pytest.mark.parametrize("args", [[], ["plan"], ["train"], ["ckpt", "convert"]])
def test_help_off_a_terminal_is_full_width_and_flags_have_no_type(cli, args):
    code, out, _ = cli(*args, "--help")
    assert code == 0 and "…" not in out and "<bool>" not in out
    assert "--help" in out and max(len(line) for line in out.splitlines()) > 80


def test_plan_help_shows_every_recompute_choice(cli):
    _, out, _ = cli("plan", "--help")
    assert re.search(r"--recompute +none\|selective\|full +Given layout", out)
    assert "unless --keep-given" in out


@pytest.mark.parametrize("args, usage, row", [
    (["train"], "mscale train [OPTIONS] [PLAN]", r"PLAN +<str> +Plan file"),
    (["ckpt", "convert"], "mscale ckpt convert [OPTIONS] {SRC} {DST}", r"SRC +<str> +Checkpoint"),
    (["train"], None, r"--trace-ranks +replica\|all +Whose events"),
    (["data", "inspect"], None, r"--dtype +uint16\|uint32 +Token type"),
    (["plan"], None, r"--calibrate +<str> +A preflight.json"),  # repeatable: one value a time
    (["data", "prepare"], None, r"--text-ext +<str> +Also read files"),
])
def test_help_names_arguments_in_capitals_and_lists_an_options_words(cli, args, usage, row):
    """Not typer's ``{src}`` and a ``<str>`` where only some words are accepted."""
    _, out, _ = cli(*args, "--help")
    assert usage is None or usage in out
    assert re.search(row, out), out


@pytest.mark.parametrize("args, path", [
    (["plan", "--tp"], "mscale plan"),           # click gives no context for a missing value
    (["ckpt", "pin", "x", "--reason"], "mscale ckpt pin"),
    (["nope"], "mscale"),
])
def test_a_usage_error_points_to_the_help_of_the_command_given(cli, args, path):
    code, _, err = cli(*args)
    assert code == 3 and err.endswith(f"\n  fix: see `{path} --help`\n"), err


def test_usage_error_without_json_is_the_same_one_line_and_fix(cli):
    code, out, err = cli("plan", *CPU, "--top", "0")
    assert code == 3 and out == ""
    assert err.startswith("error: --top: ") and err.endswith("\n  fix: see `mscale plan --help`\n")
    assert err.count("\n") == 2 and "Usage:" not in err


@pytest.mark.parametrize("flags, says", [
    ((), "say what to write"),
    (("--to-hf", "--plan", "p.yaml"), "--plan and --to-hf both given"),
])
def test_ckpt_convert_names_what_is_wrong_with_its_output_flags(cli, tmp_path, flags, says):
    code, _, err = cli("ckpt", "convert", str(tmp_path / "src"), str(tmp_path / "dst"), *flags)
    assert code == 3 and says in err.splitlines()[0] and "Traceback" not in err


def test_python_m_mscale_is_the_console_script(tmp_path):
    """For an environment whose scripts are not on PATH: the same codes and output."""
    ok = subprocess.run([sys.executable, "-m", "mscale", "--version"], capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.startswith("mscale "), ok.stderr
    bad = subprocess.run([sys.executable, "-m", "mscale", "plan", "--cluster",
                          str(tmp_path / "none.yaml"), *CPU[2:]], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 3 and "error:" in bad.stderr and "Traceback" not in bad.stderr
