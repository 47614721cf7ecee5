"""tensorshm: share tensors between processes through shared memory, zero-copy, over DLPack.

    import tensorshm, numpy as np
    with tensorshm.connect() as client:
        client.put("batch/17", np.arange(12, dtype=np.float32).reshape(3, 4))
        with client.get("batch/17") as t:   # zero-copy, read-only; the lease ends with the block
            a = np.from_dlpack(t)           # or torch.from_dlpack(t), tvm_ffi.from_dlpack(t)
"""

from __future__ import annotations

from . import _lifecycle  # noqa: F401 - installs the exit and fork hooks
from ._client import Client, connect
from ._daemon import Daemon
from ._errors import (
    AlreadyExistsError,
    CancelledError,
    ClosedError,
    ConnectionError,
    DataLossError,
    Error,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionError,
    ReleasedError,
    ResourceExhaustedError,
    TimeoutError,
    UnauthenticatedError,
    UnimplementedError,
)
from . import _tensorshm
from ._numpy import to_numpy
from ._tensorshm import Tensor, WritableTensor

# ConnectionError, PermissionError and TimeoutError are reachable as tensorshm.X but left out of
# __all__, so that `from tensorshm import *` does not shadow the builtins of the same names. Each
# subclasses its builtin, so `except TimeoutError:` catches tensorshm.TimeoutError.
__all__ = [
    "AlreadyExistsError",
    "CancelledError",
    "Client",
    "ClosedError",
    "Daemon",
    "DataLossError",
    "Error",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "ReleasedError",
    "ResourceExhaustedError",
    "Tensor",
    "UnauthenticatedError",
    "UnimplementedError",
    "WritableTensor",
    "connect",
    "to_numpy",
]

# CMake's project VERSION, compiled into the extension (as the daemon and libtensorshm carry it).
__version__: str = _tensorshm.__version__

# Defined in private modules; shown (repr, help, tracebacks) as the package's own.
Client.__module__ = __name__
connect.__module__ = __name__
Daemon.__module__ = __name__
for _error in (AlreadyExistsError, CancelledError, ClosedError, ConnectionError, DataLossError,
               Error, FailedPreconditionError, InternalError, InvalidArgumentError, NotFoundError,
               PermissionError, ReleasedError, ResourceExhaustedError, TimeoutError,
               UnauthenticatedError, UnimplementedError):
    _error.__module__ = __name__
del _error

# `from __future__ import annotations` binds this name here: not part of the package.
del annotations
