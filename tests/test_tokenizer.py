"""Incremental detokenization: the deltas concatenate to the full decode, whatever the ids."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specrt.runtime.tokenizer import Detokenizer, TextCodec

TEXTS = ("Hello, wörld! 你好，世界 🎉🎉 naïve café — “quotes” 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
         "def f(x):\n    return x  # ünïcödé\n\n\tTabs", "  leading spaces and\r\nCRLF ‍👩‍💻 zwj")


def _codec(default_engines) -> TextCodec:
    return TextCodec(default_engines / "tokenizer.json", None, None, (0,))


def _check(codec: TextCodec, ids: list[int]) -> None:
    d = Detokenizer(codec)
    streamed = "".join(d.push(t) for t in ids)
    full = codec.decode(ids)
    assert streamed == d.emitted
    if not full.endswith("\ufffd"):   # an incomplete UTF-8 character at the very end is held back
        assert streamed == full
    else:
        assert full.startswith(streamed)


def test_detokenizer_on_unicode_text(default_engines):
    codec = _codec(default_engines)
    for text in TEXTS:
        _check(codec, codec.encode(text * 3))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_detokenizer_on_arbitrary_ids(default_engines, data):
    codec = _codec(default_engines)
    ids = data.draw(st.lists(st.integers(0, codec.tokenizer.get_vocab_size() - 1), min_size=1, max_size=60))
    _check(codec, ids)


def test_a_prompt_no_template_wrote_starts_as_the_tokenizer_starts_a_text(tmp_path):
    """Gemma's and Llama's tokenizers put <bos> before a text; a raw prompt (or a chat with no template) gets it
    too, once, as transformers and llama.cpp encode one; a template writes its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from specrt.runtime.generate import Generator
    from specrt.runtime.tokenizer import Message
    from tiny import make_tokenizer

    tok = Tokenizer(models.WordLevel({"<bos>": 0, "<eos>": 1, "hi": 2, "there": 3, "[UNK]": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<bos>", "<eos>"])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    gen = Generator.__new__(Generator)
    gen.codec = TextCodec(tmp_path / "tokenizer.json", None, "<bos>", (1,))
    gen.engine = type("E", (), {"max_context": 64})()
    assert gen.prompt_ids("hi there", chat=False) == [0, 2, 3]
    assert gen.prompt_ids("hi there", chat=True) == [0, 2, 3]
    gen.codec = TextCodec(tmp_path / "tokenizer.json", "{{ bos_token }}{% for m in messages %}{{ m.content }}"
                          "{% endfor %}", "<bos>", (1,))
    assert gen.prompt_ids([Message("user", "hi")]) == [0, 2]
    make_tokenizer(tmp_path / "chatml")
    assert TextCodec(tmp_path / "chatml" / "tokenizer.json", None, None, (2,)).plain_prompt("hi") == "hi"  # nothing
