"""The --speculate methods, registered once: the name, the engine role a method needs beside the target, one
clause of help, and the drafters it runs (runtime/speculative.py's DRAFTERS; two: the first after a 2+ token
match, else the second: proposers/hybrid.Fallback), or the methods it chooses among each round (proposers/sources.py:
auto's, named a/b/c). The CLI's and the server's choices and help, the bench's modes
and the tests derive from this table. Plain Python (no numpy), so `--help` imports it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    needs: str | None  # the engine role it runs beside the target ("draft", "medusa", "eagle"); None: the target alone
    help: str
    drafters: tuple[str, ...]  # its proposer's builders in runtime/speculative.py's DRAFTERS (primary first)
    sources: tuple[str, ...] = ()  # or: the methods whose drafters it chooses among each round (the base first)


METHODS = {m.name: m for m in (
    Method("prompt-lookup", None, "n-gram matches in the prompt and the answer so far", ("prompt-lookup",)),
    Method("suffix", None, "suffix trees over this request and earlier answers (--suffix-* options)", ("suffix",)),
    Method("draft", "draft", "the set's draft model", ("draft",)),
    Method("medusa", "medusa", "Medusa heads' token tree", ("medusa",)),
    Method("lookup+medusa", "medusa", "prompt lookup after a 2+ token match, else Medusa", ("prompt-lookup", "medusa")),
    Method("suffix+medusa", "medusa", "suffix decoding after a 2+ token match, else Medusa", ("suffix", "medusa")),
    Method("eagle", "eagle", "the EAGLE head's dynamic tree", ("eagle",)),
    Method("lookup+eagle", "eagle", "prompt lookup after a 2+ token match, else EAGLE", ("prompt-lookup", "eagle")),
    # auto's: each round, the drafter whose kind of draft has paid best so far (docs/voice.md, "auto learns from
    # the workload")
    Method("draft/lookup/suffix", "draft", "each round whichever of the draft model, prompt lookup and suffix "
           "decoding has paid best", (), ("draft", "prompt-lookup", "suffix")),
    Method("lookup+medusa/suffix", "medusa", "each round whichever of lookup+medusa and suffix decoding has paid "
           "best", (), ("lookup+medusa", "suffix")),
    Method("lookup/suffix", None, "each round whichever of prompt lookup and suffix decoding has paid best", (),
           ("prompt-lookup", "suffix")),
)}
MODES = ("off", *METHODS, "auto")
AUTO_HELP = ("draft/lookup/suffix on a set with a draft model, else lookup+medusa/suffix at fp32 with heads, else "
             "lookup/suffix")  # resolve_mode


def modes_help() -> str:
    """--speculate's help: every mode and what it drafts with."""
    return ("off: plain decoding; " + "; ".join(f"{m.name}: {m.help}" for m in METHODS.values())
            + f"; auto: {AUTO_HELP}.")
