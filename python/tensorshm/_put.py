"""put's dispatch: how an object is copied into a new tensor (the DLPack C exchange API, a
DLPack capsule, an Arrow fixed_shape_tensor array, or a numpy array of an ml_dtypes type)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from . import _tensorshm
from ._errors import InvalidArgumentError
from ._numpy import to_numpy
from ._tensorshm import Tensor

if TYPE_CHECKING:
    from ._client import Client

DLPACK_VERSION = (1, 3)


def put(client: Client, name: str, obj: Any, replace: bool, timeout: float | None,
        cancel: _tensorshm._WaitCanceller | None) -> Tensor:
    """Client.put; with ``cancel`` (aput, in a worker thread) the owned ``__dlpack__`` export is
    preferred, as its copy runs with the GIL released."""
    native = client._native
    timeout = None if timeout is None else float(timeout)
    if _is_numpy_scalar(obj):
        import numpy as np

        obj = np.asarray(obj)
    _refuse_what_no_tensor_holds(name, obj)
    cls = type(obj)
    api = getattr(cls, "__dlpack_c_exchange_api__", None)
    if api is None:
        api = getattr(cls, "__c_dlpack_exchange_api__", None)
    if api is not None and (cancel is None or not hasattr(obj, "__dlpack__")):
        return native.put_exchange(name, obj, api, replace, timeout)
    arrow = _exports_arrow_array(obj)
    if hasattr(obj, "__dlpack__"):
        try:
            try:
                capsule = obj.__dlpack__(max_version=DLPACK_VERSION)
            except TypeError:
                capsule = obj.__dlpack__()
        except BufferError:
            if _is_numpy_array(obj):
                return _put_numpy(client, name, obj, replace, timeout, cancel)
            if arrow:
                return _put_arrow(native, name, obj, replace, timeout, cancel)
            raise
        except Exception:
            # e.g. pyarrow refusing arrays with nulls: the Arrow path says why, or copies
            # what DLPack could not export.
            if arrow:
                return _put_arrow(native, name, obj, replace, timeout, cancel)
            raise
        return native.put_capsule(name, capsule, replace, timeout, cancel)
    if arrow:
        return _put_arrow(native, name, obj, replace, timeout, cancel)
    if type(obj).__name__ == "PyCapsule":
        return native.put_capsule(name, obj, replace, timeout, cancel)
    if hasattr(obj, "__arrow_c_stream__"):
        raise TypeError(
            f"put({name!r}, ...): {cls.__module__}.{cls.__qualname__} exports an Arrow "
            "stream (e.g. a ChunkedArray or a Table), not one array: pass one array "
            "(e.g. chunked.combine_chunks())"
        )
    raise TypeError(
        f"put({name!r}, ...): {cls.__module__}.{cls.__qualname__} is not a DLPack producer "
        "(no __dlpack_c_exchange_api__ or __dlpack__) and exports no Arrow array "
        "(__arrow_c_device_array__ or __arrow_c_array__)"
    )


def _put_arrow(native: _tensorshm._Client, name: str, obj: Any, replace: bool,
               timeout: float | None, cancel: _tensorshm._WaitCanceller | None) -> Tensor:
    """Copy an Arrow array of type arrow.fixed_shape_tensor into a new tensor; the Arrow
    array is released once copied."""
    if hasattr(obj, "__arrow_c_device_array__"):
        schema, array = obj.__arrow_c_device_array__()
    else:
        schema, array = obj.__arrow_c_array__()
    capsule = native.arrow_to_dlpack(schema, array)
    return native.put_capsule(name, capsule, replace, timeout, cancel)


def _put_numpy(client: Client, name: str, array: Any, replace: bool, timeout: float | None,
               cancel: _tensorshm._WaitCanceller | None) -> Tensor:
    """numpy arrays of ml_dtypes types, which numpy's __dlpack__ refuses: copy through a view."""
    import numpy as np

    w = client._create(array.shape, array.dtype.name, "cpu", None, None, timeout, cancel)
    np.copyto(to_numpy(w), array, casting="no")
    w.publish(name, replace)
    return w


# numpy kinds with no DLPack type, and what to do instead.
_ENCODE_TEXT = "encode text or bytes as uint8 first, e.g. np.frombuffer(text.encode(), np.uint8)"
_NO_TENSOR_KINDS = {
    "O": ("Python objects", _ENCODE_TEXT),
    "S": ("bytes", _ENCODE_TEXT),
    "U": ("str", _ENCODE_TEXT),
    "T": ("str", _ENCODE_TEXT),
    "V": ("structured records", "pass each field as an array of its own"),
    "M": ("datetimes", "pass array.view(np.int64), the counts of its unit"),
    "m": ("time spans", "pass array.view(np.int64), the counts of its unit"),
}


def _refuse_what_no_tensor_holds(name: str, obj: Any) -> None:
    """Python sequences and numbers, numpy arrays of objects, strings or records, and
    big-endian arrays: refused naming what to pass instead (before numpy's own errors)."""
    if isinstance(obj, (list, tuple, int, float, complex)):
        kind = type(obj).__name__
        raise TypeError(
            f"put({name!r}, ...): a {kind} is not a tensor: pass np.asarray(value) (or "
            "torch.tensor(value), or any other DLPack producer)")
    np = sys.modules.get("numpy")
    if np is None or not isinstance(obj, np.ndarray):
        return
    masked = sys.modules.get("numpy.ma")  # not imported: no masked array exists
    if masked is not None and isinstance(obj, masked.MaskedArray):
        raise InvalidArgumentError(
            f"put({name!r}, ...): a masked array: a tensor has no mask, and the masked values "
            "would be shared as they are; pass array.filled(value) (and the mask as an array of "
            "its own, if it matters)")
    dtype = obj.dtype
    # ml_dtypes' types (bfloat16, float8_*) are of kind 'V' too, each with a scalar type of its
    # own: only numpy's void (raw bytes, structured records) is refused.
    if dtype.kind in _NO_TENSOR_KINDS and (dtype.kind != "V" or dtype.type is np.void):
        holds, instead = _NO_TENSOR_KINDS[dtype.kind]
        raise InvalidArgumentError(
            f"put({name!r}, ...): dtype = {dtype.str!r} (numpy kind {dtype.kind!r}, {holds}): a "
            "tensor holds numbers (bool, int, uint, float, complex, and ml_dtypes' bfloat16 and "
            f"float8 types); {instead}")
    if dtype.byteorder == ">":
        raise InvalidArgumentError(
            f"put({name!r}, ...): dtype = {dtype.str!r} is big-endian, and a tensor's bytes are "
            "little-endian (as DLPack's): pass array.astype(array.dtype.newbyteorder('='))")


def _is_numpy_scalar(obj: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, np.generic)


def _exports_arrow_array(obj: Any) -> bool:
    return hasattr(obj, "__arrow_c_device_array__") or hasattr(obj, "__arrow_c_array__")


def _is_numpy_array(obj: Any) -> bool:
    cls = type(obj)
    return cls.__module__ == "numpy" and cls.__name__ == "ndarray"
