"""Proposers: anything that drafts tokens for the target to verify (see base.Proposer)."""

from .base import Context, HiddenRows, Proposer
from .draft_model import DraftModel
from .prompt_lookup import PromptLookup

__all__ = ["Context", "HiddenRows", "Proposer", "PromptLookup", "DraftModel"]
