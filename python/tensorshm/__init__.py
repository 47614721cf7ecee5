"""tensorshm: share tensors between processes through shared memory, zero-copy, over DLPack.

    import tensorshm, numpy as np
    client = tensorshm.connect()
    client.put("batch/17", np.arange(12, dtype=np.float32).reshape(3, 4))
    t = client.get("batch/17")          # zero-copy, read-only
    a = np.from_dlpack(t)               # or torch.from_dlpack(t), tvm_ffi.from_dlpack(t)
"""

from __future__ import annotations

import os
import sys
from typing import Any

from . import _tensorshm
from ._errors import (
    AlreadyExistsError,
    CancelledError,
    ConnectionError,
    DataLossError,
    Error,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionError,
    ResourceExhaustedError,
    TimeoutError,
    UnimplementedError,
)
from ._numpy import to_numpy
from ._tensorshm import Tensor, WritableTensor

__all__ = [
    "AlreadyExistsError",
    "CancelledError",
    "Client",
    "ConnectionError",
    "DataLossError",
    "Error",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "PermissionError",
    "ResourceExhaustedError",
    "Tensor",
    "TimeoutError",
    "UnimplementedError",
    "WritableTensor",
    "connect",
    "to_numpy",
]

__version__ = "0.1.0"

_DLPACK_VERSION = (1, 3)


def _dtype_name(dtype: Any) -> str:
    """A tensorshm dtype name from a string, a numpy dtype, or a numpy / ml_dtypes scalar type."""
    if isinstance(dtype, str):
        name = dtype
    else:
        name = getattr(dtype, "name", None) or getattr(dtype, "__name__", None)
        if name is None:
            try:
                import numpy as np

                name = np.dtype(dtype).name
            except Exception as e:  # noqa: BLE001 - any failure means "not a dtype"
                raise InvalidArgumentError(f"dtype = {dtype!r}: not a dtype") from e
    _tensorshm._dtype_fields(name)  # raises InvalidArgumentError naming the dtype if unknown
    return name


