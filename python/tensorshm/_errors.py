"""tensorshm's exceptions: each subclasses tensorshm.Error and the builtin a Python user would
catch for the same condition."""

from __future__ import annotations

import builtins
from typing import Any


class Error(Exception):
    """Base of every tensorshm error. ``code`` is the canonical gRPC status code."""

    code: int = 2  # UNKNOWN

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return self.message


class CancelledError(Error):
    code = 1


class InvalidArgumentError(Error, ValueError):
    code = 3


class TimeoutError(Error, builtins.TimeoutError):
    """An acquire wait ran out (DEADLINE_EXCEEDED)."""

    code = 4


class NotFoundError(Error, KeyError):
    code = 5


class AlreadyExistsError(Error):
    code = 6


class PermissionError(Error, builtins.PermissionError):
    code = 7


class ResourceExhaustedError(Error, MemoryError):
    code = 8


class FailedPreconditionError(Error):
    code = 9


class ClosedError(FailedPreconditionError, ValueError):
    """A call on a closed Client (``close()`` or the end of its ``with`` block), or on a writable
    tensor whose client was closed; also what a ``get`` waiting in another thread raises when
    its client is closed. The message names the session and socket. Connect again."""


class ReleasedError(FailedPreconditionError, ValueError):
    """A use of a tensor after its ``release()`` (or the end of its ``with`` block). Views
    exported before the release stay valid; get the tensor again to use it."""


class UnimplementedError(Error, NotImplementedError):
    code = 12


class InternalError(Error):
    code = 13


class ConnectionError(Error, builtins.ConnectionError):
    """The daemon is not reachable, or the session with it ended (UNAVAILABLE)."""

    code = 14


class UnauthenticatedError(Error, builtins.PermissionError):
    """A call without valid credentials (UNAUTHENTICATED): a tensorshm.transfer mover refused a
    peer that proved no fleet token or certificate, or a peer's answer that proved none."""

    code = 16


class DataLossError(Error):
    """A restarted daemon did not take back a lease or an unpublished tensor (DATA_LOSS): the
    memory stays mapped and readable, but is no longer reserved for it; get or create it again."""

    code = 15


_BY_CODE: dict[int, type[Error]] = {
    cls.code: cls
    for cls in (
        CancelledError,
        InvalidArgumentError,
        TimeoutError,
        NotFoundError,
        AlreadyExistsError,
        PermissionError,
        ResourceExhaustedError,
        FailedPreconditionError,
        UnimplementedError,
        InternalError,
        ConnectionError,
        DataLossError,
        UnauthenticatedError,
    )
}


def from_code(code: int, message: str) -> Error:
    """The exception for a non-OK status `code` (gRPC's numbering, as the daemon, the movers and
    the native layer use it): the class of that code, else Error. The one mapping from codes to
    exceptions; every other place calls this."""
    return _BY_CODE.get(code, Error)(message, code)


def grpc_code(grpc: Any, error: Error) -> Any:
    """`error`'s code as `grpc`.StatusCode (the module passed in: grpcio is optional), UNKNOWN
    for a code gRPC does not have."""
    return next((c for c in grpc.StatusCode if c.value[0] == error.code), grpc.StatusCode.UNKNOWN)


def _raise_status(code: int, message: str) -> None:
    """Called by the native layer: raises the exception for a non-OK status."""
    raise from_code(code, message)
