"""Shared fixtures: tiny checkpoints and engine sets built once per test session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root: experiments/ (not installed)

from tiny import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint (HF directory)."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen2", "qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_engines(tiny_dir, tmp_path_factory) -> Path:
    """An engine set (fp32 + int4) for the tiny Llama, built through the real pipeline."""
    from specrt.pipeline import EngineSetRequest, make_engine_set

    out = tmp_path_factory.mktemp("engines")
    return make_engine_set(EngineSetRequest(str(tiny_dir), "tiny", ("fp32", "int4"), 256, out), log=lambda m: None)


@pytest.fixture(scope="session")
def portable_engines(tiny_dir, tiny_engines) -> Path:
    """fp32 + fp16 portable sets of the tiny Llama, beside tiny_engines (one export cache)."""
    from specrt.pipeline import EngineSetRequest, make_engine_set

    return make_engine_set(EngineSetRequest(str(tiny_dir), "tiny-portable", ("fp32", "fp16"), 256,
                                            tiny_engines.parent, backend="onnxruntime-portable"), log=lambda m: None)


# Fixtures that make a test slow: the embedded default's engine set (minutes to build) and test_portable's
# calibrated fp8/int8/int4-awq set.
SLOW_FIXTURES = {"default_engines", "agent_engines", "quantized_engines"}


def pytest_collection_modifyitems(config, items):
    """Tests marked `real` (the embedded default model) or using a SLOW_FIXTURES set are slow too: the quick tier,
    `pytest -m "not slow"` (`make test-quick`), leaves them out."""
    for item in items:
        if item.get_closest_marker("real") is not None or SLOW_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def default_engines(request, tmp_path_factory) -> Path:
    """The embedded default (SmolLM2-135M) at fp32, built once into pytest's cache folder
    (.pytest_cache/d/default-engines, never the repository's engines/) and found there by later sessions, as the
    build is minutes and writing the set again re-runs its parity check; `pytest --cache-clear` drops it. With the
    cache plugin off (-p no:cacheprovider) it builds under pytest's temporary folder."""
    from specrt.pipeline import EngineSetRequest, make_engine_set

    cache = getattr(request.config, "cache", None)
    out = cache.mkdir("default-engines") if cache is not None else tmp_path_factory.mktemp("default-engines")
    return make_engine_set(EngineSetRequest("smollm2-135m", "smollm2-135m-test", ("fp32",), 2048, out),
                           log=lambda m: None)


@pytest.fixture(scope="session")
def agent_engines(request) -> Path:
    """The set the voice-agent framework tests talk to: $SPECRT_AGENT_ENGINES (e.g. a Qwen2.5-Coder set, at fp32),
    else the embedded default."""
    import os

    path = os.environ.get("SPECRT_AGENT_ENGINES")
    return Path(path) if path else request.getfixturevalue("default_engines")
