"""The engine graphs' interface, shared by export/, build/, runtime/ and the pipeline: every input and output
name a decoder graph, its logit screen and a Medusa heads graph have, the shapes an engine set's manifest
records for them, and the feeds of one chain pass for callers that drive a decoder graph with onnxruntime
directly (export parity, GPTQ calibration). The runtime binds the same names through IOBinding
(runtime/engine.py). Kept here, outside the stages, so no stage imports another (docs/architecture.md, "Stages
meet only through files").
"""

from __future__ import annotations

import numpy as np

# A decoder graph (export/graph.py writes it; every engine built from it keeps these names).
INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
TREE_MASK = "tree_mask"
SEQLENS_K = "seqlens_k"
TOTAL_SEQUENCE_LENGTH = "total_sequence_length"
NUM_LOGITS_TO_KEEP = "num_logits_to_keep"
LOGITS = "logits"
HIDDEN_STATES = "hidden_states"
PAST_PREFIX, PRESENT_PREFIX = "past_key_values.", "present."
KV_KINDS = ("key", "value")

# An fp32 engine's logit screen (build/screen.py): one more input and one more output.
APPROX_INPUT, GREEDY_OUTPUT = "approx_logits", "greedy_tokens"

# A Medusa heads graph (export/medusa.py): the target's hidden state (+ the pending token, for token-input heads).
HEADS_HIDDEN, HEADS_TOKEN = "hidden", "token"
HEADS_CANDIDATES, HEADS_SCORES = "candidates", "scores"

# (name, dims, dtype) of a decoder graph's inputs and outputs other than the cache, in graph order. A dim
# named after a size of the model (num_kv_heads, head_dim, hidden_size, vocab_size) stands for that size.
DECODER_INPUTS = (
    (INPUT_IDS, ("batch", "seq"), "int64"),
    (POSITION_IDS, ("batch", "seq"), "int64"),
    (TREE_MASK, ("batch", "seq", "seq"), "float32"),
    (SEQLENS_K, ("batch",), "int32"),
    (TOTAL_SEQUENCE_LENGTH, (), "int32"),
    (NUM_LOGITS_TO_KEEP, (), "int64"),
)
DECODER_OUTPUTS = (
    (LOGITS, ("batch", "num_logits", "vocab_size"), "float32"),
    (HIDDEN_STATES, ("batch", "seq", "hidden_size"), "float32"),
)
CACHE_DIMS, CACHE_DTYPE = ("batch", "num_kv_heads", "max_context", "head_dim"), "float32"  # past and present


def past_name(layer, kind: str) -> str:
    """The cache input of `layer` (an int, or "{i}" in descriptions), kind "key" or "value"."""
    return f"{PAST_PREFIX}{layer}.{kind}"


def present_name(layer, kind: str) -> str:
    """The cache output of `layer`; it shares the buffer of past_name(layer, kind)."""
    return f"{PRESENT_PREFIX}{layer}.{kind}"


def _dims(dims, sizes: dict) -> list:
    return [sizes.get(d, d) for d in dims]


def _signature(num_layers: int, sizes: dict, ins, outs, cache_dims, cache_dtype: str) -> tuple[list, list]:
    cache = _dims(cache_dims, sizes)
    inputs = [(n, _dims(d, sizes), t) for n, d, t in ins]
    outputs = [(n, _dims(d, sizes), t) for n, d, t in outs]
    for i in range(num_layers):
        for kind in KV_KINDS:
            inputs.append((past_name(i, kind), cache, cache_dtype))
            outputs.append((present_name(i, kind), cache, cache_dtype))
    return inputs, outputs


def decoder_signature(num_layers: int, sizes: dict) -> tuple[list, list]:
    """(inputs, outputs) of a decoder graph with `num_layers` layers, each a list of (name, dims, dtype) in
    graph order; sizes maps num_kv_heads, head_dim, hidden_size and vocab_size to the model's (the rest stay
    symbolic)."""
    return _signature(num_layers, sizes, DECODER_INPUTS, DECODER_OUTPUTS, CACHE_DIMS, CACHE_DTYPE)


def decoder_io_description(sizes: dict) -> tuple[dict, dict]:
    """The decoder graph's inputs and outputs as a manifest entry records them: {name: [*dims, dtype]}, the
    cache once for every layer."""
    return _description(sizes, DECODER_INPUTS, DECODER_OUTPUTS, CACHE_DIMS, CACHE_DTYPE)


def _description(sizes: dict, ins, outs, cache_dims, cache_dtype: str) -> tuple[dict, dict]:
    every = "|".join(KV_KINDS)
    inputs = {n: [*_dims(d, sizes), t] for n, d, t in ins}
    inputs[past_name("{i}", every)] = [*_dims(cache_dims, sizes), cache_dtype]
    outputs = {n: [*_dims(d, sizes), t] for n, d, t in outs}
    outputs[present_name("{i}", every)] = "shares the past buffer"
    return inputs, outputs


def heads_io_description(hidden_size: int, heads: int, topk: int, token_input: bool) -> tuple[dict, dict]:
    """A Medusa heads graph's inputs and outputs as a manifest entry records them."""
    inputs = {HEADS_HIDDEN: ["batch", hidden_size, "float32"],
              **({HEADS_TOKEN: ["batch", "int64"]} if token_input else {})}
    outputs = {HEADS_CANDIDATES: ["batch", heads, topk, "int64"], HEADS_SCORES: ["batch", heads, topk, "float32"]}
    return inputs, outputs


