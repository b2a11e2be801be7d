"""The typer application: one sub-app or command per module, registered here.

Each command module stays thin: parse options, call the library, print, choose the exit code.
`build` turns the app into the click command that `main.run` executes, with the help tidied for
every command at once, so command modules need no help-formatting code of their own.
"""

from __future__ import annotations

import functools

import typer

from mscale import __version__
from mscale.errors import carries_interrupt

HELP_OPTION_NAMES = ["-h", "--help"]

app = typer.Typer(
    name="mscale",
    help="Plan, check, train, watch, checkpoint and recover LLM training on thousands of GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": HELP_OPTION_NAMES},
)

STATE = {"debug": False}
"""Set by `main.run`, which takes ``--debug`` from anywhere on the command line."""


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mscale {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors (accepted "
                               "anywhere on the command line)."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """mscale: a toolchain for large-scale LLM training (after MegaScale, NSDI 2024)."""
    if debug:  # main.run normally strips --debug first; never clear what it set
        STATE["debug"] = True


def register() -> typer.Typer:
    """Import every command module so that it attaches itself to `app`."""
    import importlib

    for name in ("plan", "train", "ckpt", "watch", "preflight", "recover", "recover_supervise",
                 "data"):
        try:
            importlib.import_module(f"mscale.cli.{name}")
        except ModuleNotFoundError as e:  # a command module not written yet
            if e.name != f"mscale.cli.{name}":
                raise
    return app


class Interrupted(Exception):
    """A Ctrl-C that a command did not handle itself, on its way to `main.run`: typer would
    turn the KeyboardInterrupt into a silent exit 130, with no line to say why it stopped."""


def _interruptible(callback):
    @functools.wraps(callback)
    def wrapper(*args, **kwargs):
        try:
            return callback(*args, **kwargs)
        except (KeyboardInterrupt, Exception) as e:  # noqa: BLE001 - only a Ctrl-C, or one
            if not carries_interrupt(e):  # in disguise (carries_interrupt), is turned
                raise
            raise Interrupted() from e

    return wrapper


def _item_type(param) -> str:
    """The name of one value of a repeatable option (``str`` for ``list[str]``)."""
    from typing import get_args

    args = get_args(getattr(getattr(param, "type_descriptor", None), "annotation", None))
    return getattr(args[0], "__name__", "str") if args else "str"


def build():
    """The click command tree of the whole CLI, with flags shown without a type, and every
    command's unhandled Ctrl-C raised as `Interrupted`.

    typer labels every on/off flag (``--json``, ``--sp/--no-sp``, ``-h``) with ``<bool>``, which
    reads as if the flag took a value; an empty metavar makes the help show the flag alone. A
    repeatable option reads ``<list[str]>``, as if it took a list literal: it takes one value a
    time, so it is labelled by the type of one (``<str>``; its help says "repeatable").
    """
    import typer.main
    from typer import _click as click

    root = typer.main.get_command(register())
    todo = [(root, None)]
    while todo:
        cmd, parent = todo.pop()
        settings = {"help_option_names": HELP_OPTION_NAMES, **cmd.context_settings}
        ctx = click.Context(cmd, parent=parent, **settings)
        for param in cmd.get_params(ctx):  # includes the help option, created and cached here
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
            elif param.param_type_name == "argument" and param.metavar is None:
                param.metavar = param.name.upper()  # typer adds "..." and its brackets
            elif getattr(param, "multiple", False) and param.metavar is None:
                param.metavar = f"<{_item_type(param)}>"
        if cmd.callback is not None:
            cmd.callback = _interruptible(cmd.callback)
        # parsing, which prints --help: a Ctrl-C there became typer's silent exit 130
        cmd.parse_args = _interruptible(cmd.parse_args)
        todo += [(sub, ctx) for sub in getattr(cmd, "commands", {}).values()]
    return root
