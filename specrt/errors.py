"""One exception type for user-facing mistakes: its message is one line that names the fix.

The CLI prints `error: <message>` and exits non-zero for these, never a traceback.
"""


class SpecrtError(Exception):
    """A problem the user can fix (bad input, missing file, mismatched engines)."""


def first_line(e: BaseException, default: str | None = None) -> str:
    """The first non-blank line of an exception's message (libraries' messages run to many lines), else
    `default` (the exception's type name when not given)."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else default if default is not None else type(e).__name__
