"""The typer application: one sub-app or command per module, registered here.

Each command module stays thin: parse options, call the library, print, choose the exit code.
"""

from __future__ import annotations

import typer

from mscale import __version__

app = typer.Typer(
    name="mscale",
    help="Plan, check, train, watch, checkpoint and recover LLM training on thousands of GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

STATE = {"debug": False}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mscale {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """mscale: a toolchain for large-scale LLM training (after MegaScale, NSDI 2024)."""
    STATE["debug"] = debug


def register() -> typer.Typer:
    """Import every command module so that it attaches itself to `app`."""
    import importlib

    for name in ("plan", "train", "ckpt"):
        try:
            importlib.import_module(f"mscale.cli.{name}")
        except ModuleNotFoundError as e:  # a command module not written yet
            if e.name != f"mscale.cli.{name}":
                raise
    return app
