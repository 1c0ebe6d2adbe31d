"""The multi-turn material of `specrt bench-serve`: a voice-assistant conversation of a ~340-token system prompt
and 5 user turns. The in-process TTFT experiment on it is experiments/multiturn.py."""

from __future__ import annotations

import inspect
import textwrap

TURNS = ("Turn on the kitchen lights.", "Now dim them to half.", "What's the temperature inside?",
         "Set the thermostat to 21 degrees.", "Lock the front door and say good night.")


def system_prompt() -> str:
    """The ~340-token system prompt (SmolLM2's tokenizer): an assistant's first line, then fixed filler text
    (the source of textwrap.dedent). Also the system prompt of `specrt bench-serve`'s multi-turn load."""
    return "You are a voice assistant for a home-automation system. " + textwrap.dedent(
        inspect.getsource(textwrap.dedent))[:1400]
