"""DecoderSpec: the architecture facts export needs, read once from a transformers model with its family's row
(export/families.py), resolved per layer.

The graph's cos/sin tables are static, so only RoPE types whose frequencies do not change with the sequence length
up to max_context come out right (families.ROPE_TYPES); longrope's long factors cap max_context where they would
start to matter instead of silently diverging from PyTorch there (golden-prompt parity is too short to notice).
Sliding windows are applied per layer by both graphs (docs/families.md, "Sliding windows").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import SpecrtError
from .families import (ACTIVATIONS, FAMILIES, ROPE_TYPES, UnsupportedModelError, check_config,  # noqa: F401
                       rope_parameters)

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


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
    rope_inv_freq: tuple[float, ...]  # [rotary_dim / 2] of the first RoPE table
    rope_scaling: float  # multiplies cos/sin (llama3/yarn "attention_scaling")
    # Per-family and per-layer facts (absent from older sets' export.json: the defaults are what those graphs did).
    qk_norm: str = "none"
    norms: str = "pre"
    norm_offset: float = 0.0
    activation: str = "silu"
    fused_projections: bool = False
    embed_scale: float = 1.0
    attention_scale: float = 0.0  # 0: 1/sqrt(head_dim)
    residual_scale: float = 1.0  # folded into o_proj and down_proj
    logit_scale: float = 1.0  # folded into the lm_head
    final_softcap: float = 0.0  # 0: none
    rotary_dim: int = 0  # 0: head_dim
    rope_freqs: tuple[tuple[tuple[float, ...], float], ...] = ()  # (inv_freq, scaling) per table; () = the above
    layer_rope: tuple[int, ...] = ()  # per layer: index into rope_freqs, -1 = no RoPE; () = table 0 everywhere
    layer_window: tuple[int, ...] = ()  # per layer: attention window (0 = none)

    @classmethod
    def from_hf(cls, model, max_context: int | None = None) -> "DecoderSpec":
        """Read a transformers *ForCausalLM model (config, rotary and attention modules) with its family's row; with
        max_context, also refuse lengths the graph would get wrong (check_max_context)."""
        cfg = model.config
        fam = check_config(cfg)
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        tables, rope_types, layer_rope = _rope(model, fam)
        rope_type = rope_types[0]
        max_pos = int(cfg.max_position_embeddings)
        originals = [int(p.get("original_max_position_embeddings", max_pos)) for p in rope_parameters(cfg).values()
                     if p.get("rope_type") == "longrope"]
        attns = [layer.self_attn for layer in model.model.layers]
        windows = _windows(cfg, fam, attns)
        first = next((a for a in (getattr(attns[0], n, None) for n in ("q_proj", "qkv_proj")) if a is not None))
        spec = cls(
            architecture=fam.model_type,
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            rms_norm_eps=float(cfg.rms_norm_eps),
            qkv_bias=first.bias is not None,
            o_bias=attns[0].o_proj.bias is not None,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=max_pos,
            rope_type=rope_type,
            rope_max_context=min([max_pos, *originals]),
            sliding_window=min((w for w in windows if w), default=None),
            rope_inv_freq=tables[0][0],
            rope_scaling=tables[0][1],
            qk_norm=fam.qk_norm, norms=fam.norms, norm_offset=fam.norm_offset,
            activation=ACTIVATIONS[getattr(cfg, fam.activation_field, None) or "silu"],
            fused_projections=fam.fused,
            embed_scale=_embed_scale(cfg, fam.embed_scale),
            attention_scale=_attention_scale(cfg, fam.attn_scale, head_dim),
            residual_scale=float(cfg.residual_multiplier) if fam.residual_multiplier else 1.0,
            logit_scale=1.0 / float(cfg.logits_scaling) if fam.logits_scaling else 1.0,
            final_softcap=float(getattr(cfg, "final_logit_softcapping", None) or 0.0) if fam.final_softcap else 0.0,
            rotary_dim=2 * len(tables[0][0]),
            rope_freqs=tables, layer_rope=layer_rope, layer_window=windows,
        )
        if max_context is not None:
            spec.check_max_context(max_context)
        return spec

    def check_max_context(self, max_context: int) -> None:
        """Refuse a cache length past which PyTorch does something this static graph does not."""
        if max_context > self.max_position_embeddings:
            raise SpecrtError(f"--max-context {max_context} exceeds the model's {self.max_position_embeddings} "
                              f"positions; use --max-context <= {self.max_position_embeddings}")
        if max_context > self.rope_max_context:
            raise SpecrtError(f"RoPE type '{self.rope_type}' switches to its long-context factors past "
                              f"{self.rope_max_context} positions and the exported RoPE tables are static; "
                              f"use --max-context <= {self.rope_max_context}")

    def rope_tables_at(self, max_context: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """(cos, sin) [max_context, rotary_dim / 2] float32 per RoPE table, computed in float64 then rounded once."""
        out = []
        for inv_freq, scaling in self.rope_freqs or ((self.rope_inv_freq, self.rope_scaling),):
            pos = np.arange(max_context, dtype=np.float64)[:, None]
            freqs = pos * np.asarray(inv_freq, dtype=np.float32).astype(np.float64)[None, :]
            out.append(((np.cos(freqs) * scaling).astype(np.float32), (np.sin(freqs) * scaling).astype(np.float32)))
        return out

    def rope_tables(self, max_context: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin of the first table: [max_context, rotary_dim / 2] float32."""
        return self.rope_tables_at(max_context)[0]


