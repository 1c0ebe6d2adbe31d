"""Device memory of the GPU backends (TensorRT, ONNX Runtime's CUDA EP): buffers, one stream, and the KV-cache
copies of the static-shape protocol (runtime/static_shapes.py) done on the device.

Everything a GPU engine does to memory goes through a `Memory`: allocate zeroed bytes once, upload inputs and
download outputs asynchronously on the engine's one stream, device-to-device 2-D copies, and one sync per pass.
`CudaMemory` is that interface over cuda-bindings (imported lazily, so this module loads without a GPU);
`HostMemory` is the same interface over host memory, so the engines' bookkeeping (padding, capacity changes,
tree commits, which bytes go back) runs on the CPU in tests, through an ONNX Runtime CPU session bound to the
same raw addresses.

More: docs/runtime-notes.md, "Module notes: runtime/backends/device/memory.py".
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ....errors import SpecrtError
from ....interface import KV_KINDS
from ...engine import tree_moves

INSTALL = ("`pip install cuda-bindings` (NVIDIA's CUDA Python bindings; `cuda-bindings==12.*` where the driver is "
           "CUDA 12's) on a machine with an NVIDIA GPU and driver, or build the engines with --backend "
           "onnxruntime-portable for the CPU")


def cudart():
    """cuda-bindings' runtime module, imported now (a one-line SpecrtError when it is not installed)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        raise SpecrtError(f"the GPU backends need cuda-bindings, which is not installed: {INSTALL}") from None
    return runtime


def check(result, what: str):
    """A cuda-bindings call's (error, *values) -> its values (one alone as itself, none as None); an error is a
    one-line SpecrtError naming the call (`what`) and CUDA's own name and description of the error."""
    rt = cudart()
    err, values = result[0], result[1:]
    if err != rt.cudaError_t.cudaSuccess:
        name, desc = rt.cudaGetErrorName(err)[1], rt.cudaGetErrorString(err)[1]
        raise SpecrtError(f"CUDA error in {what}: {name.decode()} ({desc.decode()}); check the GPU with `nvidia-smi` "
                          "(driver loaded, memory free)")
    return None if not values else values[0] if len(values) == 1 else values


def device_count() -> tuple[int, str]:
    """(CUDA devices visible here, why none when 0): no cuda-bindings, no driver and no GPU all count as none."""
    try:
        rt = cudart()
    except SpecrtError as e:
        return 0, str(e)
    err, n = rt.cudaGetDeviceCount()
    if err != rt.cudaError_t.cudaSuccess:
        return 0, rt.cudaGetErrorName(err)[1].decode()
    return int(n), "" if n else "no CUDA device"


def require_device(backend: str) -> None:
    """Refuse in one line where no CUDA device can run `backend`'s engines (or cuda-bindings is missing)."""
    cudart()
    n, why = device_count()
    if not n:
        raise SpecrtError(f"{backend}: no NVIDIA GPU is usable here ({why}); run on a machine with one, or build "
                          "the engines with --backend onnxruntime-portable for the CPU")


