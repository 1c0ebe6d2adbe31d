"""Tiny random-weight checkpoints (Llama and Qwen2) with a real tokenizer, built in seconds.

Used by the tests as stand-ins for real models: same code paths (HF dir -> export -> build ->
runtime), no downloads. Two checkpoints built with the same `vocab` share one tokenizer, which is
what a draft/target pair needs.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "import numpy as np\nx = np.arange(10)\nprint(x.sum())\n",
    "Hello, how are you today? I am fine, thank you.",
] * 20
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # unk/pad, bos (id 1), eos (id 2)


def make_tokenizer(out: Path, vocab: int = 384, specials: tuple[str, ...] = SPECIALS, plain: tuple[str, ...] = (),
                   template: str = CHAT_TEMPLATE) -> None:
    """specials: unk, bos and eos (ids 0-2, as the checkpoints' config says), then more special tokens; plain:
    tokens of their own that are not special (Qwen's <tool_call>, <think>), the vocabulary's last ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab - len(plain), special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    assert not plain or tok.get_vocab_size() == vocab  # plain tokens must be the model vocabulary's last ids
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=specials[2], bos_token=specials[1],
                                   unk_token=specials[0], pad_token=specials[0])
    fast.chat_template = template
    fast.save_pretrained(str(out))


def make_checkpoint(out: Path, arch: str = "llama", seed: int = 0, layers: int = 2, hidden: int = 64,
                    vocab: int = 384, noise: float = 0.0, tie: bool | None = None, positions: int = 512,
                    tokenizer: dict | None = None, favour: dict[str, float] | None = None) -> Path:
    """A random decoder saved as a Hugging Face directory (config, safetensors, tokenizer).

    The output must depend on the whole context, or tests of the KV cache cannot fail: a random
    init is near-uniform, and sharpening a tied embedding makes the model repeat its last token
    forever (logit = <h, e_t> with h ~ e_last), whatever is in the cache. So an untied model gets a
    sharpened lm_head (output that wanders and changes with any prompt token: the Llama default, on
    which the runtime's tests run) and a tied one a final norm of random signs (no self-preference,
    though it settles into short cycles: the Qwen2 default, tied like the small Qwen2.5 models, so
    the tied export path is tested too). `noise` > 0 adds Gaussian noise of that many weight standard
    deviations to every matrix after init: with the same seed, a draft that agrees with its target
    on some tokens and not on others. tokenizer: make_tokenizer's specials, plain and template (another family's
    markers); favour: {token: weight} raises those tokens' logits (an untied model; a model that writes a format's
    markers by itself)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                  bos_token_id=1, eos_token_id=2)
    tie = (arch == "qwen2") if tie is None else tie
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=tie, **common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=tie, **common))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        if model.config.tie_word_embeddings:
            model.model.norm.weight.copy_((torch.randint(0, 2, (hidden,)) * 2 - 1).float() * 8.0)
        else:
            model.lm_head.weight.mul_(8.0)
        if favour:  # every embedding gets a shared component, which the favoured rows of lm_head read
            model.model.embed_tokens.weight[:, 0] = 0.02
            model.lm_head.weight[:, 0] = 0.0
            from tokenizers import Tokenizer

            make_tokenizer(out, vocab, **(tokenizer or {}))
            tok = Tokenizer.from_file(str(out / "tokenizer.json"))
            for t, w in favour.items():
                model.lm_head.weight[tok.token_to_id(t), 0] = w
        if noise:
            g = torch.Generator().manual_seed(10_000 + seed)
            for w in model.parameters():
                if w.dim() > 1:
                    w.add_(torch.randn(w.shape, generator=g) * w.std() * noise)
    model.save_pretrained(str(out))
    make_tokenizer(out, vocab, **(tokenizer or {}))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == arch
    return out


def make_gguf(path: Path, ckpt: Path, template: str | None = None) -> Path:
    """A tiny Llama checkpoint (make_checkpoint) written as a GGUF, as llama.cpp's converter writes one: its
    weights under llama.cpp's names (q/k rows permuted), its byte-level BPE vocabulary, merges and special ids, and
    `template` (else the checkpoint's) as tokenizer.chat_template, which transformers reads back on export."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from specrt.pipeline.engines import chat_template

    cfg = json.loads((ckpt / "config.json").read_text())
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    heads, kv, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    added = {t["id"]: t for t in tok["added_tokens"]}
    vocab = {**tok["model"]["vocab"], **{t["content"]: i for i, t in added.items()}}
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if vocab[t] in added and added[vocab[t]]["special"] else 4 if vocab[t] in added else 1
                       for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_unk_token_id(0)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(template if template is not None else chat_template(ckpt))

    def permute(x, n):  # llama.cpp's rotary layout of q/k rows (transformers permutes them back on load)
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, x in load_file(str(ckpt / "model.safetensors")).items():
        base = name.removesuffix(".weight")
        if base.startswith("model.layers."):
            i, rest = base.removeprefix("model.layers.").split(".", 1)
            x = permute(x, heads) if rest == "self_attn.q_proj" else permute(x, kv) if rest == "self_attn.k_proj" else x
            base = f"blk.{i}.{layer[rest]}"
        else:
            base = names[base]
        w.add_tensor(base + ".weight", np.ascontiguousarray(x, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
