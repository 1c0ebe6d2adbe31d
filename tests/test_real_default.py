"""The real embedded default (SmolLM2-135M-Instruct, fp32): runtime greedy == transformers greedy."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.real

PROMPTS = ["Write a short poem about the sea.", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_runtime_greedy_equals_transformers(default_engines, prompt):
    from specrt.export.exporter import torch_greedy
    from specrt.runtime.generate import Generator

    gen = Generator.load(default_engines)
    ids = gen.prompt_ids(prompt)
    ours = gen.generate(prompt, max_new_tokens=40).token_ids
    model, _ = _model()
    _, ref = torch_greedy(model, np.array(ids, np.int64), 40)
    ref = [int(t) for t in ref]
    eos = set(gen.codec.eos_token_ids)
    if any(t in eos for t in ref):  # generation stops at EOS; compare up to it
        ref = ref[: next(i for i, t in enumerate(ref) if t in eos)]
    assert len(ref) >= 32, "pick prompts whose answer is longer than 32 tokens"
    assert ours == ref


_cache = {}


def _model():
    if "m" not in _cache:
        from specrt.export.sources import load, resolve

        _cache["m"] = load(resolve("smollm2-135m"))
    return _cache["m"]
