"""Peers: other runtimes on the same checkpoint, behind one interface, so the runner treats them
and our own modes alike.

Contract of a `Contender` (ours or a peer): `load()` once (may build and cache), then
`run(prompt_ids, messages, max_new_tokens) -> Trace` any number of times, greedy, stopping at
the engine set's EOS ids (with `Checkpoint.ignore_eos`: after exactly max_new_tokens; ours and
llama.cpp decode through EOS, genai and transformers suppress it, their only way to go on).
Every contender gets the same prompt token ids (ours renders them from `messages` with the same template), so
outputs compare token by token. A peer whose package is missing is skipped with a one-line note.
More: docs/bench-notes.md, "Module notes: bench/peers.py".
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PLD_TOKENS = 10  # draft length for every prompt-lookup peer (llama.cpp's and transformers' default is 10)


@dataclass(frozen=True)
class Trace:
    """One timed generation. t_tokens[i]: seconds from the call until token i was available."""
    token_ids: list[int]
    t_tokens: list[float]
    total_s: float
    tau: float | None = None  # tokens per target pass, where the contender reports it
    acceptance: tuple[float, ...] = ()  # acceptance rate per draft position
    # the counts behind them, so the runner pools runs (a mean of per-run rates weighs a 2-round run like a
    # 40-round one): target passes, and per draft position the rounds that drafted it and kept it
    rounds: int | None = None
    drafted: tuple[int, ...] = ()
    accepted: tuple[int, ...] = ()
    proposer: str | None = None  # what drafted (Stats.proposer, e.g. what `auto` resolved to; a draft model's engine)


class Unavailable(Exception):
    """The peer cannot run here (package missing, wrong checkpoint kind): skip it with this note."""


@dataclass(frozen=True)
class Checkpoint:
    """What peers need to know about the engine set's source checkpoint."""
    kind: str  # "gguf" | "hf"
    path: Path
    sha256: str
    eos_ids: tuple[int, ...]
    cache: Path  # engines/.cache/peers
    threads: int
    assistant: Path | None = None  # HF checkpoint of a smaller model with the same vocab (hf-assisted)
    context: int = 4096  # the longest prompt + max_new_tokens the bench will ask for
    ignore_eos: bool = False  # every contender makes exactly max_new_tokens (equal lengths for timing)


@dataclass
class Clock:
    """Collects token arrival times for one call."""
    t0: float = field(default_factory=time.perf_counter)
    ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    def add(self, tokens) -> None:
        t = time.perf_counter() - self.t0
        for tok in tokens:
            self.ids.append(int(tok))
            self.times.append(t)

    def trace(self, **kw) -> Trace:
        return Trace(self.ids, self.times, time.perf_counter() - self.t0, **kw)


def _require(module: str, pip_name: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise Unavailable(f"{pip_name} is not installed (pip install 'specrt[bench]')") from None


def hf_folder(ck: Checkpoint) -> Path:
    """The checkpoint as a Hugging Face folder (a GGUF is dequantized once and cached)."""
    if ck.kind == "hf":
        return ck.path
    out = ck.cache / f"hf-{ck.sha256[:12]}"
    if (out / "config.json").is_file():
        return out
    _require("transformers", "transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = ck.cache / f".tmp-hf-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    kw = {"gguf_file": ck.path.name}
    model = AutoModelForCausalLM.from_pretrained(str(ck.path.parent), dtype=torch.float32, **kw)
    # the weights are already dequantized to fp32; the "gguf quantizer" left on the model only blocks saving
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(str(ck.path.parent), **kw).save_pretrained(tmp)
    tmp.rename(out)
    return out


def _file_key(path: Path) -> str:
    """A cheap cache key for a GGUF we have no hash of (size + mtime + name)."""
    import hashlib

    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()


class GenaiPeer:
    """onnxruntime-genai: builder output cached per (checkpoint, precision); CPU, `threads` intra-op."""

    def __init__(self, ck: Checkpoint, precision: str):
        self.ck, self.precision, self.name = ck, precision, f"genai-{precision}"

    def build_dir(self) -> Path:
        return self.ck.cache / f"genai-{self.ck.sha256[:12]}-{self.precision}"

    def load(self, log=print) -> None:
        og = _require("onnxruntime_genai", "onnxruntime-genai")
        out = self.build_dir()
        if not (out / "genai_config.json").is_file():
            src = hf_folder(self.ck)
            tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            log(f"{self.name}: building with onnxruntime_genai.models.builder (cached in {out})")
            cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o", str(tmp),
                   "-p", self.precision, "-e", "cpu", "-c", str(tmp) + "-work"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            shutil.rmtree(str(tmp) + "-work", ignore_errors=True)
            if r.returncode != 0 or not (tmp / "genai_config.json").is_file():
                tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
                raise Unavailable(f"onnxruntime-genai builder failed: {tail[0][:200]}")
            tmp.rename(out)
        config = og.Config(str(out))
        config.clear_providers()  # CPU
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": self.ck.threads, "inter_op_num_threads": 1}}}}))
        self._og, self.model = og, og.Model(config)

    def run(self, prompt_ids: list[int], messages, max_new_tokens: int) -> Trace:
        og, eos = self._og, set() if self.ck.ignore_eos else set(self.ck.eos_ids)
        clock = Clock()
        params = og.GeneratorParams(self.model)
        length = len(prompt_ids) + max_new_tokens
        params.set_search_options(do_sample=False, max_length=length, min_length=length if self.ck.ignore_eos else 0)
        gen = og.Generator(self.model, params)
        gen.append_tokens(prompt_ids)  # prefill
        while len(clock.ids) < max_new_tokens and not gen.is_done():
            gen.generate_next_token()
            tok = int(gen.get_next_tokens()[0])
            if tok in eos:
                break
            clock.add((tok,))
        return clock.trace()


def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_tile" in f.read()
    except OSError:
        return False


class LlamaCppPeer:
    """llama-cpp-python on the GGUF itself (its own quantized kernels); optional prompt lookup."""

    def __init__(self, ck: Checkpoint, prompt_lookup: bool):
        # n_ctx sized to the bench: logits_all keeps n_ctx x vocab floats (0.8 GB at 4096 x 49152)
        self.ck, self.pld, self.n_ctx = ck, prompt_lookup, ck.context + 2 * PLD_TOKENS
        self.name = "llamacpp-pld" if prompt_lookup else "llamacpp"

    def load(self, log=print) -> None:
        if self.ck.kind != "gguf":
            raise Unavailable("llama.cpp needs a GGUF checkpoint; this engine set was built from a HF folder")
        llama_cpp = _require("llama_cpp", "llama-cpp-python")
        draft = None
        if self.pld:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=PLD_TOKENS)
        # llama.cpp's defaults, except on AMX CPUs: there ggml's AMX kernels (picked through "extra buffer
        # types") segfault on Q4_1 weights with a batch > 1 in 0.3.36, so extra buffer types go off and ggml
        # runs its AVX-512 kernels (weight repacking, the other extra type, does not cover Q4_1 anyway).
        # Llama() has no switch for it.
        import llama_cpp.llama as llama_mod

        default_params = llama_mod.llama_cpp.llama_model_default_params

        def params_without_extra_bufts():
            p = default_params()
            p.use_extra_bufts = False
            return p

        if _has_amx():
            llama_mod.llama_cpp.llama_model_default_params = params_without_extra_bufts
        try:
            # logits_all with a draft model: 0.3.36 fails past 512 tokens of context without it
            self.llm = llama_cpp.Llama(str(self.ck.path), n_ctx=self.n_ctx, n_threads=self.ck.threads,
                                       n_threads_batch=self.ck.threads, draft_model=draft, logits_all=self.pld,
                                       verbose=False, seed=0)
        finally:
            llama_mod.llama_cpp.llama_model_default_params = default_params

    def run(self, prompt_ids: list[int], messages, max_new_tokens: int) -> Trace:
        eos = set() if self.ck.ignore_eos else set(self.ck.eos_ids) | {self.llm.token_eos()}
        self.llm.reset()  # no prefix reuse across calls: every call pays its prefill
        clock = Clock()
        for tok in self.llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                     reset=True):
            if tok in eos:
                break
            clock.add((tok,))
            if len(clock.ids) >= max_new_tokens:
                break
        return clock.trace()


