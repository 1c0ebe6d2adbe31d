"""Proposers: anything that drafts tokens for the target to verify (see base.Proposer)."""

from .base import Context, OneBucket, Proposer
from .draft_model import DraftModel
from .prompt_lookup import PromptLookup

__all__ = ["Context", "OneBucket", "Proposer", "PromptLookup", "DraftModel"]