class Client:
    """A connection (one session) to tensorshmd. Thread-safe.

    Tensors obtained through a client stay valid after it is closed or garbage collected, until
    they themselves are released.

    If the daemon restarts, the client reconnects on its own (a new ``session_id``); calls made
    meanwhile raise ConnectionError or FailedPreconditionError and may be retried. Tensors stay
    mapped and readable throughout; what the restarted daemon did not take back is reported:
    ``flush()`` raises DataLossError once, and such tensors' ``alive`` turns False.

    A client belongs to the process that connected: in a child made by ``fork()`` (e.g.
    multiprocessing's "fork" start method) its methods raise FailedPreconditionError, and
    dropping it or its tensors there leaves the parent's session alone. Connect again in the
    child.
    """

    def __init__(self, native: _tensorshm._Client) -> None:
        self._native = native

    @property
    def session_id(self) -> str:
        return self._native.session_id

    def create(self, shape: Any, dtype: Any = "float32", device: str = "cpu", *,
               strides: Any = None, subbyte_padded: bool | None = None,
               timeout: float | None = 0) -> WritableTensor:
        """Allocate a writable tensor; fill it through ``np.from_dlpack(w)`` or
        ``tensorshm.to_numpy(w)``, then ``w.publish(name)``.

        Sub-byte dtypes (int4, float4_e2m1fn, ...) are stored one element per byte by default,
        as numpy and ml_dtypes keep them; ``subbyte_padded=False`` packs them.

        ``device``: ``"cpu"``, or ``"cuda:N"`` (this process's numbering) for device memory from
        the daemon's pool on that GPU (``--cuda-pool``); fill it through DLPack (e.g.
        ``torch.from_dlpack(w)``) on any stream, then publish (a ready event is recorded on the
        legacy default stream).

        ``timeout``: when the pool cannot hold the tensor, 0 raises ResourceExhaustedError at
        once; seconds waits that long in the daemon for memory to be freed (a delete, a lease
        ending, a client leaving, an eviction) before raising it; None waits until memory comes.
        Waiting creates are served in order, per pool.
        """
        if isinstance(shape, int):
            shape = (shape,)
        name = _dtype_name(dtype)
        bits = _tensorshm._dtype_fields(name)[1]
        padded = bits < 8 if subbyte_padded is None else subbyte_padded
        return self._native.create(
            [int(d) for d in shape], name, None if strides is None else [int(s) for s in strides],
            device, padded, None if timeout is None else float(timeout),
        )

    def get(self, name: str, timeout: float | None = 0) -> Tensor:
        """Acquire the tensor published as ``name``, zero-copy and read-only.

        Read-only is enforced for host tensors (a read-only mapping) and advisory for CUDA tensors:
        CUDA IPC opens the device memory writable, so nothing stops a write through the pointer.

        ``timeout``: 0 raises NotFoundError at once if the name is not published; seconds waits
        that long for a publish (then TimeoutError); None waits until it is published.
        """
        return self._native.get(name, None if timeout is None else float(timeout))

    def put(self, name: str, obj: Any, replace: bool = False, *,
            timeout: float | None = 0) -> Tensor:
        """Copy any DLPack producer (numpy, torch, tvm-ffi, JAX, a DLPack capsule, ...) into a new
        shared buffer, publish it as ``name``, and return it (read-only, leased).

        The producer is asked the way the DLPack spec says: ``type(obj).__dlpack_c_exchange_api__``
        first (then the older ``__c_dlpack_exchange_api__``), else ``obj.__dlpack__(max_version=
        (1, 3))``, falling back to the legacy ``obj.__dlpack__()`` on TypeError.
        A C-contiguous CUDA tensor is copied device to device into the daemon's pool on that GPU,
        on the producer's stream, and published with a ready event.

        Objects without a DLPack export (or whose DLPack export fails) that export an Arrow
        array of the canonical extension type ``arrow.fixed_shape_tensor``
        (``__arrow_c_device_array__`` or ``__arrow_c_array__``: pyarrow's
        FixedShapeTensorArray, nanoarrow arrays, ...) are copied into a tensor of shape
        ``(len(array), *element_shape)``; arrays with nulls, of other types or with a
        non-identity ``permutation`` are refused with InvalidArgumentError saying why. CUDA
        arrays are copied after their ``sync_event``.

        ``timeout``: how long the copy's buffer may wait for memory in a full pool, as
        ``create``'s.
        """
        timeout = None if timeout is None else float(timeout)
        if _is_numpy_scalar(obj):
            import numpy as np

            obj = np.asarray(obj)
        cls = type(obj)
        api = getattr(cls, "__dlpack_c_exchange_api__", None)
        if api is None:
            api = getattr(cls, "__c_dlpack_exchange_api__", None)
        if api is not None:
            return self._native.put_exchange(name, obj, api, replace, timeout)
        arrow = _exports_arrow_array(obj)
        if hasattr(obj, "__dlpack__"):
            try:
                try:
                    capsule = obj.__dlpack__(max_version=_DLPACK_VERSION)
                except TypeError:
                    capsule = obj.__dlpack__()
            except BufferError:
                if _is_numpy_array(obj):
                    return self._put_numpy(name, obj, replace, timeout)
                if arrow:
                    return self._put_arrow(name, obj, replace, timeout)
                raise
            except Exception:
                # e.g. pyarrow refusing arrays with nulls: the Arrow path says why, or copies
                # what DLPack could not export.
                if arrow:
                    return self._put_arrow(name, obj, replace, timeout)
                raise
            return self._native.put_capsule(name, capsule, replace, timeout)
        if arrow:
            return self._put_arrow(name, obj, replace, timeout)
        if type(obj).__name__ == "PyCapsule":
            return self._native.put_capsule(name, obj, replace, timeout)
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

    def _put_arrow(self, name: str, obj: Any, replace: bool,
                   timeout: float | None = 0) -> Tensor:
        """Copy an Arrow array of type arrow.fixed_shape_tensor into a new tensor; the Arrow
        array is released once copied."""
        if hasattr(obj, "__arrow_c_device_array__"):
            schema, array = obj.__arrow_c_device_array__()
        else:
            schema, array = obj.__arrow_c_array__()
        capsule = self._native.arrow_to_dlpack(schema, array)
        return self._native.put_capsule(name, capsule, replace, timeout)

    def _put_numpy(self, name: str, array: Any, replace: bool,
                   timeout: float | None = 0) -> Tensor:
        """numpy arrays of ml_dtypes types, which numpy's __dlpack__ refuses: copy through a view."""
        import numpy as np

        w = self.create(array.shape, array.dtype.name, timeout=timeout)
        np.copyto(to_numpy(w), array, casting="no")
        w.publish(name, replace)
        return w

    def delete(self, name: str) -> None:
        """Unbind ``name``; its memory is freed once the last lease on it ends."""
        self._native.delete(name)

    def list(self, prefix: str = "") -> list[dict[str, Any]]:
        """Published tensors whose names start with ``prefix``, in name order."""
        return self._native.list(prefix)

    def stat(self) -> dict[str, Any]:
        """``{"tensors", "leases", "sessions", "names", "evicted_tensors", "evicted_bytes",
        "creates_waiting", "pools": [{"device", "capacity_bytes", "used_bytes"}]}``."""
        return self._native.stat()

    def flush(self) -> None:
        """Wait until every lease released so far has been given back to the daemon.

        Raises DataLossError, once, if since the last flush a restarted daemon did not take back
        leases or unpublished tensors of this client (the message names their tensor ids), and
        ConnectionError if the session ended (the client reconnects on its own).
        """
        self._native.flush()

    def __repr__(self) -> str:
        return f"tensorshm.Client(session_id={self.session_id!r})"


def _is_numpy_scalar(obj: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, np.generic)


def _exports_arrow_array(obj: Any) -> bool:
    return hasattr(obj, "__arrow_c_device_array__") or hasattr(obj, "__arrow_c_array__")


def _is_numpy_array(obj: Any) -> bool:
    cls = type(obj)
    return cls.__module__ == "numpy" and cls.__name__ == "ndarray"


# In a child of fork(), the client the DLPack exchange API's allocator creates tensors through is
# the parent's (it cannot allocate there), and a parent thread may have held the lock around it.
os.register_at_fork(after_in_child=_tensorshm._after_fork_in_child)


def connect(socket: str | None = None, *, client_name: str | None = None,
            timeout: float = 5.0, server_uid: int | None = None) -> Client:
    """Connect to tensorshmd. ``socket=None``: $TENSORSHM_SOCKET, else
    $XDG_RUNTIME_DIR/tensorshm.sock, else /tmp/tensorshm-$UID/tensorshm.sock.
    ConnectionError if the daemon does not answer within ``timeout`` seconds.

    The client checks who serves every connection it makes to the socket (SO_PEERCRED): by
    default the daemon must run as this process's effective uid or as root, since a daemon of
    another user reads and can change every tensor passed through it (and another user could
    have taken over the socket's path). ``server_uid`` names one more uid to accept, for a
    daemon run as another user on purpose. A refused server raises PermissionError naming the
    socket, the server's uid and pid."""
    return Client(_tensorshm._Client.connect(socket, client_name, timeout, server_uid))