def chain_feeds(tokens, start: int, n_logits: int, past: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inputs of one pass of a decoder graph over `tokens` at positions [start, start + n), as a chain
    (no tree), for callers that drive the graph with onnxruntime directly (export parity, calibration)."""
    n = len(tokens)
    return {INPUT_IDS: np.asarray(tokens, np.int64)[None],
            POSITION_IDS: np.arange(start, start + n, dtype=np.int64)[None],
            TREE_MASK: np.zeros((1, n, n), np.float32), SEQLENS_K: np.array([start + n - 1], np.int32),
            TOTAL_SEQUENCE_LENGTH: np.array(start + n, np.int32),
            NUM_LOGITS_TO_KEEP: np.array(n_logits, np.int64), **past}


# The portable decoder graph (export/portable.py): standard ONNX ops only (TensorScatter into the cache, Attention
# over it), every inner shape fixed by the input shapes, so a (pass width W, cache capacity C) pair is one static
# shape a CUDA graph can capture. Cache inputs and outputs keep the names above, dims [batch, num_kv_heads,
# capacity, head_dim]; the runtime builds the mask (runtime/static_shapes.py).
ATTENTION_MASK = "attention_mask"   # [batch, 1, seq, capacity] float32 additive: 0 = attend, -inf = not
WRITE_INDICES = "write_indices"     # [batch] int64: the cache slot of the pass's first token
LOGITS_INDICES = "logits_indices"   # [num_logits] int64: the rows of the pass that get logits
GREEDY_TOKENS = "greedy_tokens"     # [batch, num_logits] int64: argmax of each logits row, on the device
PORTABLE_INPUTS = (
    (INPUT_IDS, ("batch", "seq"), "int64"),
    (POSITION_IDS, ("batch", "seq"), "int64"),
    (ATTENTION_MASK, ("batch", 1, "seq", "capacity"), "float32"),
    (WRITE_INDICES, ("batch",), "int64"),
    (LOGITS_INDICES, ("num_logits",), "int64"),
)
PORTABLE_OUTPUTS = (
    (LOGITS, ("batch", "num_logits", "vocab_size"), "float32"),
    (GREEDY_TOKENS, ("batch", "num_logits"), "int64"),
    (HIDDEN_STATES, ("batch", "seq", "hidden_size"), "float32"),
)
PORTABLE_CACHE_DIMS = ("batch", "num_kv_heads", "capacity", "head_dim")
# precision -> dtype of activations and cache; fp8, int8 and int4-awq are Q/DQ GEMMs over the fp32 graph
# (build/quantize.py)
# the Q/DQ precisions quantize GEMMs over an fp16 activation base: what GPU kernels take (FP8/INT8/INT4 GEMMs
# over fp16 activations, attention in fp16) and what TensorRT's dedicated attention kernels accept
QDQ_BASE = "fp16"
PORTABLE_DTYPES = {"fp32": "float32", "fp16": "float16", "fp8": "float16", "int8": "float16", "int4-awq": "float16"}
QDQ_PRECISIONS = ("fp8", "int8", "int4-awq")
# the Q/DQ precisions that quantize GEMM inputs too (int4-awq's stay float): outlier channels and the sensitivity scan
ACTIVATION_QDQ = ("fp8", "int8")


def portable_signature(num_layers: int, sizes: dict, cache_dtype: str) -> tuple[list, list]:
    """(inputs, outputs) of a portable decoder graph, each a list of (name, dims, dtype) in graph order."""
    return _signature(num_layers, sizes, PORTABLE_INPUTS, PORTABLE_OUTPUTS, PORTABLE_CACHE_DIMS, cache_dtype)


def portable_io_description(sizes: dict, cache_dtype: str) -> tuple[dict, dict]:
    """The portable graph's inputs and outputs as a manifest entry records them."""
    return _description(sizes, PORTABLE_INPUTS, PORTABLE_OUTPUTS, PORTABLE_CACHE_DIMS, cache_dtype)


# --- EAGLE heads (export/eagle.py): one decoder layer over the target's features, its own KV cache -------------
EAGLE_FEATURES = "features"            # [batch, seq, hidden] float32: the target's (or the head's own) feature
EAGLE_TOKENS = "draft_tokens"          # [batch, seq, topk] int64: the best next tokens (target ids), best first
EAGLE_LOGPROBS = "draft_logprobs"      # [batch, seq, topk] float32: their log-probabilities (draft vocabulary)
EAGLE_INPUTS = (
    (EAGLE_FEATURES, ("batch", "seq", "hidden_size"), "float32"),
    (INPUT_IDS, ("batch", "seq"), "int64"),       # at position i: the token after it (x_{i+1})
    (POSITION_IDS, ("batch", "seq"), "int64"),
    (ATTENTION_MASK, ("batch", 1, "seq", "capacity"), "float32"),
    (WRITE_INDICES, ("batch",), "int64"),
)
EAGLE_OUTPUTS = (
    (HIDDEN_STATES, ("batch", "seq", "hidden_size"), "float32"),  # the predicted next features
    (EAGLE_TOKENS, ("batch", "seq", "topk"), "int64"),
    (EAGLE_LOGPROBS, ("batch", "seq", "topk"), "float32"),
)