def _rope(model, fam) -> tuple[tuple, list[str], tuple[int, ...]]:
    """-> ((inv_freq, scaling) per table, the tables' rope types, per layer: its table or -1 for none)."""
    cfg, rotary = model.config, model.model.rotary_emb
    n = cfg.num_hidden_layers
    if fam.rope_by_layer_type:
        kinds = sorted(set(cfg.layer_types))
        found = [(getattr(rotary, f"{k}_inv_freq"), getattr(rotary, f"{k}_attention_scaling"), rotary.rope_type[k])
                 for k in kinds]
        layer_rope = [kinds.index(cfg.layer_types[i]) for i in range(n)]
    else:
        found = [(rotary.inv_freq, getattr(rotary, "attention_scaling", 1.0), getattr(rotary, "rope_type", "default"))]
        layer_rope = [0] * n
    for *_, rope_type in found:
        if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:  # checked from the config already
            raise UnsupportedModelError(f"RoPE type {rope_type!r} is not supported (its frequencies are not checked "
                                        f"against the static tables); use a checkpoint with one of "
                                        f"{', '.join(ROPE_TYPES)}")
    if fam.nope_layers:
        layer_rope = [r if cfg.no_rope_layers[i] else -1 for i, r in enumerate(layer_rope)]
    tables = tuple((tuple(float(x) for x in inv.detach().float().cpu().numpy()), float(s)) for inv, s, _ in found)
    return tables, [t for *_, t in found], tuple(layer_rope)


def _windows(cfg, fam, attns) -> tuple[int, ...]:
    """Per layer, the number of keys a query sees (itself included; 0 = all). Qwen2's use_sliding_window and
    max_window_layers are resolved by its attention modules, so a window merely declared does not count."""
    if fam.windows == "all":
        return tuple(int(getattr(cfg, "sliding_window", None) or 0) for _ in attns)
    if fam.windows == "layers":
        return tuple(int(getattr(a, "sliding_window", None) or 0) for a in attns)
    return tuple(0 for _ in attns)


def _embed_scale(cfg, how: str) -> float:
    if how == "sqrt_hidden":  # a float32 buffer in transformers
        return float(np.float32(cfg.hidden_size ** 0.5))
    return float(cfg.embedding_multiplier) if how == "embedding_multiplier" else 1.0


def _attention_scale(cfg, how: str, head_dim: int) -> float:
    if how == "query_pre_attn_scalar":
        return float(cfg.query_pre_attn_scalar) ** -0.5
    return float(cfg.attention_multiplier) if how == "attention_multiplier" else float(head_dim) ** -0.5
