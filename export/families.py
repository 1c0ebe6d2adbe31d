"""The decoder families export takes: one row per transformers model_type saying what its decoder needs.

Everything the fused graph (export/graph.py), the portable graph (export/portable.py) and the heads do differently
per family is read from a row here (or from the per-layer facts DecoderSpec resolves with it), never from the
model's name. `check_config` refuses, from config.json alone and before any weight loads, a family without a row
and any feature a config asks for that no graph implements (docs/families.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpecrtError


class UnsupportedModelError(SpecrtError):
    """The checkpoint is not a decoder this exporter knows, or asks for a feature it lacks."""


@dataclass(frozen=True)
class Family:
    model_type: str
    label: str
    qk_norm: str = "none"               # none | head (RMSNorm per head, before RoPE) | proj (over the projection)
    norms: str = "pre"                  # a key of NORM_PLACES
    norm_offset: float = 0.0            # 1.0: norms scale by (1 + w)
    embed_scale: str = "none"           # none | sqrt_hidden | embedding_multiplier
    attn_scale: str = "head_dim"        # head_dim (1/sqrt(d)) | query_pre_attn_scalar | attention_multiplier
    activation_field: str = "hidden_act"  # the config field naming the MLP's activation
    fused: bool = False                 # the checkpoint holds qkv_proj / gate_up_proj
    windows: str = "none"               # none | all (config.sliding_window on every layer) | layers (per module)
    rope_by_layer_type: bool = False    # rope_parameters per layer type (local and global RoPE bases)
    nope_layers: bool = False           # config.no_rope_layers[i] == 0: layer i has no RoPE
    residual_multiplier: bool = False   # branch outputs times config.residual_multiplier
    logits_scaling: bool = False        # logits / config.logits_scaling
    final_softcap: bool = False         # tanh soft-capping of the logits (final_logit_softcapping)
    gguf: tuple[str, ...] = ()          # GGUF general.architecture names that load as this family


# norms -> the Hugging Face names of (before attention, after attention, before the MLP, after the MLP); None: absent
NORM_PLACES = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
}
# transformers' ACT2FN name -> the graph's activation (both graphs write it from the same helper)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
# rope_type -> static tables equal PyTorch's (tests/test_export.py compares them over 512 positions). All but two fix
# inv_freq at init: "dynamic" rescales only past max_position_embeddings (which export refuses anyway) and "longrope"
# swaps to its long factors past original_max_position_embeddings (capped there: DecoderSpec.rope_max_context).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")

_ROWS = (
    Family("llama", "Llama 2/3.x, SmolLM2", gguf=("llama",)),
    Family("qwen2", "Qwen2/2.5", windows="layers", gguf=("qwen2",)),
    Family("qwen3", "Qwen3", qk_norm="head", windows="layers", gguf=("qwen3",)),
    Family("mistral", "Mistral", windows="all", gguf=("mistral",)),
    Family("ministral", "Ministral", windows="layers"),
    Family("gemma3_text", "Gemma 3 (text)", qk_norm="head", norms="sandwich", norm_offset=1.0,
           embed_scale="sqrt_hidden", attn_scale="query_pre_attn_scalar", activation_field="hidden_activation",
           windows="layers", rope_by_layer_type=True, final_softcap=True, gguf=("gemma3",)),
    Family("phi3", "Phi-3, Phi-4-mini", fused=True, windows="all", gguf=("phi3",)),
    Family("smollm3", "SmolLM3", windows="layers", nope_layers=True),
    Family("granite", "Granite 3.x", embed_scale="embedding_multiplier", attn_scale="attention_multiplier",
           residual_multiplier=True, logits_scaling=True),
    Family("olmo2", "OLMo 2", qk_norm="proj", norms="post"),
)
FAMILIES = {f.model_type: f for f in _ROWS}


def supported() -> str:
    return ", ".join(FAMILIES)


def family_for_gguf(arch: str | None) -> Family | None:
    return next((f for f in _ROWS if arch in f.gguf), None)


def _refuse(family: str, feature: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{family}: {feature} is not supported by specrt's export; "
                                 "see docs/families.md for what each family takes")


def rope_parameters(config) -> dict:
    """{layer type or "": rope parameters} of a config (rope_parameters is per layer type for some families)."""
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) or v is None for v in params.values()):
        return {k: v for k, v in params.items() if v is not None}
    return {"": params}


def check_config(config) -> Family:
    """The row of a transformers config, or one line naming the family and the first feature no graph implements."""
    mt = getattr(config, "model_type", "?")
    fam = FAMILIES.get(mt)
    if fam is None:
        raise UnsupportedModelError(f"architecture '{mt}' is not supported; supported: {supported()} "
                                    "(docs/families.md)")
    act = getattr(config, fam.activation_field, None) or "silu"
    if act not in ACTIVATIONS:
        raise _refuse(mt, f"activation '{act}' ({fam.activation_field}; supported: {', '.join(ACTIVATIONS)})")
    if getattr(config, "mlp_bias", False):
        raise _refuse(mt, "mlp_bias (MLP biases)")
    for kind, params in rope_parameters(config).items():
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise _refuse(mt, f"RoPE type '{rope_type}'" + (f" on {kind} layers" if kind else "")
                          + f" (supported: {', '.join(ROPE_TYPES)})")
    if getattr(config, "attn_logit_softcapping", None):
        raise _refuse(mt, "attn_logit_softcapping (attention logit soft-capping)")
    if getattr(config, "final_logit_softcapping", None) and not fam.final_softcap:
        raise _refuse(mt, "final_logit_softcapping")
    if getattr(config, "use_bidirectional_attention", False):
        raise _refuse(mt, "use_bidirectional_attention")
    bad = sorted(set(getattr(config, "layer_types", None) or ()) - set(LAYER_TYPES))
    if bad:
        raise _refuse(mt, f"layer type '{bad[0]}' (supported: {', '.join(LAYER_TYPES)})")
    if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        raise _refuse(mt, "mixture-of-experts MLPs")
    return fam


def check_source(path, gguf_file: str | None = None) -> Family:
    """check_config on a checkpoint's config (config.json, or a GGUF's header) read with transformers' AutoConfig,
    before any weight loads."""
    from transformers import AutoConfig

    from ..errors import first_line

    try:
        config = AutoConfig.from_pretrained(str(path), **({"gguf_file": gguf_file} if gguf_file else {}))
    except (ValueError, KeyError) as e:  # an unknown model_type is a ValueError naming it
        raise UnsupportedModelError(f"cannot read the config of '{path}': {first_line(e)}; supported: "
                                    f"{supported()}") from None
    return check_config(config)


def rope_theta(config) -> float:
    """The (global) RoPE base of a config: the full-attention layers' where it is per layer type."""
    params = rope_parameters(config)
    p = params.get("full_attention") or params.get("") or next(iter(params.values()), {})
    return float(p.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
