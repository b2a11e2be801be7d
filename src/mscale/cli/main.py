"""Entry point of the ``mscale`` console script: runs the CLI and owns the exit codes.

Exit codes (errors.py): 0 OK, 1 warning / stopped early on request, 2 critical, 3 bad input or
could not run, 130 interrupted (Ctrl-C) before a command could stop in order, 141 stdout
closed by its reader (``mscale plan ... | head``: 128 + SIGPIPE, as a shell reports ``yes |
head``; rich's and click's own answer, 1, read as a warning). Every failure is reported here,
once, for every command:

- an MscaleError: its file, field, message and fix, with its own code;
- a usage error (click exits 2): reported like an MscaleError naming the option, exit 3, so
  that 2 always means "a check failed";
- anything else is a bug or an unforeseen input: exit 3 and one line, never a traceback and never
  1, which would read as "stopped early on request". ``--debug`` re-raises instead.

``--json`` anywhere on the line makes the report one JSON document on stdout; ``--debug`` is
accepted anywhere too (``mscale plan --debug ...``), so it is taken out before typer parses.
"""

from __future__ import annotations

import errno
import signal
import sys
import traceback
from typing import Sequence

# typer, click and the command modules are imported inside `run`, under its handling: a Ctrl-C
# in the first fraction of a second, while they load, ends with one line and 130 like any other
# interruption, not a KeyboardInterrupt traceback from the console script's own import.
from mscale.errors import EXIT_BAD_INPUT, MscaleError, carries_interrupt

EXIT_INTERRUPTED = 130
"""What a shell reports for a command ended by Ctrl-C (128 + SIGINT)."""

EXIT_PIPE_CLOSED = 141
"""What a shell reports for a command whose stdout's reader went away (128 + SIGPIPE)."""

_END_OF_OPTIONS = "--"


def _options(argv: list[str]) -> list[str]:
    """The part of the command line that can hold options (before a bare ``--``)."""
    return argv[: argv.index(_END_OF_OPTIONS)] if _END_OF_OPTIONS in argv else argv


def _take_debug(argv: list[str]) -> tuple[list[str], bool]:
    opts = _options(argv)
    if "--debug" not in opts:
        return argv, False
    return [a for a in opts if a != "--debug"] + argv[len(opts):], True


def _usage_error(e, root=None, argv: Sequence[str] = ()) -> MscaleError:
    """A click usage error as an MscaleError: the same one line and ``fix:`` as every other
    error (click's own form is a usage banner and no fix), or the same --json document."""
    ctx = getattr(e, "ctx", None)
    param = getattr(e, "param", None)
    field = (param.opts[0] if param is not None and getattr(param, "opts", None)
             else getattr(e, "option_name", None))
    path = ctx.command_path if ctx is not None else _command_path(root, argv)
    message = e.format_message().replace("Value error, ", "")  # typer's choice check says it
    return MscaleError(message, field=field, fix=f"see `{path} --help`")


def _command_path(root, argv: Sequence[str]) -> str:
    """``mscale plan`` for ``plan --tp`` (an option missing its value comes with no context):
    the leading words of ``argv`` that name commands under ``root``."""
    words, group = ["mscale"], root
    for word in argv:
        sub = getattr(group, "commands", {}).get(word)
        if sub is None:
            break
        words.append(word)
        group = sub
    return " ".join(words)


def _internal_error(e: Exception) -> MscaleError:
    if isinstance(e, OSError) and e.filename and e.strerror:
        # the system refused a file the command touched (a path under /proc, a full disk):
        # the file and the system's words, as for any bad input, not "internal error"
        other = f" (to {e.filename2})" if e.filename2 else ""  # a rename's destination
        return MscaleError(f"{e.strerror}{other} ({type(e).__name__}, errno {e.errno})",
                           file=str(e.filename),
                           fix="check the path and the filesystem it is on (run with --debug "
                               "for the traceback)")
    detail = " ".join(str(e).split())[:500]
    return MscaleError(f"internal error: {type(e).__name__}: {detail}",
                       fix="run with --debug for the traceback")


def run(argv: list[str] | None = None) -> int:
    """Run the CLI and return the exit code instead of exiting (used by tests and `main`)."""
    try:
        return _run(argv)
    # a Ctrl-C while the CLI loaded, or in a command with no handling of its own; or one in
    # disguise (`carries_interrupt`: pydantic's SchemaError while the CLI loaded)
    except (KeyboardInterrupt, Exception) as e:  # noqa: BLE001
        if not carries_interrupt(e):
            raise
        return _interrupted("--json" in _options(list(sys.argv[1:] if argv is None else argv)))