def compute_capability(device: int = 0) -> str:
    """The compute capability of `device`, as build/tensorrt.py records it (e.g. "9.0")."""
    rt = cudart()
    attr = rt.cudaDeviceAttr
    major = check(rt.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute")
    minor = check(rt.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute")
    return f"{major}.{minor}"


@dataclass(frozen=True)
class Copy2D:
    """`height` rows of `width` bytes, device to device: row r from src + r * spitch to dst + r * dpitch."""

    dst: int
    dpitch: int
    src: int
    spitch: int
    width: int
    height: int


class Memory(Protocol):
    """What a GPU engine needs from device memory (CudaMemory; HostMemory in tests). Addresses are ints."""

    stream: int  # the stream handle libraries enqueue on (0 on the host)

    def alloc(self, nbytes: int) -> int:
        """nbytes of zeroed memory, kept until close(): a NaN in a cache slot the mask hides still poisons (0 * NaN)."""

    def host(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A host array downloads land in (page-locked on a GPU, so the copies are asynchronous), kept until close()."""

    def upload(self, dst: int, host: np.ndarray) -> None:
        """Copy a C-contiguous host array to dst (queued on the stream)."""

    def download(self, host: np.ndarray, src: int) -> None:
        """Copy host.nbytes bytes from src into a C-contiguous host array (queued; valid after sync())."""

    def copy2d(self, c: Copy2D) -> None:
        """One device-to-device copy (queued)."""

    def sync(self) -> None:
        """Wait for everything queued on the stream."""

    def close(self) -> None:
        """Free everything allocated here."""


class CudaMemory:
    """Memory on CUDA device 0 through cuda-bindings, with one non-blocking stream for the engine's passes."""

    def __init__(self):
        rt = self._rt = cudart()
        kinds = rt.cudaMemcpyKind
        self._h2d, self._d2h, self._d2d = kinds.cudaMemcpyHostToDevice, kinds.cudaMemcpyDeviceToHost, \
            kinds.cudaMemcpyDeviceToDevice
        self._stream = check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
        self.stream = int(self._stream)
        self._device: list[int] = []
        self._pinned: list[int] = []

    def alloc(self, nbytes: int) -> int:
        ptr = int(check(self._rt.cudaMalloc(max(nbytes, 1)), f"cudaMalloc({nbytes} bytes)"))
        self._device.append(ptr)
        # on the engine's stream: a memset on the legacy default stream would not order with a non-blocking one
        check(self._rt.cudaMemsetAsync(ptr, 0, max(nbytes, 1), self._stream), "cudaMemsetAsync")
        return ptr

    def host(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        nbytes = max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1)
        ptr = int(check(self._rt.cudaMallocHost(nbytes), f"cudaMallocHost({nbytes} bytes)"))
        self._pinned.append(ptr)
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        return raw[: int(np.prod(shape)) * np.dtype(dtype).itemsize].view(dtype).reshape(shape)

    def upload(self, dst: int, host: np.ndarray) -> None:
        assert host.flags.c_contiguous
        check(self._rt.cudaMemcpyAsync(dst, host.ctypes.data, host.nbytes, self._h2d, self._stream), "cudaMemcpyAsync")

    def download(self, host: np.ndarray, src: int) -> None:
        assert host.flags.c_contiguous
        check(self._rt.cudaMemcpyAsync(host.ctypes.data, src, host.nbytes, self._d2h, self._stream), "cudaMemcpyAsync")

    def copy2d(self, c: Copy2D) -> None:
        check(self._rt.cudaMemcpy2DAsync(c.dst, c.dpitch, c.src, c.spitch, c.width, c.height, self._d2d,
                                         self._stream), "cudaMemcpy2DAsync")

    def sync(self) -> None:
        check(self._rt.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")

    def close(self) -> None:
        rt = self._rt
        for ptr in self._device:
            rt.cudaFree(ptr)
        for ptr in self._pinned:
            rt.cudaFreeHost(ptr)
        self._device, self._pinned = [], []
        if self._stream is not None:
            rt.cudaStreamDestroy(self._stream)
            self._stream = None


class HostMemory:
    """The Memory interface over host memory, synchronously: the GPU engines' bookkeeping on the CPU, for tests.
    It refuses a copy whose source and destination overlap (undefined on CUDA)."""

    stream = 0

    def __init__(self):
        self._keep: list[np.ndarray] = []

    def alloc(self, nbytes: int) -> int:
        buf = np.zeros(max(nbytes, 1) + 64, np.uint8)
        self._keep.append(buf)
        return -(-buf.ctypes.data // 64) * 64  # 64-byte aligned, like any cudaMalloc

    def host(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        arr = np.zeros(shape, dtype)
        self._keep.append(arr)
        return arr

    def upload(self, dst: int, host: np.ndarray) -> None:
        ctypes.memmove(dst, np.ascontiguousarray(host).ctypes.data, host.nbytes)

    def download(self, host: np.ndarray, src: int) -> None:
        assert host.flags.c_contiguous
        ctypes.memmove(host.ctypes.data, src, host.nbytes)

    def copy2d(self, c: Copy2D) -> None:
        src_end, dst_end = c.src + (c.height - 1) * c.spitch + c.width, c.dst + (c.height - 1) * c.dpitch + c.width
        if c.src < dst_end and c.dst < src_end:  # ranges overlap: only safe if no row meets another
            rows_src = {(c.src + r * c.spitch, c.src + r * c.spitch + c.width) for r in range(c.height)}
            rows_dst = [(c.dst + r * c.dpitch, c.dst + r * c.dpitch + c.width) for r in range(c.height)]
            if any(a < e and s < b for a, b in rows_dst for s, e in rows_src):
                raise AssertionError(f"overlapping device copy {c}")
        for r in range(c.height):
            ctypes.memmove(c.dst + r * c.dpitch, c.src + r * c.spitch, c.width)

    def sync(self) -> None:
        pass

    def close(self) -> None:
        self._keep = []


def relayout_plan(buffer: int, scratch: int, heads: int, row: int, old: int, new: int, length: int) -> list[Copy2D]:
    """static_shapes.relayout on the device: the copies that keep the first `length` positions of each head when a
    buffer laid out [heads, old, row bytes] is viewed as [heads, new, row bytes]. The two layouts share the buffer
    and overlap, so the rows go out to scratch ([heads, length, row], packed) and back in two copies."""
    if not length or old == new:
        return []
    width = length * row
    return [Copy2D(scratch, width, buffer, old * row, width, heads),
            Copy2D(buffer, new * row, scratch, width, width, heads)]


def relayout_device(memory: Memory, buffer: int, scratch: int, heads: int, row: int, old: int, new: int,
                    length: int) -> None:
    """static_shapes.relayout for a device buffer: queue relayout_plan's copies on memory's stream."""
    for c in relayout_plan(buffer, scratch, heads, row, old, new, length):
        memory.copy2d(c)


def commit_plan(buffer: int, scratch: int, heads: int, row: int, capacity: int, src: np.ndarray,
                dst: np.ndarray) -> list[Copy2D]:
    """A tree commit on the device: the copies that move cache slot src[i] to dst[i] for every head of a buffer laid
    out [heads, capacity, row bytes], with numpy's `view[:, :, dst] = view[:, :, src]` semantics (every source read
    before any write). Slots that stay put are skipped and consecutive slots move as one copy; the moves go
    directly when no destination meets a source still to be read, else through scratch ([heads, moved, row])."""
    moved = [(int(s), int(d)) for s, d in zip(src, dst) if s != d]
    if not moved:
        return []
    runs: list[list[int]] = []  # [src, dst, count]: consecutive slots in both
    for s, d in moved:
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    pitch = capacity * row
    clash = any(d < s2 + k2 and s2 < d + k for i, (_, d, k) in enumerate(runs) for s2, _, k2 in runs[i:])
    if not clash:
        return [Copy2D(buffer + d * row, pitch, buffer + s * row, pitch, k * row, heads) for s, d, k in runs]
    m, out, j = len(moved), [], 0
    for s, _, k in runs:
        out.append(Copy2D(scratch + j * row, m * row, buffer + s * row, pitch, k * row, heads))
        j += k
    j = 0
    for _, d, k in runs:
        out.append(Copy2D(buffer + d * row, pitch, scratch + j * row, m * row, k * row, heads))
        j += k
    return out


def rows_plan(dst: int, row: int, addresses) -> list[Copy2D]:
    """The copies that gather rows of `row` bytes from `addresses` (in order) into dst, packed: rows that lie one
    after the other at their source go as one copy."""
    out: list[Copy2D] = []
    j = 0
    for a in (int(x) for x in addresses):
        if not a:
            raise ValueError("a feature row that is no longer on the device (an earlier chunk's output)")
        last = out[-1] if out else None
        if last is not None and a == last.src + last.width:
            out[-1] = Copy2D(last.dst, last.width + row, last.src, last.width + row, last.width + row, 1)
        else:
            out.append(Copy2D(dst + j * row, row, a, row, row, 1))
        j += 1
    return out


class DeviceRows:
    """Rows of float32 features on the device, by address (row i at addresses[i]): what an EAGLE head on the GPU
    takes and gives in place of host arrays, so they never cross to the host. epoch: the head call whose outputs
    they are (None: rows kept by target position), which a head checks, as the next call overwrites them."""

    def __init__(self, addresses, epoch: int | None = None):
        self.addresses, self.epoch = np.asarray(addresses, np.int64).reshape(-1), epoch

    def __len__(self) -> int:
        return len(self.addresses)

    def __getitem__(self, key) -> "DeviceRows":
        return DeviceRows(self.addresses[key], self.epoch)

    def join(self, rows: list["DeviceRows"]) -> "DeviceRows":
        """rows one after the other (a tree level's inputs); of one epoch, else of none that a head accepts."""
        epochs = {r.epoch for r in rows}
        return DeviceRows(np.concatenate([r.addresses for r in rows]), epochs.pop() if len(epochs) == 1 else -1)


class DeviceCache:
    """A static-shape engine's KV cache in device memory: one buffer per (layer, key|value) of max_capacity
    positions for each of `slots` sequences, viewed as a contiguous [slots, kv_heads, capacity, head_dim] tensor for
    the current capacity (so an address never changes, which CUDA graphs need; slot s's [1, kv_heads, capacity,
    head_dim] starts at `slot_ptr(ptr, s)`), and one scratch buffer for the copies that overlap."""

    def __init__(self, memory: Memory, layers: int, kv_heads: int, head_dim: int, dtype, max_capacity: int,
                 slots: int = 1):
        self.memory, self.heads, self.head_dim, self.dtype = memory, kv_heads, head_dim, np.dtype(dtype)
        self.slots = slots
        self.row = head_dim * self.dtype.itemsize  # bytes per position per head
        size = slots * kv_heads * max_capacity * self.row
        self.ptrs = [[memory.alloc(size) for _ in KV_KINDS] for _ in range(layers)]
        self._scratch = memory.alloc(size)
        self.max_capacity, self.capacity = max_capacity, 0

    def shape(self) -> tuple[int, int, int, int]:
        """One slot's view."""
        return 1, self.heads, self.capacity, self.head_dim

    def slot_ptr(self, ptr: int, slot: int) -> int:
        return ptr + slot * self.heads * self.capacity * self.row

    def relayout(self, capacity: int, length: int) -> None:
        """Lay every buffer out for `capacity` positions, keeping the first `length` of every slot (queued)."""
        if capacity > self.max_capacity:
            raise ValueError(f"capacity {capacity} exceeds the allocated {self.max_capacity}")
        for layer in self.ptrs:
            for ptr in layer:
                relayout_device(self.memory, ptr, self._scratch, self.slots * self.heads, self.row, self.capacity,
                                capacity, length)
        self.capacity = capacity

    def commit(self, length: int, path: np.ndarray, slot: int = 0) -> None:
        """Move the accepted nodes' entries: slot length + path[i] -> length + i, every layer and kind (queued)."""
        moves = tree_moves(length, len(path), path)
        if moves is not None:
            self.move(*moves, slot=slot)

    def move(self, src: np.ndarray, dst: np.ndarray, slot: int = 0) -> None:
        """Cache positions src[i] -> dst[i] of one slot, every layer and kind (queued; numpy's fancy-index
        semantics: every source read before any write)."""
        for layer in self.ptrs:
            for ptr in layer:
                for c in commit_plan(self.slot_ptr(ptr, slot), self._scratch, self.heads, self.row, self.capacity,
                                     src, dst):
                    self.memory.copy2d(c)

    def save(self, length: int, slot: int = 0) -> list[np.ndarray]:
        """The first `length` positions of every buffer, on the host ([1, kv_heads, length, head_dim] each; syncs)."""
        return [self.read(i, j, slot)[:, :, :length].copy() for i in range(len(self.ptrs))
                for j in range(len(KV_KINDS))]

    def load(self, arrays: list[np.ndarray], slot: int = 0) -> None:
        """Write save()'s arrays back at the current capacity, one upload per buffer (queued; past their length
        each buffer gets zeros, which the mask hides)."""
        if len(arrays) != len(self.ptrs) * len(KV_KINDS):
            raise ValueError(f"a snapshot of {len(arrays)} buffers does not fit a cache of "
                             f"{len(self.ptrs) * len(KV_KINDS)}")
        host = np.zeros(self.shape(), self.dtype)
        ptrs = [ptr for layer in self.ptrs for ptr in layer]
        for ptr, arr in zip(ptrs, arrays):
            host[:, :, :arr.shape[2]] = arr
            host[:, :, arr.shape[2]:] = 0
            self.memory.upload(self.slot_ptr(ptr, slot), host)
            self.memory.sync()  # host is reused for the next buffer

    def read(self, layer: int, kind: int, slot: int = 0) -> np.ndarray:
        """The [1, kv_heads, capacity, head_dim] contents of one slot's buffer, on the host (syncs)."""
        out = np.empty(self.shape(), self.dtype)
        self.memory.download(out, self.slot_ptr(self.ptrs[layer][kind], slot))
        self.memory.sync()
        return out
