"""DecoderSpec: the architecture facts export needs, read once from a Hugging Face config.

Only Llama-family and Qwen2-family decoders are supported; both are the same graph up to biases on
the attention projections and the rotary frequencies, which we take from the model's own rotary
module. The graph's cos/sin tables are static, so only RoPE types whose frequencies do not change
with the sequence length up to max_context come out right: see ROPE_TYPES. Features the graph lacks
(sliding windows, longrope's long factors) cap max_context where they would start to matter
instead of silently diverging from PyTorch there (golden-prompt parity is too short to notice).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import SpecrtError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# rope_type -> static tables equal PyTorch's (tests/test_export.py compares them over 512 positions).
# All but two fix inv_freq at init: "dynamic" rescales only past max_position_embeddings (which export
# refuses anyway) and "longrope" swaps to its long factors past original_max_position_embeddings (capped
# there: see rope_max_context). Anything else (e.g. "proportional", per-layer RoPE) is refused unchecked.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


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
    o_bias: bool  # Llama attention_bias=True biases o_proj too, Qwen2 only q/k/v
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope_type: str
    rope_max_context: int  # last length at which the static tables are still PyTorch's (longrope: original length)
    sliding_window: int | None  # smallest attention window of any layer; None = all layers see everything
    rope_inv_freq: tuple[float, ...]  # [head_dim / 2]
    rope_scaling: float  # multiplies cos/sin (llama3/yarn "attention_scaling")

    @classmethod
    def from_hf(cls, model, max_context: int | None = None) -> "DecoderSpec":
        """Read a transformers *ForCausalLM model (config, rotary and attention modules); with max_context,
        also refuse lengths the graph would get wrong (check_max_context)."""
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
        rope_type = getattr(rotary, "rope_type", "default")
        if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:  # a dict: per-layer RoPE
            raise UnsupportedModelError(f"RoPE type {rope_type!r} is not supported (its frequencies are not checked "
                                        "against the static tables); use a checkpoint with one of "
                                        f"{', '.join(ROPE_TYPES)}")
        max_pos = int(cfg.max_position_embeddings)
        rope_max = int((getattr(cfg, "rope_parameters", None) or {}).get("original_max_position_embeddings", max_pos)
                       if rope_type == "longrope" else max_pos)
        # The model's own attention modules say which layers slide (Qwen2: use_sliding_window and
        # max_window_layers, already resolved into layer_types), so a window merely declared is not refused.
        attns = [layer.self_attn for layer in model.model.layers]
        windows = [w for w in (getattr(a, "sliding_window", None) for a in attns) if w]
        inv_freq = rotary.inv_freq.detach().float().cpu().numpy()
        spec = cls(
            architecture=arch,
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            rms_norm_eps=float(cfg.rms_norm_eps),
            qkv_bias=attns[0].q_proj.bias is not None,
            o_bias=attns[0].o_proj.bias is not None,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=max_pos,
            rope_type=rope_type,
            rope_max_context=rope_max,
            sliding_window=int(min(windows)) if windows else None,
            rope_inv_freq=tuple(float(x) for x in inv_freq),
            rope_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
        )
        if max_context is not None:
            spec.check_max_context(max_context)
        return spec

    def check_max_context(self, max_context: int) -> None:
        """Refuse a cache length past which PyTorch does something this static graph does not."""
        if max_context > self.max_position_embeddings:
            raise SpecrtError(f"--max-context {max_context} exceeds the model's {self.max_position_embeddings} "
                              f"positions; use --max-context <= {self.max_position_embeddings}")
        if self.sliding_window is not None and max_context > self.sliding_window:
            # A query attends to keys at most sliding_window - 1 positions back, so up to this length
            # the window is moot.
            raise SpecrtError(f"this model uses sliding-window attention (window {self.sliding_window}), which the "
                              f"exported graph does not implement; use --max-context <= {self.sliding_window}")
        if max_context > self.rope_max_context:
            raise SpecrtError(f"RoPE type '{self.rope_type}' switches to its long-context factors past "
                              f"{self.rope_max_context} positions and the exported RoPE tables are static; "
                              f"use --max-context <= {self.rope_max_context}")

    def rope_tables(self, max_context: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin: [max_context, head_dim / 2] float32, computed in float64 then rounded once."""
        pos = np.arange(max_context, dtype=np.float64)[:, None]
        freqs = pos * np.asarray(self.rope_inv_freq, dtype=np.float32).astype(np.float64)[None, :]
        cos = (np.cos(freqs) * self.rope_scaling).astype(np.float32)
        sin = (np.sin(freqs) * self.rope_scaling).astype(np.float32)
        return cos, sin
