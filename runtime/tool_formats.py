"""Tool-call formats as data: how each model family writes a call, and how it is shown tools and tool rounds where its
chat template does not show them (docs/formats.md).

A format is a row of FORMATS; `detect` picks the first row whose tokens are all in the vocabulary and whose strings
are all in the chat template (the last row, Hermes, matches anything), and `serve --tool-format NAME` overrides it.
specrt/server/tool_calls.py turns a row into the grammar that forces or allows calls and the parser that reads them
back.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass

from ..errors import SpecrtError

# JSON as the grammar writes it (grammar.JSON_OPTIONS): one space after ':' and ','
SEPARATORS = (", ", ": ")


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open: str                 # the marker before the call(s); "" = a bare JSON object at the reply's start
    close: str                # the marker after them; "" = none (the JSON's end, then the end of the turn)
    key: str                  # the arguments' key: "arguments" or "parameters"
    listed: bool              # the calls are one JSON list after `open` ([{...}, {...}])
    parallel: bool            # several calls in one turn (a listed format: in the list; else blocks joined by "\n")
    pad: str                  # between a marker and the JSON (Hermes: a newline)
    prompt: str               # tools for a template that shows none: {tools} = one JSON per line
    prompt_turn: str          # where that prompt goes: "system", or "user" (the first user turn)
    result: str               # a tool's result for such a template: {content}
    result_role: str          # the role of that turn
    tokens: tuple[str, ...] = ()    # detection: all in the tokenizer's vocabulary
    template: tuple[str, ...] = ()  # detection: all in the chat template's source
    id_chars: int = 0         # the call ids the template demands (Mistral: 9 letters and digits); 0 = OpenAI's
    named: str = ""           # a call is name + this + its arguments' JSON (Ministral 3's "[ARGS]"), not an object
    between: str = "\n"       # between the blocks of several calls (not listed)
    # more shapes of one call, each (before, after) around its bare JSON, taken as a call where they are the whole
    # reply under "auto" (docs/formats.md#bare-calls): Qwen2.5-Coder writes its call bare, or in the doubled
    # braces its template shows
    bare: tuple[tuple[str, str], ...] = ()
    # the info strings of a Markdown fence (```json) whose block, after text under "auto", is read as one call when
    # it is one (docs/formats.md#fenced-calls): Qwen2.5-Coder writes a sentence, then its call fenced
    fenced: tuple[str, ...] = ()

    def call_json(self, name: str, arguments: str) -> str:
        if self.named:
            return name + self.named + arguments
        return '{"name": ' + json.dumps(name, ensure_ascii=False) + f', "{self.key}": ' + arguments + "}"

    def calls_text(self, calls) -> str:
        """Calls (runtime.tokenizer.ToolCall) as the model writes them, for a history the template does not render;
        a format of one call a turn refuses several in one line."""
        if len(calls) > 1 and not self.parallel:
            raise SpecrtError(f"the '{self.name}' tool-call format writes one call a turn, and an assistant turn of "
                              f"the history has {len(calls)}; send them as separate turns")
        bodies = [self.call_json(c.name, c.arguments) for c in calls]
        if self.listed:
            return f"{self.open}{self.pad}[{', '.join(bodies)}]{self.pad}{self.close}"
        return self.between.join(f"{self.open}{self.pad}{b}{self.pad}{self.close}" for b in bodies)

    def new_id(self) -> str:
        if self.id_chars:
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(self.id_chars))
        return "call_" + secrets.token_hex(12)


HERMES_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")
JSON_PROMPT = (  # Llama 3.x's own words, which Gemma's function-calling guide uses too
    "Given the following functions, please respond with a JSON for a function call with its proper arguments that "
    "best answers the given prompt.\n\nRespond in the format {{\"name\": function name, \"parameters\": dictionary "
    "of argument name and its value}}. Do not use variables.\n\n{tools}")


def _listed_prompt(open_: str, close: str) -> str:
    return ("You have access to the following tools:\n{tools}\n\nTo call tools, respond only with " + open_
            + " followed by a JSON list of the calls, like [{{\"name\": <function-name>, \"arguments\": "
            + "<args-json-object>}}]" + close + ".")


def _row(name, open_, close, key, listed, parallel, pad, prompt, prompt_turn="system", result="{content}",
         result_role="tool", **more) -> ToolFormat:
    return ToolFormat(name, open_, close, key, listed, parallel, pad, prompt, prompt_turn, result, result_role,
                      **more)


HERMES_RESULT = "<tool_response>\n{content}\n</tool_response>"
HERMES_BARE = (("", ""), ("{", "}"))
# detection order: the most specific first; Hermes (Qwen2.5/3, SmolLM2/3, Hermes) matches anything
FORMATS: tuple[ToolFormat, ...] = (
    _row("mistral-args", "[TOOL_CALLS]", "", "arguments", False, True, "",
         "You have access to the following tools:\n{tools}\n\nTo call a tool, respond with [TOOL_CALLS] followed by "
         "its name, [ARGS] and its arguments as a JSON object.", result="[TOOL_RESULTS]{content}[/TOOL_RESULTS]",
         result_role="user", tokens=("[TOOL_CALLS]", "[ARGS]"), named="[ARGS]", between=""),
    _row("mistral", "[TOOL_CALLS]", "", "arguments", True, True, "", _listed_prompt("[TOOL_CALLS]", ""),
         result="[TOOL_RESULTS]{{\"content\": {content}}}[/TOOL_RESULTS]", result_role="user",
         tokens=("[TOOL_CALLS]",), id_chars=9),
    _row("phi4-mini", "<|tool_call|>", "<|/tool_call|>", "arguments", True, True, "",
         _listed_prompt("<|tool_call|>", "<|/tool_call|>"), result="<|tool_response|>{content}<|/tool_response|>",
         result_role="user", tokens=("<|tool_call|>", "<|/tool_call|>")),
    _row("granite", "<|tool_call|>", "", "arguments", True, True, "", _listed_prompt("<|tool_call|>", ""),
         tokens=("<|tool_call|>",)),
    _row("llama3-json", "", "", "parameters", False, False, "", JSON_PROMPT, prompt_turn="user",
         result_role="ipython", template=('{"name": function name, "parameters"',)),
    _row("gemma-json", "", "", "parameters", False, False, "", JSON_PROMPT, prompt_turn="user",
         result="Result of the call: {content}", result_role="user", template=("<start_of_turn>",)),
    _row("hermes", "<tool_call>", "</tool_call>", "arguments", False, True, "\n", HERMES_PROMPT,
         result=HERMES_RESULT, bare=HERMES_BARE, fenced=("json", "")),
)
NAMES = tuple(f.name for f in FORMATS)


def by_name(name: str) -> ToolFormat:
    for f in FORMATS:
        if f.name == name:
            return f
    raise SpecrtError(f"unknown tool-call format '{name}'; pass one of: {', '.join(NAMES)}")


def detect(template: str | None, has_token) -> ToolFormat:
    """The format of a chat template and tokenizer (has_token(text): whether it is one token of the vocabulary)."""
    source = template or ""
    for f in FORMATS:
        if all(map(has_token, f.tokens)) and all(s in source for s in f.template):
            return f
    return FORMATS[-1]


@dataclass(frozen=True)
class ThinkFormat:
    """Where a thinking model's reasoning goes: between `open` and `close`; `switch`: the template variable that
    turns thinking on or off (Qwen3's and SmolLM3's enable_thinking, Granite 3.3's thinking), None where the
    template has none; `default_on`: whether it thinks when the request does not set the switch."""
    open: str
    close: str
    switch: str | None = None
    default_on: bool = True


# detection: the first row whose markers are in the chat template's source and whose switch it reads
THINKING = (ThinkFormat("<think>", "</think>", "enable_thinking"),
            ThinkFormat("<think>", "</think>", "thinking", default_on=False),
            ThinkFormat("<think>", "</think>"), ThinkFormat("[THINK]", "[/THINK]"))


def detect_thinking(template: str | None, variables) -> ThinkFormat | None:
    """The reasoning markers of a chat template (variables: those it reads), None for a model that does not think."""
    for t in THINKING:
        if template and t.open in template and t.close in template and (t.switch is None or t.switch in variables):
            return t
    return None
