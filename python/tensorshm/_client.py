"""tensorshm.Client (one session with tensorshmd) and connect()."""

from __future__ import annotations

import builtins
import time
from typing import Any, Iterable, Iterator

from . import _aio, _put, _tensorshm
from ._errors import Error, InvalidArgumentError
from ._tensorshm import Tensor, WritableTensor


def _dtype_name(dtype: Any) -> str:
    """A tensorshm dtype name from a string, a numpy dtype, or a numpy / ml_dtypes scalar type."""
    name: str | None
    if isinstance(dtype, str):
        name = dtype
    else:
        name = getattr(dtype, "name", None) or getattr(dtype, "__name__", None)
        if not isinstance(name, str):
            try:
                import numpy as np

                name = np.dtype(dtype).name
            except Exception as e:  # noqa: BLE001 - any failure means "not a dtype"
                raise InvalidArgumentError(f"dtype = {dtype!r}: not a dtype") from e
    _tensorshm._dtype_fields(name)  # raises InvalidArgumentError naming the dtype if unknown
    return name


class Client:
    """A connection (one session) to tensorshmd. Thread-safe.

        with tensorshm.connect() as client:     # close() at the end of the block
            client["x"] = np.zeros(4)           # put("x", ..., replace=True)
            t = client["x"]                     # get("x"): NotFoundError (a KeyError) if absent
            "x" in client, client.keys("batch/"), del client["x"]

    Tensors obtained through a client stay valid after it is closed or garbage collected, until
    they themselves are released (``t.release()``, the end of ``with t:``, or garbage
    collection); the session ends once the client is closed and they are all released.

    Dict-like access works on the daemon's names, which other processes change at any time:
    ``name in client`` and ``keys()`` are snapshots, and iterating over a client iterates over
    one ``keys()`` snapshot. There is no ``len(client)``: with it an empty daemon would make the
    client falsy (``if client:``), and the count would be stale at once; use
    ``len(client.keys())``.

    If the daemon restarts, the client reconnects on its own (a new ``daemon_instance`` and
    ``session_id``). A call made meanwhile waits for the new session and runs there, within its
    deadline (its ``timeout`` when positive, else 60 s): ``stat``, ``list``, ``get``, ``delete``,
    ``create`` ride through. A publish (``publish``, ``put``) in flight when the daemon died is not
    repeated, since the daemon may have committed it: it raises ConnectionError saying its fate
    is unknown (look for the name before publishing again). Tensors stay
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
        """The daemon's number for this session, as ``tensorshmctl sessions`` and ``sessions()``
        show it (a new one after a reconnect; numbering starts again at each daemon start). Never
        the session's secret token."""
        return self._native.session_id

    @property
    def socket(self) -> str:
        """The path of the daemon's Unix socket this client connects to."""
        return self._native.socket

    @property
    def daemon_instance(self) -> int:
        """The daemon instance serving the session (a new one after a daemon restart)."""
        return self._native.daemon_instance

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (or the client's ``with`` block ended)."""
        return self._native.closed

    def close(self) -> None:
        """End this client now (idempotent).

        A ``get`` (or a ``create``/``put`` waiting for memory) in progress in another thread is
        woken and raises ClosedError; every later call raises ClosedError, naming the session.
        Tensors and writable tensors taken from the client stay valid and readable (an
        unpublished writable tensor can no longer be published); the session closes as soon as
        they are all released, at once if none is held.
        """
        self._native.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

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
        return self._create(shape, dtype, device, strides, subbyte_padded, timeout, None)

    def _create(self, shape: Any, dtype: Any, device: str, strides: Any,
                subbyte_padded: bool | None, timeout: float | None,
                cancel: _tensorshm._WaitCanceller | None) -> WritableTensor:
        if isinstance(shape, int):
            shape = (shape,)
        name = _dtype_name(dtype)
        bits = _tensorshm._dtype_fields(name)[1]
        padded = bits < 8 if subbyte_padded is None else subbyte_padded
        return self._native.create(
            [int(d) for d in shape], name, None if strides is None else [int(s) for s in strides],
            device, padded, None if timeout is None else float(timeout), cancel,
        )

    def get(self, name: str, timeout: float | None = 0) -> Tensor:
        """Acquire the tensor published as ``name``, zero-copy and read-only.

        Read-only is enforced by the mapping for host tensors and for CUDA tensors of a VMM pool
        (the default: a write through the pointer is refused by the GPU); on a legacy CUDA pool
        (``tensorshmd --cuda-pool-kind ipc``) it is advisory, as CUDA IPC opens device memory
        writable.

        ``timeout``: 0 raises NotFoundError at once if the name is not published; seconds waits
        that long for a publish (then TimeoutError); None waits until it is published. A wait
        raises ClosedError if the client is closed meanwhile, and CancelledError if the
        interpreter exits meanwhile (waits are cancelled then, so that threads blocked in get do
        not keep the process from exiting).

        Use ``with client.get(name) as t:`` (or ``t.release()``) to give the lease back early.
        """
        return self._native.get(name, None if timeout is None else float(timeout))

    def get_many(self, names: Iterable[str], timeout: float | None = 0) -> list[Tensor]:
        """The tensors published as ``names``, in that order, waiting for all of them.

        ``timeout`` bounds the whole call (one deadline, not one per name): 0 raises at once if
        one is not published, seconds waits up to that long in all (then TimeoutError), None
        waits until all are published. On any failure no lease is kept (those already got are
        released) and the error, of the same class as ``get``'s, names the name that failed.
        """
        return self._get_many(list(names), timeout, None)

    def _get_many(self, names: list[str], timeout: float | None,
                  cancel: _tensorshm._WaitCanceller | None) -> list[Tensor]:
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        got: list[Tensor] = []
        index = 0
        try:
            for index, name in enumerate(names):
                if deadline is None:
                    left: float | None = None
                elif timeout == 0:
                    left = 0.0
                else:
                    # Still a wait (TimeoutError, not NotFoundError) once the deadline passed.
                    left = max(deadline - time.monotonic(), 1e-6)
                got.append(self._native.get(name, left, cancel))
        except Error as e:
            for tensor in got:
                tensor.release()
            raise type(e)(
                f"get_many: name = {names[index]!r} (#{index} of {len(names)} names, "
                f"timeout={timeout}) failed: {e.message}; the {len(got)} tensors got before it "
                "were released",
                e.code,
            ) from e
        except BaseException:
            for tensor in got:
                tensor.release()
            raise
        return got

    async def aget(self, name: str, timeout: float | None = 0) -> Tensor:
        """``get`` for asyncio: the wait runs in a worker thread without the GIL, so the event
        loop keeps running. Cancelling the awaiting task wakes the wait at once (it does not
        run to its timeout) and keeps no lease: the cancellation completes once the wait ended
        and anything it got was released. A host tensor that is already published is taken
        from the fast path on the loop's thread (microseconds, no call to the daemon); only
        what the fast path cannot answer goes to the worker thread."""
        return await _aio.aget(self, name, timeout)

    async def aget_many(self, names: Iterable[str], timeout: float | None = 0) -> list[Tensor]:
        """``get_many`` for asyncio, as ``aget``: cancellable, never blocking the loop."""
        return await _aio.aget_many(self, names, timeout)

    async def aput(self, name: str, obj: Any, replace: bool = False, *,
                   timeout: float | None = 0) -> Tensor:
        """``put`` for asyncio: the copy (and a wait for memory, with ``timeout``) runs in a
        worker thread with the GIL released, so the event loop keeps running. Cancellable: a
        wait for memory is woken at once; a put that completed anyway is released (the name
        stays published, as after a put)."""
        return await _aio.aput(self, name, obj, replace, timeout)

    def __getitem__(self, name: str) -> Tensor:
        """``client[name]``: ``get(name)``; NotFoundError (a KeyError) if not published."""
        return self.get(name)

    def __setitem__(self, name: str, obj: Any) -> None:
        """``client[name] = obj``: ``put(name, obj, replace=True)``, keeping no lease."""
        self.put(name, obj, replace=True).release()

    def __delitem__(self, name: str) -> None:
        """``del client[name]``: ``delete(name)``; NotFoundError (a KeyError) if not published."""
        self.delete(name)

    def __contains__(self, name: object) -> bool:
        """``name in client``: whether ``name`` is published now, taking no lease. False for
        anything that is not a publishable name."""
        if not isinstance(name, str):
            return False
        return self._native.contains(name)

    def __iter__(self) -> Iterator[str]:
        """Iterates over a snapshot of the published names (``keys()``), in name order."""
        return iter(self.keys())

    def keys(self, prefix: str = "") -> list[str]:
        """The published names starting with ``prefix``, in name order (a snapshot)."""
        return self._native.keys(prefix)

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

        Use ``with client.put(name, obj) as t:`` (or ``t.release()``) to give the lease back
        early.
        """
        return self._put(name, obj, replace, timeout, None)

    def _put(self, name: str, obj: Any, replace: bool, timeout: float | None,
             cancel: _tensorshm._WaitCanceller | None) -> Tensor:
        """put; with ``cancel`` (aput, in a worker thread) the owned ``__dlpack__`` export is
        preferred, as its copy runs with the GIL released."""
        return _put.put(self, name, obj, replace, timeout, cancel)

    def delete(self, name: str) -> None:
        """Unbind ``name``; its memory is freed once the last lease on it ends."""
        self._native.delete(name)

    def list(self, prefix: str = "") -> list[dict[str, Any]]:
        """Published tensors whose names start with ``prefix``, in name order."""
        return self._native.list(prefix)

    def stat(self) -> dict[str, Any]:
        """``{"tensors", "leases", "sessions", "names", "evicted_tensors", "evicted_bytes",
        "creates_waiting", "stocked_tensors", "pools": [{"device", "capacity_bytes",
        "used_bytes", "stock_bytes", "largest_free_bytes", "segments"}]}``. ``used_bytes`` is
        what tensors (published or not) hold; ``stock_bytes`` what stocked buffers hold (buffers
        the daemon made ahead of a producer's need, counted as stock until published);
        ``largest_free_bytes`` the largest tensor the pool could take now (its uids' fair shares
        aside; less than the free bytes when frees left them in smaller blocks);
        ``stocked_tensors`` how many of ``tensors`` are stocked buffers."""
        return self._native.stat()

    def sessions(self) -> builtins.list[dict[str, Any]]:
        """Every session the daemon has open, this one included (``own``): ``{"session_id",
        "pid", "uid", "gid", "client_name", "client_version", "rpc_leases", "page_leases",
        "unpublished_tensors", "unpublished_bytes", "waiting_acquires", "opened_unix_ms", "own",
        "redacted"}`` (another uid's sessions come redacted: no pid, gid, name or version),
        as ``tensorshmctl sessions`` shows them."""
        return self._native.sessions()

    def flush(self) -> None:
        """Wait until every lease released so far has been given back to the daemon.

        It also waits for what the client does in the background for mappings made so far:
        populating the rest of a newly mapped segment, and stocked buffers. After it, reads of
        mapped tensors and fills of reused buffers fault in no thread of the process.

        Raises DataLossError, once, if since the last flush a restarted daemon did not take back
        leases or unpublished tensors of this client (the message names their tensor ids), and
        ConnectionError if the session ended (the client reconnects on its own).
        """
        self._native.flush()

    def __repr__(self) -> str:
        """``tensorshm.Client(socket=..., session_id=..., daemon_instance=...[, closed])``."""
        return repr(self._native)


def connect(socket: str | None = None, *, client_name: str | None = None,
            timeout: float = 5.0, server_uid: int | None = None) -> Client:
    """Connect to tensorshmd. ``socket=None``: $TENSORSHM_SOCKET, else the user's own daemon's
    socket ($XDG_RUNTIME_DIR/tensorshm.sock, else /tmp/tensorshm-$UID/tensorshm.sock) when one
    is there, else the packaged daemon's /run/tensorshm/tensorshm.sock when one is there.
    ConnectionError if the daemon does not accept the connection and open the session within
    ``timeout`` seconds (a stopped daemon included), and at once, naming the path, if there is no
    socket file there. The wait hears signals: Ctrl-C raises KeyboardInterrupt.

    The client checks who serves every connection it makes to the socket (SO_PEERCRED): by
    default the daemon must run as this process's effective uid, as root, or be the packaged
    daemon of /run/tensorshm/tensorshm.sock, whose directory only root could have made, since a
    daemon of another user reads and can change every tensor passed through it (and another user
    could have taken over the socket's path). ``server_uid`` (else $TENSORSHM_SERVER_UID) names
    one more uid to accept, for a daemon run as another user elsewhere. A refused server raises PermissionError naming the
    socket, the server's uid and pid."""
    return Client(_tensorshm._Client.connect(socket, client_name, timeout, server_uid))
