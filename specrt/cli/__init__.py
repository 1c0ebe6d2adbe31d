"""The `specrt` command line: the typer app in main.py, each command family in a module beside it. `app` (the
console script `specrt.cli:app`) loads on first use, so a command module imports without the whole app."""


def __getattr__(name: str):
    if name == "app":
        from .main import app

        return app
    raise AttributeError(name)
