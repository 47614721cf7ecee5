"""numpy views of tensorshm tensors for dtypes numpy's own DLPack import cannot express
(bfloat16, float8, int4, ... from ml_dtypes), and numpy inputs of those dtypes for put()."""

from __future__ import annotations

from typing import Any

from . import _tensorshm


def numpy_dtype(name: str) -> Any:
    """The numpy dtype for a tensorshm dtype name, using ml_dtypes for the ones numpy lacks."""
    import numpy as np

    try:
        return np.dtype(name)
    except TypeError:
        pass
    try:
        import ml_dtypes
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise TypeError(f"dtype {name!r} needs the ml_dtypes package") from e
    try:
        return np.dtype(getattr(ml_dtypes, name))
    except AttributeError as e:
        raise TypeError(f"dtype {name!r} has no numpy equivalent") from e


def to_numpy(tensor: _tensorshm.Tensor) -> Any:
    """A zero-copy numpy array over ``tensor``'s memory, read-only if the tensor is.

    Works for every dtype numpy or ml_dtypes can express, including sub-byte types stored one
    element per byte (``subbyte_padded``); packed sub-byte tensors have no numpy layout.
    """
    import numpy as np

    dtype = numpy_dtype(tensor.dtype)
    bits = _tensorshm._dtype_fields(tensor.dtype)[1]
    if bits < 8 and not tensor.subbyte_padded:
        raise TypeError(
            f"{tensor!r} stores {tensor.dtype} packed; numpy keeps one element per byte "
            "(create such tensors with subbyte_padded=True)"
        )
    raw, element0 = tensor._raw_storage()
    buffer = memoryview(raw)  # read-only when the tensor is
    if buffer.nbytes == 0:
        empty = np.empty(tensor.shape, dtype=dtype)
        empty.flags.writeable = not tensor.read_only
        return empty
    strides = tuple(s * dtype.itemsize for s in tensor.strides)
    # ndarray keeps `buffer` (and through it the tensor's memory) alive as its base.
    return np.ndarray(tensor.shape, dtype=dtype, buffer=buffer, offset=element0, strides=strides)
