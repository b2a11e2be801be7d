"""Entry point of the ``mscale`` console script: runs the typer app and owns the exit codes.

Exit codes (errors.py): 0 OK, 1 warning, 2 critical, 3 bad input or could not run. Usage errors
(typer/click exit 2) are remapped to 3 so that 2 always means "a check failed".
"""

from __future__ import annotations

import sys

from typer.exceptions import Abort, Exit, TyperException

from mscale.errors import EXIT_BAD_INPUT, MscaleError

_USAGE_EXIT = 2  # what typer's vendored click uses for a usage error


def run(argv: list[str] | None = None) -> int:
    """Run the CLI and return the exit code instead of exiting (used by tests and `main`)."""
    from mscale.cli.app import STATE, register

    app = register()
    try:
        rv = app(args=argv, standalone_mode=False, prog_name="mscale")
    except TyperException as e:  # usage errors and other click-style exceptions
        show = getattr(e, "show", None)
        show() if show else sys.stderr.write(f"error: {e.format_message()}\n")
        return EXIT_BAD_INPUT if e.exit_code == _USAGE_EXIT else e.exit_code
    except Exit as e:
        return e.exit_code
    except Abort:
        sys.stderr.write("aborted\n")
        return 130
    except MscaleError as e:
        if STATE["debug"]:
            raise
        sys.stderr.write(f"error: {e}\n")
        return e.code
    return rv if isinstance(rv, int) else 0


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":  # pragma: no cover
    main()
