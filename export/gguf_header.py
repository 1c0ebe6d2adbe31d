"""A GGUF file's header (key-value fields, tensor names) without its vocabulary: gguf's GGUFReader builds a numpy view
of every token string, the bulk of a cached `serve --model` start (docs/usage.md, "From a model file to an endpoint"),
where only a few scalar fields are needed. The layout is the GGUF spec's (gguf's constants name the value types);
what this walk does not take (a v1 or big-endian file, nested arrays) is read by GGUFReader instead."""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFReader, GGUFValueType

_SCALAR = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
           GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
           GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
           GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}


@dataclass(frozen=True)
class GGUFHeader:
    fields: dict    # key -> scalar or string value (arrays are left out)
    lengths: dict   # array key -> item count
    tensors: tuple  # tensor names


def gguf_header(path: Path) -> GGUFHeader:
    """The header of the GGUF at path (remembered per file and change time). Raises on a corrupt file."""
    st = Path(path).stat()
    return _header(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _header(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _Walk(m).header()
    except _Unhandled:
        return _from_reader(path)


class _Unhandled(Exception):
    pass


class _Walk:
    def __init__(self, buf):
        self.buf, self.pos = buf, 4  # after the magic

    def take(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        self.pos += n
        if self.pos > len(self.buf):
            raise ValueError("string past the end of the file")
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8", errors="replace")

    def header(self) -> GGUFHeader:
        if self.take("<I") not in (2, 3):  # v1 or a big-endian file
            raise _Unhandled
        n_tensors, n_kv = self.take("<Q"), self.take("<Q")
        fields, lengths = {}, {}
        for _ in range(n_kv):
            key, kind = self.string(), GGUFValueType(self.take("<I"))
            if kind == GGUFValueType.ARRAY:
                item, count = GGUFValueType(self.take("<I")), self.take("<Q")
                lengths[key] = count
                if item == GGUFValueType.STRING:
                    for _ in range(count):
                        n = self.take("<Q")
                        self.pos += n
                elif item in _SCALAR:
                    self.pos += count * struct.calcsize(_SCALAR[item])
                else:
                    raise _Unhandled
            else:
                fields[key] = self.string() if kind == GGUFValueType.STRING else self.take(_SCALAR[kind])
        names = []
        for _ in range(n_tensors):
            names.append(self.string())
            dims = self.take("<I")
            self.pos += 8 * dims + 4 + 8  # dims, type, offset
        if self.pos > len(self.buf):
            raise ValueError("tensor infos past the end of the file")
        return GGUFHeader(fields, lengths, tuple(names))


def _from_reader(path: str) -> GGUFHeader:
    reader = GGUFReader(path)
    fields, lengths = {}, {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == GGUFValueType.ARRAY:
            lengths[key] = len(field.data)
        else:
            fields[key] = field.contents()
    return GGUFHeader(fields, lengths, tuple(t.name for t in reader.tensors))
