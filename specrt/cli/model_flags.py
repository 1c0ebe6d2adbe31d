"""The build flags `specrt engines` shares with `serve --model` and `generate --model` (one definition each), and
the choice between --model and --engines. Only typer at import time."""

from __future__ import annotations

from pathlib import Path

import typer

from ..backends import BACKENDS, DEFAULT_BACKEND, DEFAULT_CONTEXT
from ..cache_dir import CACHE_RULE, cache_root
from ..errors import SpecrtError

DEFAULT_ENGINES = Path("engines/smollm2-135m")
MODEL_PANEL = "Build from --model (first use only)"


def backend_option(panel: str | None = None):
    return typer.Option(None, "--backend", "-b", show_default=False, rich_help_panel=panel,
                        help="; ".join(f"{b.name}: {b.help}" for b in BACKENDS.values() if b.precisions)
                        + f". Default {DEFAULT_BACKEND}. The set's name gets the backend's suffix (-portable, -cuda, "
                          "...).")


def max_context_option(panel: str | None = None, default: str = str(DEFAULT_CONTEXT)):
    return typer.Option(None, "--max-context", show_default=False, rich_help_panel=panel,
                        help=f"KV cache length (prompt + generated tokens). Default {default}.")


def medusa_heads_option(panel: str | None = None):
    return typer.Option(None, "--medusa-heads", rich_help_panel=panel,
                        help="Medusa heads file (specrt train-medusa). Default: the committed heads/<source>.npz "
                             "when there is one; 'none' = no heads.")


def eagle_head_option(panel: str | None = None, default: str = "the committed heads/<source>-eagle.npz when there "
                                                                 "is one"):
    return typer.Option(None, "--eagle-head", rich_help_panel=panel,
                        help=f"EAGLE head file (specrt train-eagle), or 'none'. Default: {default}.")


def model_option():
    return typer.Option(None, "--model", "-m", metavar="PATH", show_default=False,
                        help="A Hugging Face model folder, a .gguf file or an embedded name (smollm2-135m): its "
                             "engine set (the precision served, with the committed heads where the model has them) is "
                             f"built on first use into the cache, {CACHE_RULE} (here: {cache_root()}), and reused "
                             "after. Not with --engines.")


MODEL_EAGLE_DEFAULT = "none (its build is the slowest part, as in `make demo`)"
MODEL_CONTEXT_DEFAULT = f"{DEFAULT_CONTEXT}, or the model's positions where it has fewer"


def chosen_engines(engines: Path | None, model: str | None, precision: str, backend: str | None,
                   max_context: int | None, medusa_heads: str | None,
                   eagle_head: str | None) -> tuple[Path, str | None]:
    """-> (the engine set to run, the name to serve it as: None = its manifest's). --model builds (or finds) the
    set in the cache; the build flags without --model would be ignored, so they are refused."""
    if model is None:
        given = [f for f, v in (("--backend", backend), ("--max-context", max_context),
                                ("--medusa-heads", medusa_heads), ("--eagle-head", eagle_head)) if v is not None]
        if given:
            raise SpecrtError(f"{given[0]} is a build option of --model; an --engines set is already built: drop it, "
                              "or pass --model PATH")
        return engines or DEFAULT_ENGINES, None
    if engines is not None:
        raise SpecrtError("pass --model PATH (built into the cache on first use) or --engines DIR (a set from "
                          "`specrt engines`), not both")
    from ..pipeline.model_cache import ModelBuild, engines_for_model

    return engines_for_model(model, ModelBuild(precision, DEFAULT_BACKEND if backend is None else backend,
                                               max_context,
                                               medusa_heads, "none" if eagle_head is None else eagle_head))