def _interrupted(as_json: bool) -> int:
    """One line on stderr, and with ``--json`` the error document stdout always ends with
    (written here, not by `output.print_error`: the Ctrl-C may have cut its import short)."""
    sys.stderr.write(INTERRUPTED + "\n")
    if as_json:
        import json

        sys.stdout.write(json.dumps({"error": {"code": EXIT_INTERRUPTED, "file": None,
                                               "field": None, "message": INTERRUPTED,
                                               "fix": "run the command again"}}, indent=2)
                         + "\n")
        sys.stdout.flush()
    return EXIT_INTERRUPTED


INTERRUPTED = "interrupted (Ctrl-C) before the command finished"
"""The one line for a Ctrl-C that no command handled: a command that can stop in order (train
saves a checkpoint) says more itself."""


def _run(argv: list[str] | None) -> int:
    from typer._click.exceptions import NoArgsIsHelpError
    from typer.exceptions import Abort, Exit, TyperException

    from mscale.cli.app import STATE, Interrupted, build
    from mscale.cli.output import configure_help, print_error

    argv, debug = _take_debug(list(sys.argv[1:] if argv is None else argv))
    as_json = "--json" in _options(argv)
    STATE["debug"] = debug
    configure_help(sys.stdout)
    app = build()
    try:
        rv = app.main(args=argv, standalone_mode=False, prog_name="mscale")
    except NoArgsIsHelpError as e:  # `mscale ckpt` alone: the help is the answer
        e.show()
        return EXIT_BAD_INPUT
    except TyperException as e:  # usage errors and other click-style exceptions
        print_error(_usage_error(e, app, argv), as_json)
        return EXIT_BAD_INPUT
    except Exit as e:
        return e.exit_code
    except SystemExit as e:
        if _stdout_closed(e):  # rich's and click's answer to EPIPE: exit 1, a "warning" here
            return EXIT_PIPE_CLOSED
        raise
    except Interrupted:
        return _interrupted(as_json)
    except Abort as e:  # typer's form of an EOFError: an input ended early, no request to stop
        return _unexpected(e.__cause__ or e, debug, as_json, print_error)
    except Exception as e:  # noqa: BLE001 - the CLI's edge: no traceback reaches the user
        if carries_interrupt(e):  # e.g. while the command tree's schemas were built
            return _interrupted(as_json)
        if not isinstance(e, MscaleError):
            return _unexpected(e, debug, as_json, print_error)
        if debug:
            raise
        print_error(e, as_json)
        return e.code
    return rv if isinstance(rv, int) else 0


def _stdout_closed(e: SystemExit) -> bool:
    """The exit is a write's EPIPE: rich's console and click (in typer) both call sys.exit(1)
    while handling the write's OSError, so it is the exit's context."""
    return isinstance(e.__context__, OSError) and e.__context__.errno == errno.EPIPE


def _unexpected(e: Exception, debug: bool, as_json: bool, print_error) -> int:
    """A bug or an unforeseen input: one line, exit 3 (``--debug``: the traceback)."""
    if debug:
        raise e
    err = _internal_error(e)
    if as_json or err.file:
        print_error(err, as_json)
    else:
        sys.stderr.write(f"error: {err.message} (run with --debug for the traceback)\n")
    return err.code


def starts_training_here(argv: Sequence[str]) -> bool:
    """Whether this process is a training task itself (`mscale train` under srun or torchrun),
    not the `--local` launcher, which forks its workers and passes its own signals on."""
    args = list(argv)
    return "train" in args and not any(a == "--local" or a.startswith("--local=") for a in args)


def main() -> None:
    """The console script. With --debug, run() re-raises: show the traceback, keep the code."""
    if starts_training_here(sys.argv[1:]):
        # before torch is imported: SLURM's time-limit warning can come while it loads
        from mscale.distributed import early_signals

        early_signals.remember()
    try:
        code = run()
    except MscaleError as e:
        traceback.print_exc()
        code = e.code
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        code = EXIT_BAD_INPUT
    # the command has ended and said so: a Ctrl-C now (as `recover --execute` passes one on to
    # a relaunch that is just ending) would raise where nothing catches it, and Python would
    # end the process by SIGINT (exit -2) with no line, in place of the command's own code
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A Ctrl-C that broke into code run from a string (dataclasses and namedtuple build their
    # methods so, while modules load) leaves CPython's "unhandled Ctrl-C" mark set, though
    # `run` caught it: at exit the interpreter then kills itself by SIGINT (-2) in place of
    # `code`. Each string run clears the mark first; this one does only that.
    exec("pass")  # noqa: S102 - a constant
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