_HF_MODELS: dict[str, object] = {}  # one loaded copy per checkpoint, shared by hf / hf-pld / hf-assisted


def _hf_model(path: Path):
    """fp32 model from a HF folder (a GGUF goes through the cached dequantized folder: loads in seconds)."""
    if str(path) not in _HF_MODELS:
        import torch
        from transformers import AutoModelForCausalLM

        _HF_MODELS[str(path)] = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return _HF_MODELS[str(path)]


class HFPeer:
    """transformers `generate` in fp32 (the GGUF dequantized): plain, prompt lookup, or assisted."""

    def __init__(self, ck: Checkpoint, variant: str):
        assert variant in ("plain", "pld", "assisted")
        self.ck, self.variant = ck, variant
        self.name = "hf" if variant == "plain" else f"hf-{variant}"

    def load(self, log=print) -> None:
        _require("transformers", "transformers")
        import torch

        if self.variant == "assisted" and self.ck.assistant is None:
            raise Unavailable("hf-assisted needs a smaller checkpoint with the same vocabulary: "
                              "pass --hf-assistant DIR")
        torch.set_num_threads(self.ck.threads)
        self._torch, self.model = torch, _hf_model(hf_folder(self.ck))
        self.extra = {}
        if self.variant == "pld":
            self.extra = {"prompt_lookup_num_tokens": PLD_TOKENS}
        elif self.variant == "assisted":
            a = self.ck.assistant
            if a.suffix == ".gguf":
                a = hf_folder(Checkpoint("gguf", a, _file_key(a), (), self.ck.cache, self.ck.threads))
            self.extra = {"assistant_model": _hf_model(a)}

    def run(self, prompt_ids: list[int], messages, max_new_tokens: int) -> Trace:
        torch, eos = self._torch, list(self.ck.eos_ids)
        clock = Clock()

        class Streamer:  # generate() calls put() with the prompt first, then each step's new tokens
            first = True

            def put(self, value):
                if self.first:
                    self.first = False
                    return
                clock.add(t for t in value.reshape(-1).tolist() if t not in eos)

            def end(self):
                pass

        ids = torch.tensor([prompt_ids], dtype=torch.long)
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=eos, pad_token_id=eos[0], streamer=Streamer(),
                                min_new_tokens=max_new_tokens if self.ck.ignore_eos else None, **self.extra)
        return clock.trace()


PEERS = {  # name -> factory(checkpoint)
    "genai-fp32": lambda ck: GenaiPeer(ck, "fp32"),
    "genai-int4": lambda ck: GenaiPeer(ck, "int4"),
    "llamacpp": lambda ck: LlamaCppPeer(ck, prompt_lookup=False),
    "llamacpp-pld": lambda ck: LlamaCppPeer(ck, prompt_lookup=True),
    "hf": lambda ck: HFPeer(ck, "plain"),
    "hf-pld": lambda ck: HFPeer(ck, "pld"),
    "hf-assisted": lambda ck: HFPeer(ck, "assisted"),
}
