"""Stop tokens come from the checkpoint: generation_config.json (several ids), a GGUF's eos/eot/eom ids and the chat
template's end of turn; a reply stops at any of them."""

from __future__ import annotations

import json

import pytest

from specrt.export.sources import Source
from specrt.export.stops import config_stop_ids, stop_token_ids, template_end_of_turn
from tiny import CORPUS, make_checkpoint, make_tokenizer

GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<unused0>"]
GEMMA_TEMPLATE = (  # Gemma's turn layout: the turn closes with <end_of_turn>, which is not eos
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n{{ message['content'] | trim }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def _gemma_style_tokenizer(out, template=GEMMA_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=GEMMA_SPECIALS,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                         show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>")
    fast.chat_template = template
    fast.save_pretrained(str(out))
    return fast


def test_generation_config_ids_and_the_templates_end_of_turn(tmp_path):
    tok = _gemma_style_tokenizer(tmp_path)
    eos, eot, unused = (tok.convert_tokens_to_ids(t) for t in ("<eos>", "<end_of_turn>", "<unused0>"))
    assert eot != eos
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": eos}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [unused, eos, 10 ** 6]}))
    src = Source("hf", tmp_path, "x")
    assert template_end_of_turn(tok) == [eot]
    # the tokenizer's eos first (a template's eos_token), then the rest; an id outside the vocabulary is dropped
    assert stop_token_ids(tok, src) == [eos] + sorted({unused, eot})


def test_config_json_when_there_is_no_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert config_stop_ids(Source("hf", tmp_path, "x")) == [7, 9]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert config_stop_ids(Source("hf", tmp_path, "x")) == [5]


@pytest.mark.parametrize("template,expected", [
    (None, []),
    ("{{ raise_exception('system message required') }}", []),                   # refuses any conversation
    ("{% for m in messages %}{{ m['content'] }}\n\n{% endfor %}", []),           # plain text closes a turn
    ("{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}", ["<eos>"]),
])
def test_templates_without_an_end_of_turn_token(tmp_path, template, expected):
    tok = _gemma_style_tokenizer(tmp_path, template)
    assert template_end_of_turn(tok) == tok.convert_tokens_to_ids(expected)


def test_gguf_eos_eot_and_eom_ids(tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_eos_token_id(1)
    w.add_eot_token_id(106)
    w.add_uint32("tokenizer.ggml.eom_token_id", 107)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert config_stop_ids(Source("gguf", path, "m")) == [1, 106, 107]


def test_a_reply_stops_at_any_generation_config_id(tmp_path):
    """Greedy tokens of a tiny model, then two of them named as extra eos ids: the reply ends at the first."""
    from specrt.pipeline import EngineSetRequest, make_engine_set
    from specrt.runtime.engine import EngineOptions
    from specrt.runtime.generate import Generator

    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", seed=3)
    make_tokenizer(ckpt)

    def reply(name):
        path = make_engine_set(EngineSetRequest(str(ckpt), name, ("fp32",), 128, tmp_path / "eng"), log=lambda m: None)
        gen = Generator.load(path, "fp32", EngineOptions(threads=1))
        return gen, gen.generate("The quick brown fox", chat=False, max_new_tokens=24, ignore_eos=True).token_ids

    gen, free = reply("before")
    picks = [t for i, t in enumerate(free) if i > 2 and t not in free[:i] and t not in gen.codec.eos_token_ids][:2]
    assert len(picks) == 2, free
    cfg = json.loads((ckpt / "generation_config.json").read_text())
    cfg["eos_token_id"] = [cfg["eos_token_id"], picks[1], picks[0]]
    (ckpt / "generation_config.json").write_text(json.dumps(cfg))
    gen, _ = reply("after")
    assert set(picks) <= gen.codec.eos_token_ids
    out = gen.generate("The quick brown fox", chat=False, max_new_tokens=24)
    assert out.token_ids == free[:free.index(picks[0])] and out.stats.finish_reason == "eos"  # the stop id not kept


def test_the_template_renders_the_tokenizers_eos_not_the_smallest_stop_id(tmp_path):
    from specrt.runtime.tokenizer import Message, TextCodec

    tok = _gemma_style_tokenizer(tmp_path)
    eos, eot, pad = (tok.convert_tokens_to_ids(t) for t in ("<eos>", "<end_of_turn>", "<pad>"))
    assert pad < eos
    codec = TextCodec(tmp_path / "tokenizer.json", "{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
                      None, (eos, pad, eot))
    assert codec.render_chat([Message("user", "hi")]) == "hi<eos>"
