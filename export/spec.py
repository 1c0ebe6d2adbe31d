"""DecoderSpec: the architecture facts export needs, read once from a Hugging Face config.

Only Llama-family and Qwen2-family decoders are supported; both are the same
graph up to biases on the q/k/v projections and the rotary frequencies, which
we take from the model's own rotary module so every RoPE variant transformers
knows (default, llama3, linear, ...) comes out right without re-deriving it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import SpecrtError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


class UnsupportedModelError(SpecrtError):
    """The checkpoint is not a decoder this exporter knows."""


@dataclass(frozen=True)
class DecoderSpec:
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope_inv_freq: tuple[float, ...]  # [head_dim / 2]
    rope_scaling: float  # multiplies cos/sin (llama3/yarn "attention_scaling")

    @classmethod
    def from_hf(cls, model) -> "DecoderSpec":
        """Read a transformers *ForCausalLM model (config + rotary module)."""
        cfg = model.config
        arch = getattr(cfg, "model_type", "?")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture '{arch}' is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama- and Qwen2-family decoders)"
            )
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"activation '{act}' is not supported; only silu (SwiGLU MLP)")
        if getattr(cfg, "mlp_bias", False):
            raise UnsupportedModelError("MLP biases are not supported; only bias-free SwiGLU MLPs")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        rotary = model.model.rotary_emb
        inv_freq = rotary.inv_freq.detach().float().cpu().numpy()
        qkv_bias = arch == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        return cls(
            architecture=arch,
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            rms_norm_eps=float(cfg.rms_norm_eps),
            qkv_bias=qkv_bias,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.max_position_embeddings),
            rope_inv_freq=tuple(float(x) for x in inv_freq),
            rope_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
        )

    def rope_tables(self, max_context: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin: [max_context, head_dim / 2] float32, computed in float64 then rounded once."""
        pos = np.arange(max_context, dtype=np.float64)[:, None]
        freqs = pos * np.asarray(self.rope_inv_freq, dtype=np.float32).astype(np.float64)[None, :]
        cos = (np.cos(freqs) * self.rope_scaling).astype(np.float32)
        sin = (np.sin(freqs) * self.rope_scaling).astype(np.float32)
        return cos, sin
