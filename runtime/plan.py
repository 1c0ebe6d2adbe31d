"""Resolve once: what a command or a server runs, decided in one place and handed down.

A Plan holds the engine set's manifest, the target's entry, the --speculate mode with 'auto' resolved (and its
method), the engines' options (taking_turns decided) and the speculation options. `make_plan` loads, looks up and
resolves each of them once; the session, the batch, each slot's generator and decoder read the plan and look
nothing up again (docs/architecture.md, "Resolve once").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import SpecrtError
from ..manifest import EngineEntry, Manifest, load_manifest
from .engine import EngineOptions
from .methods import METHODS, MODES, Method

MAX_DRAFT_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    draft_tokens: int | None = None         # fixed k; None = adaptive
    lossy_typical: bool = False             # Medusa's typical acceptance when sampling: NOT lossless
    ngram_sizes: tuple[int, ...] = (6, 4, 3, 2, 1)
    lookup_max_tokens: int = 16
    draft_max_tokens: int = 8
    draft_sampled: bool | None = None       # draft model: None = sample iff the request samples
    eagle_tree: bool = True                 # EAGLE-2's dynamic tree (False: a chain, its length adaptive)
    eagle_depth: int = 3                    # the deepest chain or tree (the depth that paid best: BENCHMARKS.md,
                                            # "Does EAGLE pay on this CPU?")
    eagle_beam: int = 6                     # tree nodes expanded per level
    eagle_nodes: int = 0                    # tree nodes verified per round (0 = chosen per round from pass costs)
    suffix_cache_mib: float = 64            # suffix: the store of earlier answers (0 = this request only)
    suffix_threshold: float = 0.3           # suffix: the least path probability a drafted node may have
    suffix_factor: float = 4.0              # suffix: tokens drafted per matched token, at most (both swept:
                                            # BENCHMARKS.md, "Does suffix decoding pay on workloads that repeat?")

    def check(self) -> None:
        """What make_plan refuses, in one line, before any engine opens."""
        k = self.draft_tokens
        if k is not None and not 1 <= k <= MAX_DRAFT_TOKENS:
            raise SpecrtError(f"--draft-tokens must be in 1..{MAX_DRAFT_TOKENS}, got {k}; omit it for adaptive K")
        if self.suffix_cache_mib < 0:
            raise SpecrtError(f"--suffix-cache must be >= 0 MiB (0 = this request only), got {self.suffix_cache_mib:g}")
        if not 0 < self.suffix_threshold <= 1:
            raise SpecrtError(f"--suffix-threshold must be in (0, 1], got {self.suffix_threshold:g}")
        if self.suffix_factor <= 0:
            raise SpecrtError(f"--suffix-factor must be > 0, got {self.suffix_factor:g}")


def resolve_mode(mode: str, manifest: Manifest, target: EngineEntry) -> str:
    """The --speculate name 'auto' stands for on this engine set and target (other names are returned as they are).

    'auto' drafts with the draft model when the set has one, else lookup+medusa with heads at fp32 (the heads were
    trained on fp32 hidden states), else prompt lookup (docs/runtime-notes.md, "auto's choice per precision"), each
    beside suffix decoding (and the draft model beside prompt lookup too), the controller choosing per round by
    measured pay (docs/voice.md, "auto learns from the workload")."""
    if mode not in MODES:
        raise SpecrtError(f"unknown --speculate '{mode}'; choose one of: {', '.join(MODES)}")
    if mode != "auto":
        return mode
    roles = manifest.roles
    heads = "medusa" in roles and target.precision == "fp32"
    return "draft/lookup/suffix" if "draft" in roles else "lookup+medusa/suffix" if heads else "lookup/suffix"


@dataclass(frozen=True)
class Plan:
    manifest: Manifest
    precision: str
    target: EngineEntry          # the manifest's target entry at `precision`
    mode: str                    # the resolved --speculate name ('off' = plain decoding)
    options: EngineOptions       # taking_turns decided
    config: SpeculativeConfig

    @property
    def method(self) -> Method | None:
        """The method table's row of the mode (None: plain decoding)."""
        return METHODS.get(self.mode)

    def plain(self) -> "Plan":
        """The same set and target decoded plainly (`generate --compare-plain`'s second pass)."""
        return replace(self, mode="off", options=replace(self.options, taking_turns=False))


class PlanView:
    """What front ends read of a session's plan (Session, BatchSession): its set, precision and resolved mode."""

    plan: Plan

    @property
    def manifest(self) -> Manifest:
        return self.plan.manifest

    @property
    def precision(self) -> str:
        return self.plan.precision

    @property
    def mode(self) -> str:
        """The resolved --speculate name ('off' = plain decoding)."""
        return self.plan.mode


def make_plan(engines: str | Path | Manifest, precision: str = "fp32", speculate: str = "auto",
              options: EngineOptions = EngineOptions(), config: SpeculativeConfig = SpeculativeConfig()) -> Plan:
    """The plan of an engine set (a folder, or its Manifest loaded already), a target precision and a --speculate
    name. options.taking_turns None: on exactly when a draft model or an EAGLE head speculates (its passes and the
    target's alternate on the same cores); plain decoding on a set with a draft keeps it off. Every mistake (the
    speculation options, a missing folder or precision, an unknown mode) is a one-line SpecrtError, before any
    engine opens."""
    config.check()
    manifest = engines if isinstance(engines, Manifest) else load_manifest(Path(engines))
    target = manifest.engine("target", precision)
    mode = resolve_mode(speculate, manifest, target)
    if options.taking_turns is None:
        method = METHODS.get(mode)
        options = replace(options, taking_turns=method is not None and method.needs in ("draft", "eagle"))
    return Plan(manifest, precision, target, mode, options, config)
