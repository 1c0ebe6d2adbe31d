"""One exception type for user-facing mistakes: its message is one line that names the fix.

The CLI prints `error: <message>` and exits non-zero for these, never a traceback.
"""


class SpecrtError(Exception):
    """A problem the user can fix (bad input, missing file, mismatched engines)."""
