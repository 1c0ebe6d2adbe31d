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
