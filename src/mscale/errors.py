"""One error type for everything a user can get wrong, and the exit codes every command shares.

Exit codes follow the Nagios plugin convention that health checks already use (docs/references.md):
0 OK, 1 warning / degraded, 2 critical (a check failed, the job must not run), 3 bad input or
could not run. 130 (128 + SIGINT, the shell's own code) is an operator's interruption that left no
checkpoint behind: a second Ctrl-C, or one during start-up. The CLI turns an `MscaleError` into one message naming the file, the field and the
fix, with no traceback (``--debug`` shows one).
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_OK = 0
EXIT_WARNING = 1
EXIT_CRITICAL = 2
EXIT_BAD_INPUT = 3
EXIT_INTERRUPTED = 130


@dataclass
class MscaleError(Exception):
    """A problem the user can fix: bad input, a layout that cannot work, a missing file.

    Attributes name where the problem is and what to do, so the message is actionable without
    reading code.
    """

    message: str
    file: str | None = None
    """The file the problem is in (a YAML config, a plan, a manifest), if any."""
    field: str | None = None
    """Dotted path of the offending field inside that file, e.g. ``layout.tp``."""
    fix: str | None = None
    """One sentence telling the user what to change."""
    code: int = EXIT_BAD_INPUT
    """Process exit code the CLI uses for this error."""

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __str__(self) -> str:
        where = ": ".join(p for p in (self.file, self.field) if p)
        text = f"{where}: {self.message}" if where else self.message
        if self.fix:
            text += f"\n  fix: {self.fix}"
        return text


def carries_interrupt(exc: BaseException | None) -> bool:
    """``exc`` is a Ctrl-C in disguise: a KeyboardInterrupt, an exception raised from one or
    while handling one, or pydantic-core's SchemaError naming one (a Ctrl-C while pydantic builds a
    schema, at import or at a model's first use, comes out as ``SchemaError: Error building
    ... KeyboardInterrupt:``, with no cause to follow). Reported as bad input (exit 3), it
    read as if a file were wrong; the CLI ends it as an interruption (exit 130)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, KeyboardInterrupt):
            return True
        if type(exc).__name__ == "SchemaError" and any(
                line.strip().startswith("KeyboardInterrupt") for line in str(exc).splitlines()):
            return True
        # a context hidden on purpose (``raise ... from None`` in a handler) is the code's
        # own answer to the Ctrl-C, not a disguise
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return False
