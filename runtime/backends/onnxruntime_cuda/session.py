"""The CUDA EP's sessions: a session of a graph on onnxruntime-gpu's CUDA execution provider, enqueueing on a
stream of ours, with CUDA graphs where the EP captures them, and the one-line refusal where there is no CUDA EP."""

from __future__ import annotations

from pathlib import Path

from ....errors import SpecrtError, first_line

MAX_PASS_TOKENS = 64
EAGLE_ROWS = 2048  # rows of one EAGLE head call, as TensorRT's prefill profile (pipeline/portable.py): more in chunks
CUDA_EP = "CUDAExecutionProvider"
NO_CUDA = ("onnxruntime-cuda: this onnxruntime runs on the CPU only ({}); pip install onnxruntime-gpu on a machine "
           "with CUDA, or build with --backend onnxruntime-portable")


def require_cuda_provider(providers: list[str]) -> None:
    """Refuse in one line unless `providers` (ort.get_available_providers(), or a session's get_providers())
    include the CUDA execution provider."""
    if CUDA_EP not in providers:
        raise SpecrtError(NO_CUDA.format("providers: " + ", ".join(providers)))


def open_session(onnx_path: Path, stream: int, threads: int = 0, graphs: bool = True):
    """(an InferenceSession of onnx_path on the CUDA EP, enqueueing on `stream`; why graphs are off, or None).
    A CUDA EP that will not capture this graph (ORT refuses at session creation) gives a session without graphs."""
    import onnxruntime as ort

    require_cuda_provider(ort.get_available_providers())
    try:  # CUDA and cuDNN from torch or nvidia-* wheels, which the loader would not find on its own
        ort.preload_dlls()
    except Exception:  # noqa: BLE001 -- best effort: a missing library fails the session below, in one line
        pass
    def session(capture: bool):
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = threads
        so.enable_mem_pattern = not capture  # memory patterns allocate per shape, which a replay cannot
        options = {"device_id": "0", "user_compute_stream": str(stream), "enable_cuda_graph": str(int(capture))}
        # enable_fallback=0: a CUDA EP that fails to load raises here instead of ORT rebuilding the session on
        # the CPU, so a failure tied to graphs gets its retry without them
        return ort.InferenceSession(str(onnx_path), so, providers=[(CUDA_EP, options)], enable_fallback=0)

    note = None
    try:
        try:
            s = session(graphs)
        except MemoryError:
            raise
        except Exception as e:
            if not graphs:
                raise
            note = f"the CUDA EP would not capture this graph: {first_line(e)}"
            s = session(False)
    except MemoryError:
        raise
    except Exception as e:
        raise SpecrtError(f"cannot load engine '{onnx_path}' on the CUDA EP ({first_line(e)}); "
                          "rebuild the engine set with `specrt engines --backend onnxruntime-cuda`") from None
    require_cuda_provider(s.get_providers())
    return s, note
