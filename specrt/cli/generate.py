"""`specrt generate`: the typer command. Only typer at import time (the runtime loads inside it)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Optional

import typer

from . import model_flags as mf
from ..errors import SpecrtError
from ..runtime.methods import modes_help


HELP = {
    "--prompt": "User message (formatted with the model's chat template).",
    "--messages": "JSON file: [{\"role\": \"user\", \"content\": \"...\"}, ...].",
    "--precision": "Which target engine of the set to run: fp32 (exact), int8, int4 or int4-fp32 (those the set was "
                   "built with; `specrt info` lists them).",
    "--seed": "Seed for sampling: the same seed gives the same output, and with prompt lookup or Medusa the same "
              "output as --speculate off (a draft model samples its own drafts: reproducible only with --draft-tokens "
              "fixed).",
    "--ignore-eos": "Keep generating through end-of-sequence tokens until --max-new-tokens (for timing runs of a "
                    "fixed length).",
    "--lossy-typical": "LOSSY: Medusa's typical acceptance when sampling (output no longer follows the model's "
                       "distribution; stats say exact=false).",
    "--draft-tokens": "Fix the draft length K (default: adaptive, per round).",
    "--compare-plain": "Then answer the same prompt with --speculate off on the same engine and print one line: tau, "
                       "both times, the speedup, whether the output is identical (with --json: a compare_plain "
                       "object). Each run is timed after a one-token warm-up.",
}


def generate(
    prompt: Optional[str] = typer.Option(None, "--prompt", help=HELP["--prompt"]),
    messages: Optional[Path] = typer.Option(None, "--messages", help=HELP["--messages"]),
    engines_dir: Optional[Path] = typer.Option(None, "--engines", "-e", show_default=False,
                                               help="Engine set folder. Default engines/smollm2-135m."),
    model: Optional[str] = mf.model_option(),
    precision: str = typer.Option("fp32", "--precision", help=HELP["--precision"]),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1, help="Stop after this many new tokens."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; > 0 samples."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1.0 = off)."),
    seed: Optional[int] = typer.Option(None, "--seed", min=0, help=HELP["--seed"]),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help=HELP["--ignore-eos"]),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template to --prompt."),
    stream: bool = typer.Option(True, "--stream/--no-stream", help="Print text as it is generated."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: text, token_ids, stats."),
    threads: int = typer.Option(0, "--threads", help="CPU threads (0 = all cores)."),
    speculate: str = typer.Option("auto", "--speculate",
                                  help=modes_help() + " Greedy output is unchanged on width-exact (fp32) engines."),
    lossy_typical: bool = typer.Option(False, "--lossy-typical", help=HELP["--lossy-typical"]),
    draft_tokens: Optional[int] = typer.Option(None, "--draft-tokens", help=HELP["--draft-tokens"]),
    compare_plain: bool = typer.Option(False, "--compare-plain", help=HELP["--compare-plain"]),
    backend: Optional[str] = mf.backend_option(mf.MODEL_PANEL),
    max_context: Optional[int] = mf.max_context_option(mf.MODEL_PANEL, mf.MODEL_CONTEXT_DEFAULT),
    medusa_heads: Optional[str] = mf.medusa_heads_option(mf.MODEL_PANEL),
    eagle_head: Optional[str] = mf.eagle_head_option(mf.MODEL_PANEL, mf.MODEL_EAGLE_DEFAULT),
):
    """Generate from an engine set; streams text, then prints stats to stderr."""
    from . import compare_plain as cmp
    from ..runtime.tokenizer import load_messages_file

    if (prompt is None) == (messages is None):
        raise SpecrtError("pass exactly one of --prompt TEXT or --messages FILE.json")
    if any(not s for s in stop):  # it would match before the first token: an empty answer
        raise SpecrtError("--stop '' is empty and would stop before any output; pass a non-empty stop string")
    chat = load_messages_file(messages) if messages is not None else prompt
    sampling = _sampling(temperature, top_k, top_p, seed)
    engines_dir = mf.chosen_engines(engines_dir, model, precision, backend, max_context, medusa_heads, eagle_head)[0]
    from ..runtime.engine import EngineOptions
    from ..runtime.session import load
    from ..runtime.plan import SpeculativeConfig

    shared = {}  # --compare-plain's plain pass reuses the target engine
    session = load(engines_dir, precision, speculate, EngineOptions(threads=threads),
                   SpeculativeConfig(draft_tokens=draft_tokens, lossy_typical=lossy_typical), shared=shared)
    ask = dict(max_new_tokens=max_new_tokens, sampling=sampling, stop=tuple(stop), chat=not raw,
               ignore_eos=ignore_eos)
    if compare_plain:
        cmp.check_speculating(session.mode)
        cmp.warm_up(session, chat, **ask)
    s = session.stream(chat, **ask)
    for delta in s:
        if stream and not as_json:
            sys.stdout.write(delta)
            sys.stdout.flush()
    r = s.result
    if as_json:
        found = cmp.summary(r, cmp.plain_pass(session, shared, chat, **ask)) if compare_plain else None
        typer.echo(json.dumps({"text": r.text, "token_ids": r.token_ids, "stats": r.stats.as_dict(),
                               **({"compare_plain": found} if found else {})}))
        return
    if not stream:
        typer.echo(r.text)
    else:
        typer.echo()
    typer.secho(_stats_line(r.stats), err=True, dim=True)
    if compare_plain:
        typer.secho("[the same prompt with --speculate off ...]", err=True, dim=True)
        found = cmp.summary(r, cmp.plain_pass(session, shared, chat, **ask))
        typer.secho(cmp.line(found, speculate), err=True, bold=True)


def _sampling(temperature: float, top_k: int, top_p: float, seed: int | None):
    """The sampling flags as SamplingParams; a bad value's one-line error names the flag."""
    from ..runtime.sampling import SamplingParams

    try:
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    except ValueError as e:  # its messages name the Python fields (top_p=1.0): name the flags
        raise SpecrtError(re.sub(r"\b(temperature|top_k|top_p)\b=?",
                                 lambda m: "--" + m[1].replace("_", "-") + (" " if m[0].endswith("=") else ""),
                                 str(e))) from None


def _stats_line(st) -> str:
    """The run's stats in one line (stderr)."""
    spec = (f", {st.proposer}: tau {st.tau:.2f}, draft {st.draft_s:.2f}s / verify {st.verify_s:.2f}s"
            + ("" if st.exact else ", LOSSY (typical acceptance)" if st.lossy else ", NOT width-exact")
            if st.proposer != "off" else "")
    return (f"[{st.prompt_tokens} prompt + {st.new_tokens} new tokens, ttft {st.ttft_s * 1000:.0f} ms, "
            f"{st.tok_s:.1f} tok/s, {st.finish_reason}{spec}]")
