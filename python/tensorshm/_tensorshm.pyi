"""tensorshm's native layer; use the `tensorshm` package."""

from collections.abc import Sequence
from typing import Any, Dict, List

from typing_extensions import Self


class _RawStorage:
    def __buffer__(self, flags: int, /) -> memoryview: ...

class Tensor:
    """
    A tensor in tensorshm shared memory (read-only once published, host and VMM CUDA tensors by their mapping; on a legacy CUDA pool, --cuda-pool-kind ipc, the read-only flag is advisory, as CUDA IPC maps device memory writable).
    """

    def __dlpack__(self, *, stream: Any = None, max_version: tuple[int, int] | None = None, dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
        """
        The tensor as a DLPack capsule. With max_version >= (1, 0): a zero-copy view flagged read-only when the tensor is (numpy, torch, tvm-ffi). Without it (JAX, pre-1.0 consumers), a legacy capsule cannot say read-only: a published host tensor is then handed over as a private copy the consumer owns (copy=False refuses), and a published CUDA tensor is refused unless dl_device=(1, 0) asks for a host copy. copy=True always copies to host memory.
        """

    def __dlpack_device__(self) -> tuple[int, int]: ...

    @property
    def shape(self, /) -> tuple[int, ...]: ...

    @property
    def strides(self, /) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def name(self) -> str | None: ...

    @property
    def read_only(self) -> bool: ...

    @property
    def subbyte_padded(self) -> bool: ...

    @property
    def alive(self) -> bool:
        """
        Whether tensorshmd still reserves this tensor's memory for it. False once a restarted daemon did not take the tensor's lease back (the memory stays mapped and readable, but its bytes are no longer guaranteed), and in a process forked from the one that acquired it (the lease is the parent's); check() raises saying which. True for tensors that hold no lease: foreign tensors, and unpublished writable tensors (a restarted daemon that did not take one back makes its publish() raise DataLossError).
        """

    def check(self) -> None:
        """
        Returns None while the tensor is alive; otherwise raises DataLossError (a restarted daemon did not take its lease back) or FailedPreconditionError (in a forked child: connect and get it again there).
        """

    @property
    def _data_ptr(self) -> int: ...

    def segment_place(self) -> dict[str, Any]:
        """
        Where the tensor's bytes lie in tensorshmd's memory, for code that hands them to a server or engine mapping that memory itself (tensorshm.triton, tensorshm.transfer): a dict of device, device_id, segment_instance, segment_id, segment_size, offset and nbytes (of the bytes the tensor spans), address (of the first in this process), shm_name (host; empty for a memfd segment) and ipc_handle (CUDA: the segment's cudaIpcMemHandle on a legacy pool, empty on a VMM pool). An acquired CUDA tensor's place is given once its producer's ready event has completed. Valid while the tensor's lease is held.
        """

    def _raw_storage(self) -> tuple[_RawStorage, int]: ...

    def release(self) -> None:
        """
        Gives the tensor's lease back now (idempotent), instead of when the object is garbage collected; an unpublished WritableTensor's buffer is freed. Views already exported (np.from_dlpack, torch.from_dlpack, memoryview, np.asarray, tensorshm.to_numpy) stay valid and hold the lease until they go. Any later use of this object raises ReleasedError. The one exception: a non-owning DLTensor view taken through the C exchange API's dltensor_from_py_object_no_sync is valid only while the object is alive and not released, so don't release a tensor in one thread while a C consumer works on such a view of it in another.
        """

    @property
    def released(self) -> bool:
        """Whether release() was called (or the tensor's with block ended)."""

    @property
    def __array_interface__(self) -> object: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, arg0: object | None, arg1: object | None, arg2: object | None, /) -> None: ...

    def __repr__(self) -> str: ...

    __dlpack_c_exchange_api__: object

    def __arrow_c_schema__(self) -> object:
        """
        The Arrow type of this tensor, an "arrow_schema" PyCapsule: the canonical extension type arrow.fixed_shape_tensor (storage FixedSizeList<T>[prod(shape[1:])], extension metadata {"shape": shape[1:]}).
        """

    def __arrow_c_array__(self, requested_schema: object | None = None) -> tuple[object, object]:
        """
        This host tensor as an Arrow array of arrow.fixed_shape_tensor of length shape[0] ("arrow_schema", "arrow_array" PyCapsules), zero-copy: the array holds the tensor's lease until Arrow releases it. C-contiguous tensors of int, uint and float dtypes of 8 to 64 bits with at least one dimension; CUDA tensors export through __arrow_c_device_array__. requested_schema is best-effort and ignored.
        """

    def __arrow_c_device_array__(self, requested_schema: object | None = None, **kwargs: object) -> tuple[object, object]:
        """
        As __arrow_c_array__, as an Arrow C Device Data Interface array ("arrow_schema", "arrow_device_array" PyCapsules): host tensors as ARROW_DEVICE_CPU, CUDA tensors as ARROW_DEVICE_CUDA with this process's device id and sync_event pointing at the producer's ready event (a CUevent*), which consumers wait on before reading. Other keywords: None only (NotImplementedError otherwise), as the PyCapsule interface says.
        """

    def __buffer__(self, flags: int, /) -> memoryview: ...

