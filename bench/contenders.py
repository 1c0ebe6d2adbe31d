"""Mode names -> contenders: our decode strategies at each precision, and the peers.

Our names are `<strategy>-<precision>`: `plain-fp32`, `prompt-lookup-int4`, `auto-fp32`, ...
where the strategy is 'plain' or a name from runtime.methods.MODES (the one place that maps a
name to a proposer; new proposers such as 'medusa' appear here by themselves). Peers are named in
peers.PEERS. `plain-fp32` is the reference: speedups and output agreement are measured against it.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import SpecrtError
from ..manifest import Manifest
from .peers import PEERS, Checkpoint, Clock, Trace, Unavailable

REFERENCE = "plain-fp32"


def spec_modes() -> tuple[str, ...]:
    """Speculative strategies the runtime offers ('off' is our 'plain')."""
    try:
        from ..runtime.methods import MODES
    except ImportError:
        return ()
    return tuple(m for m in MODES if m != "off")


def our_modes(manifest: Manifest) -> dict[str, tuple[str, str]]:
    """name -> (strategy, precision); built from the parts, never split (both may contain '-')."""
    precs = [e.precision for e in manifest.engines.values() if e.role == "target"]
    modes = {f"{s}-{p}": (s, p) for s in ("plain",) + spec_modes() for p in precs}
    # plain decoding with the fp32 lm_head read in full every step, where the engine has a logit screen
    # (build/screen.py): what the screen itself buys, side by side
    screened = [e.precision for e in manifest.engines.values() if e.role == "target" and e.raw.get("screen")]
    return {**modes, **{f"{FULL_HEAD}-{p}": (FULL_HEAD, p) for p in screened}}


FULL_HEAD = "plain-fullhead"


QUICK = ("plain-fp32", "plain-int4", "auto-fp32", "genai-fp32", "genai-int4", "llamacpp", "hf")


def default_modes(manifest: Manifest, quick: bool = False) -> list[str]:
    """Plain at every precision, each proposer the set supports at fp32, auto at fp32 and int4, all peers.
    quick: the core comparison only (QUICK, where the set has it), so --quick stays near two minutes."""
    if quick:
        return [m for m in QUICK if m in PEERS or m in our_modes(manifest)]
    precs = [e.precision for e in manifest.engines.values() if e.role == "target"]
    roles = manifest.roles
    from ..runtime.methods import METHODS

    spec = [m for m in spec_modes() if m != "auto" and (METHODS[m].needs or "target") in roles]
    out = [f"plain-{p}" for p in precs] + [m for m in our_modes(manifest) if m.startswith(FULL_HEAD)]
    out += [f"{m}-fp32" for m in spec]
    out += [f"auto-{p}" for p in ("fp32", "int4") if p in precs and "auto" in spec_modes()]
    return out + list(PEERS)


def parse_modes(text: str | None, manifest: Manifest, quick: bool = False,
                others: dict[str, Manifest] | None = None) -> list[str]:
    """'a,b,c' (or None for the default list) -> names, reference first; unknown names are an error.
    others: more engine sets by folder name, whose modes are named `<mode>@<folder>` (default: their plain
    modes and auto-fp32, beside this set's)."""
    others = others or {}
    extra = {f"{m}@{k}": m for k, om in others.items() for m in our_modes(om)}
    known = list(our_modes(manifest)) + list(PEERS) + list(extra)
    names = default_modes(manifest, quick) if not text else [m.strip() for m in text.split(",") if m.strip()]
    if not text:
        names += [n for n, m in extra.items() if m.startswith("plain-") or m == "auto-fp32"]
    if not names:
        raise SpecrtError("--modes is empty; pass e.g. plain-fp32,plain-int4,genai-fp32")
    for m in names:
        if m not in known:
            raise SpecrtError(f"unknown mode {m!r}; choose from: {', '.join(known)}")
    if REFERENCE not in known:
        raise SpecrtError("the engine set has no fp32 target, which the bench needs as its reference; "
                          "rebuild it with `specrt engines --precisions fp32,...`")
    return [REFERENCE] + [m for m in dict.fromkeys(names) if m != REFERENCE]


_GENERATORS: dict = {}  # targets shared by the strategies of one precision (session.load)


class Ours:
    """One of our strategies on one target precision, through the public Generator API."""

    def __init__(self, name: str, manifest: Manifest, threads: int, ignore_eos: bool = False):
        self.name, self.manifest, self.threads, self.ignore_eos = name, manifest, threads, ignore_eos
        self.strategy, self.precision = our_modes(manifest)[name]
        self.plain = self.strategy in ("plain", FULL_HEAD)  # target-only decoding (FULL_HEAD: the screen off)
        self._runs: dict[tuple, int] = {}  # prompt -> runs so far

    def load(self, log=print) -> None:
        from ..runtime.engine import EngineOptions
        from ..runtime.methods import METHODS
        from ..runtime.session import load
        from ..runtime.speculative import draft_entry

        # the target takes turns with a draft model only where one drafts, as `specrt generate` loads it (a
        # plain baseline with spinning stopped would be slower than what users run); FULL_HEAD: the screen off
        options = EngineOptions(threads=self.threads, logit_screen=self.strategy != FULL_HEAD)
        try:
            self.session = load(self.manifest, self.precision, "off" if self.plain else self.strategy, options,
                                shared=_GENERATORS)
        except SpecrtError as e:
            raise Unavailable(str(e)) from None
        self.gen, self.decode = self.session.generator, self.session.decoder
        uses_draft = METHODS.get(self.session.mode) is not None and METHODS[self.session.mode].needs == "draft"
        self.draft_engine = draft_entry(self.manifest, self.precision).name if uses_draft else None

    def run(self, prompt_ids: list[int], messages, max_new_tokens: int) -> Trace:
        from ..runtime.tokenizer import Message

        clock, inner = Clock(), self.decode

        def timed(engine, prompt, sampling, rng, stats, **scope):  # stamps each round's tokens as they leave the loop
            rounds = inner(engine, prompt, sampling, rng, stats, **scope)
            try:
                for tokens in rounds:
                    clock.add(tokens)
                    yield tokens
            finally:
                rounds.close()

        # the n-th run of a prompt writes to the n-th store of earlier answers: a rep never drafts from its own
        # answer to the same prompt in an earlier rep (suffix decoding would copy it whole), so every rep sees the
        # set's other answers only, as one pass over it does
        prompt = tuple(prompt_ids)
        key = self._runs[prompt] = self._runs.get(prompt, -1) + 1
        s = self.gen.stream([Message(r, c) for r, c in messages], max_new_tokens=max_new_tokens, decode=timed,
                           ignore_eos=self.ignore_eos, store_key=f"rep-{key}")
        for _ in s:
            pass
        r, total = s.result, clock.trace().total_s
        n, st = len(r.token_ids), r.stats
        if self.plain:
            return Trace(list(r.token_ids), clock.times[:n], total, tau=1.0, rounds=st.rounds)
        # kept counts from the 4-decimal rates: exact while a position was drafted in < 10^4 rounds
        kept = tuple(round(a * d) for a, d in zip(st.acceptance_by_position, st.drafted_by_position))
        proposer = st.proposer + (f" ({self.draft_engine})" if self.draft_engine else "")
        return Trace(list(r.token_ids), clock.times[:n], total, tau=st.tau, acceptance=tuple(st.acceptance_by_position),
                     rounds=st.rounds, drafted=tuple(st.drafted_by_position), accepted=kept, proposer=proposer)



def split_mode(name: str, manifest: Manifest, others: dict[str, Manifest]) -> tuple[str, Manifest]:
    """`<mode>@<folder>` -> (mode, that set's manifest); a plain name -> (name, manifest)."""
    base, _, folder = name.partition("@")
    return (base, others[folder]) if folder else (name, manifest)


def make(name: str, manifest: Manifest, ck: Checkpoint):
    return PEERS[name](ck) if name in PEERS else Ours(name, manifest, ck.threads, ck.ignore_eos)


def checkpoint(manifest: Manifest, threads: int, assistant: Path | None, context: int,
               ignore_eos: bool = False) -> Checkpoint:
    src = manifest.raw.get("source", {})
    return Checkpoint(src.get("kind", "hf"), Path(src.get("path", manifest.root)), str(src.get("sha256", "unknown")),
                      tuple(manifest.eos_token_ids), manifest.root.parent / ".cache" / "peers", threads, assistant,
                      context, ignore_eos)
