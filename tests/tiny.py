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


def make_tokenizer(out: Path, vocab: int = 384) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def make_checkpoint(out: Path, arch: str = "llama", seed: int = 0, layers: int = 2, hidden: int = 64,
                    vocab: int = 384, noise: float = 0.0, tie: bool | None = None, positions: int = 512) -> Path:
    """A random decoder saved as a Hugging Face directory (config, safetensors, tokenizer).

    The output must depend on the whole context, or tests of the KV cache cannot fail: a random
    init is near-uniform, and sharpening a tied embedding makes the model repeat its last token
    forever (logit = <h, e_t> with h ~ e_last), whatever is in the cache. So an untied model gets a
    sharpened lm_head (output that wanders and changes with any prompt token: the Llama default, on
    which the runtime's tests run) and a tied one a final norm of random signs (no self-preference,
    though it settles into short cycles: the Qwen2 default, tied like the small Qwen2.5 models, so
    the tied export path is tested too). `noise` > 0 adds Gaussian noise of that many weight standard
    deviations to every matrix after init: with the same seed, a draft that agrees with its target
    on some tokens and not on others."""
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
        if noise:
            g = torch.Generator().manual_seed(10_000 + seed)
            for w in model.parameters():
                if w.dim() > 1:
                    w.add_(torch.randn(w.shape, generator=g) * w.std() * noise)
    model.save_pretrained(str(out))
    make_tokenizer(out, vocab)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == arch
    return out
