"""Medusa: draft a token tree from heads over the target's own last hidden state.

The heads ride on the verification pass: that pass already computes the final-norm hidden state of
every token it feeds, so after verification the hidden state h of the last accepted position
(the one whose logits chose the next token) is free. Head k on h guesses the token k places past
that next token (token-input heads also read that next token itself, which the target has already
chosen: it is the last context token); the tree (data: a list of paths, runtime/tree.py) combines each head's top
candidates into n nodes, verified in one target pass of n + 1 tokens.

More: docs/runtime-notes.md, "Module notes: runtime/proposers/medusa.py".
"""

from __future__ import annotations

from ...errors import SpecrtError
from ..engine import Heads
from ..tree import compile_tree
from ..verify import Draft, VerifyResult
from .base import EMPTY, Context, HiddenRows, Proposer


class Medusa(Proposer):
    name = "medusa"
    # the tree was sized at build time; AdaptiveK's chain model misjudges a tree, so the loop asks for the whole
    # tree and GatedK only switches it on or off (docs/runtime-notes.md, "Why Medusa's tree is not sized by AdaptiveK")
    adaptive = False

    def __init__(self, heads: Heads, paths):
        full = compile_tree(paths)
        if full.max_depth > heads.heads or full.max_rank > heads.topk:
            raise SpecrtError(f"Medusa tree needs {full.max_depth} heads and top-{full.max_rank}, the heads engine has "
                              f"{heads.heads} and top-{heads.topk}; rebuild the engine set or use a smaller tree")
        self.heads, self.max_tokens = heads, full.max_depth
        # a subtree per depth cap k: paths of length <= k stay prefix-closed
        self.trees = {k: compile_tree([p for p in full.paths if len(p) <= k]) for k in range(1, full.max_depth + 1)}
        self._h = None
        self._pending = 0
        self._device = False  # the last row it read was a device address

    @property
    def reads_hidden(self) -> str:
        # heads compiled for the target's GPU read its hidden row there (TrtHeads): no row crosses to the host
        return "device" if self.heads.on_device else "host"

    def start(self, ctx: Context, sampling=None, rng=None) -> None:
        self._h = None
        self._pending = 0

    def propose(self, ctx: Context, k: int) -> Draft:
        self._pending = ctx.length - ctx.committed  # tokens the next pass feeds before the nodes
        if k <= 0 or self._h is None:
            return EMPTY
        tree = self.trees[min(k, self.max_tokens)]
        return Draft(tree.tokens(self.heads(self._h, int(ctx.ids[-1]))), tree.parents)

    def observe(self, result: VerifyResult, hidden: HiddenRows | None = None) -> None:
        if hidden is None:
            raise SpecrtError("Medusa reads the target's hidden states; run it through the speculative loop")
        # pass index of the last accepted position: the last pending token, or node path[-1]
        last = self._pending - 1 + (int(result.path[-1]) + 1 if result.num_accepted else 0)
        self._h, self._device = hidden.row(last), hidden.device
