"""specrt.export: checkpoints -> standard ONNX decoders with a static KV cache (the only torch user).

`export_checkpoint(source, out_dir)` writes:
  model.onnx (+ model.onnx.data)   the decoder graph (see graph.py for its I/O contract)
  tokenizer.json, tokenizer_config.json
  golden.npz                        golden input ids + PyTorch logits + greedy tokens (versioned)
  export.json                       spec, source fingerprint, parity figures, tool versions
and fails loudly when ONNX and PyTorch disagree.
"""

from __future__ import annotations

from .sources import DEFAULT_MODEL, EMBEDDED, Source, fingerprint, resolve  # noqa: F401
