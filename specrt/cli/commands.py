"""The command plumbing of the `specrt` CLI: typer's command and group classes, in which a user mistake becomes one
line, `error: <message>`, and exit code 2, never a traceback or a boxed usage screen. The commands themselves are
plain functions (specrt/cli/main.py registers them with Command); this module imports none of them."""

from __future__ import annotations

import errno
from contextlib import contextmanager
from enum import Enum

import typer
from typer.core import TyperCommand, TyperGroup

from ..errors import SpecrtError

try:  # newer typer carries its own copy of click
    from typer._click import exceptions as _click_errors
except ImportError:  # pragma: no cover
    from click import exceptions as _click_errors
UsageError = _click_errors.UsageError
NoArgsIsHelpError = getattr(_click_errors, "NoArgsIsHelpError", ())  # a bare `specrt` raises it to show the help


def fail(msg: str):
    typer.secho(f"error: {msg}", err=True, fg=typer.colors.RED)
    raise typer.Exit(2)


# the fix a range error on these flags adds to its line (typer checks the range; the hint is ours)
RANGE_HINTS = {"--max-new-tokens": "e.g. --max-new-tokens 256", "--seed": "omit it for a random seed",
               "--repeat-calls": "0 = off", "--vocab": "0 = the full vocabulary"}


def usage_line(e: UsageError) -> str:
    """click's usage error on one line: where typer checked a flag's range or choices, in the words of specrt's own
    checks (--parallel must be >= 1, got 0), else click's message."""
    param, cause = getattr(e, "param", None), e.__cause__
    found = cause.errors()[0] if param is not None and hasattr(cause, "errors") and cause.errors() else None
    if found is None:
        return " ".join(e.format_message().split())
    flag = next((o for o in param.opts if o.startswith("--")), param.opts[0])
    lo, hi = getattr(param, "min", None), getattr(param, "max", None)
    if found["type"] in ("greater_than_equal", "less_than_equal"):
        rule = f"in {lo}..{hi}" if lo is not None and hi is not None else f">= {lo}" if lo is not None else f"<= {hi}"
        hint = f"; {RANGE_HINTS[flag]}" if flag in RANGE_HINTS else ""
        return f"{flag} must be {rule}, got {found['input']}{hint}"
    kind = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if isinstance(kind, type) and issubclass(kind, Enum):
        return f"{flag} must be one of {', '.join(m.value for m in kind)}, got '{found['input']}'"
    return " ".join(e.format_message().split())


@contextmanager
def _usage_errors():
    try:
        yield
    except NoArgsIsHelpError:
        raise
    except UsageError as e:
        fail(usage_line(e))


class _Flags:
    """typer's rich help prints a flag as `--json <bool>`, as if it took a value; show flags bare."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for p in self.params:
            if getattr(p, "is_flag", False) and p.metavar is None:
                p.metavar = ""
            elif p.metavar is None and (getattr(p, "min", None), getattr(p, "max", None)) != (None, None):
                kind = getattr(getattr(p, "type_descriptor", None), "annotation", None)  # `<int range>` reads oddly
                p.metavar = f"<{getattr(kind, '__name__', 'value')}>"  # and the range is printed beside it

    def get_help_option(self, ctx):
        opt = super().get_help_option(ctx)
        if opt is not None:
            opt.metavar = ""
        return opt


class Command(_Flags, TyperCommand):
    """A specrt command: bad flags (parsing) and user mistakes in the callback (SpecrtError, ValueError from
    parameter validation, Ctrl-C, a full disk) print one `error:` line and exit 2."""

    def make_context(self, *args, **kwargs):
        with _usage_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        try:
            with _usage_errors():
                return super().invoke(ctx)
        except SpecrtError as e:
            fail(str(e))
        except ValueError as e:  # parameter validation (sampling, precision) raises ValueError
            fail(str(e).splitlines()[0])
        except KeyboardInterrupt:
            fail("interrupted")
        except Exception as e:  # a full disk, from Python (OSError) or from onnxruntime's writers (its own errors)
            if not (isinstance(e, OSError) and e.errno == errno.ENOSPC) and "No space left on device" not in str(e):
                raise
            where = f"the disk holding '{e.filename}'" if getattr(e, "filename", None) else "the disk"
            fail(f"no space left on {where}; free some space (`specrt cache --prune` deletes build folders no "
                 "engine set uses) and run the command again")


class Group(_Flags, TyperGroup):
    """The `specrt` group: an unknown command or option is one `error:` line too."""

    def make_context(self, *args, **kwargs):
        with _usage_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with _usage_errors():
            return super().invoke(ctx)
