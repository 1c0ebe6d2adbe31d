"""Reading ONNX files without onnx's external-data loader, for every stage: that loader refuses the hard-linked
files an engine set shares with its build cache (a guard against hard-link attacks), so weights are read here by
their recorded offsets instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def read_initializers(onnx_path: Path, *names: str) -> list[np.ndarray]:
    """Initializers of a saved model by name, each read from where it lives (inline or in its external data
    file) without loading the rest; onnx's own external-data loader refuses the hard-linked files an engine
    set shares with the build cache."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    tensors = {t.name: t for t in model.graph.initializer if t.name in names}
    out = []
    for name in names:
        t = tensors[name]
        if t.data_location != TensorProto.EXTERNAL:
            out.append(numpy_helper.to_array(t))
            continue
        info = {e.key: e.value for e in t.external_data}
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
        data = np.fromfile(Path(onnx_path).parent / info["location"], dtype,
                           count=int(info["length"]) // dtype.itemsize, offset=int(info.get("offset", 0)))
        out.append(data.reshape(list(t.dims)))
    return out


def load_with_weights(onnx_path: Path) -> onnx.ModelProto:
    """The whole model at onnx_path, external weights read into its initializers."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    external = [t.name for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    arrays = dict(zip(external, read_initializers(onnx_path, *external)))
    for t in model.graph.initializer:
        if t.name in arrays:
            t.CopyFrom(numpy_helper.from_array(arrays[t.name], t.name))
    return model


def save_with_external_data(model: onnx.ModelProto, path: Path, **kwargs) -> None:
    """onnx.save_model with the weights in path + ".data", readable as the rest of an engine set is (onnx writes
    that file 0600; engines are meant to be shared, e.g. built by one user and served by another)."""
    onnx.save_model(model, str(path), save_as_external_data=True, location=Path(path).name + ".data",
                    size_threshold=1024, **kwargs)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(str(path) + ".data", 0o666 & ~umask)