class WritableTensor(Tensor):
    """A tensor being filled; publish() seals it."""

    def publish(self, name: str, replace: bool = False) -> None: ...

    @property
    def published(self) -> bool: ...

class _WaitCanceller:
    """Cancels the waits it is passed to (tensorshm's asyncio calls)."""

    def __init__(self) -> None: ...

    def cancel(self) -> None: ...

    @property
    def cancelled(self) -> bool: ...

def _cancel_waits_at_exit() -> None:
    """
    At interpreter exit: wakes every waiting get/create/put (they raise CancelledError), waits for calls in progress to return, and makes later waits raise at once.
    """

class _Client:
    def arrow_to_dlpack(self, schema: object, array: object) -> object: ...

    @staticmethod
    def connect(socket: str | None = None, client_name: str | None = None, timeout: float = 5.0, server_uid: int | None = None) -> _Client: ...

    def get(self, name: str, timeout: float | None = 0.0, cancel: _WaitCanceller | None = None) -> Tensor: ...

    def try_get_local(self, name: str) -> Tensor | None:
        """
        The tensor from this process's fast path, without a call to the daemon or a wait (the GIL is kept: it takes microseconds); None where only get() can answer.
        """

    def create(self, shape: Sequence[int], dtype: str, strides: Sequence[int] | None = None, device: str = 'cpu', subbyte_padded: bool = False, timeout: float | None = 0.0, cancel: _WaitCanceller | None = None) -> WritableTensor: ...

    def put_capsule(self, name: str, capsule: object, replace: bool = False, timeout: float | None = 0.0, cancel: _WaitCanceller | None = None) -> Tensor: ...

    def put_exchange(self, name: str, obj: object, api: object, replace: bool = False, timeout: float | None = 0.0) -> Tensor: ...

    def delete(self, arg: str, /) -> None: ...

    def list(self, prefix: str = '') -> List[Dict[str, Any]]: ...

    def keys(self, prefix: str = '') -> List[str]: ...

    def contains(self, name: str) -> bool: ...

    def stat(self) -> dict[str, Any]: ...

    def sessions(self) -> List[Dict[str, Any]]: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...

    @property
    def closed(self) -> bool: ...

    @property
    def session_id(self) -> str: ...

    @property
    def daemon_instance(self) -> int: ...

    @property
    def socket(self) -> str: ...

    def __repr__(self) -> str: ...

def _quiet_leak_warnings() -> None:
    """
    At exit, when daemon threads are still alive: nanobind would report the tensors and clients they hold as leaked. Safe to leave: the process is exiting, and the daemon takes a session's leases and buffers back when its connection closes.
    """

def _after_fork_in_child() -> None:
    """Called in a child of os.fork(): forgets the parent's allocator client."""

def _exchange_api_calls() -> dict[str, int]: ...

def _dtype_fields(arg: str, /) -> tuple[int, int, int]: ...

def _dtype_name(arg0: int, arg1: int, arg2: int, /) -> str: ...

def _triton_datatypes() -> dict[str, str]: ...

__version__: str
