"""Feed NVIDIA Triton Inference Server from tensorshm, zero-copy, through Triton's shared-memory
extensions (KServe v2 system and CUDA shared memory).

    import tensorshm, tritonclient.http as httpclient
    from tensorshm.triton import TritonFeeder

    with tensorshm.connect() as tsm, httpclient.InferenceServerClient("localhost:8000") as triton, \\
            TritonFeeder(triton, tsm) as feed:
        with tsm.get("x") as x:                     # a published tensor: Triton reads it in place
            y = tsm.create(x.shape, x.dtype)        # Triton writes its output here
            triton.infer("affine", [feed.input("x", x)], outputs=[feed.output("y", y)])
            y.publish("y")                          # and other processes get it

A tensor's segment is registered with Triton once, as a region named after the segment
(``tensorshm.<segment instance>.<cpu|cudaN>.<segment id>``), at offset 0 and its whole size; each input and
output is then (region, offset, length). Host segments go through the system shared-memory
extension (Triton opens the POSIX shm object by name, read-write: start tensorshmd with
``--shm-group GROUP`` and run Triton in that group, or as the daemon's uid); CUDA segments through
the CUDA extension, with the segment's IPC handle. Keep an input's tensor (its lease) and an
output's writable tensor alive until the inference has returned.

Needs ``tritonclient`` (``pip install tensorshm[triton]``); works with its HTTP and gRPC clients.
"""

from __future__ import annotations

import base64
import importlib
from typing import Any, Mapping

from ._client import Client
from ._errors import FailedPreconditionError, InvalidArgumentError
from ._tensorshm import Tensor, WritableTensor

__all__ = ["TritonFeeder", "triton_dtype"]

# tensorshm dtype name -> Triton (KServe v2) datatype.
_TRITON_DTYPES = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "uint16": "UINT16",
    "uint32": "UINT32",
    "uint64": "UINT64",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float16": "FP16",
    "float32": "FP32",
    "float64": "FP64",
    "bfloat16": "BF16",
}


def triton_dtype(dtype: str) -> str:
    """Triton's datatype ("FP32", ...) for a tensorshm dtype name; InvalidArgumentError if Triton
    has none (sub-byte, float8, complex dtypes)."""
    try:
        return _TRITON_DTYPES[dtype]
    except KeyError:
        raise InvalidArgumentError(
            f"dtype = {dtype!r}: Triton has no such datatype "
            f"(it takes {', '.join(sorted(_TRITON_DTYPES))})"
        ) from None


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    expected = 1
    for extent, stride in zip(reversed(shape), reversed(strides)):
        if extent != 1 and stride != expected:
            return False
        expected *= extent
    return True


def _describe(tensor: Tensor) -> str:
    return f"tensor {tensor.name!r}" if tensor.name else "tensor"


class TritonFeeder:
    """Turns tensorshm tensors into Triton inputs and outputs that live in shared memory.

    ``triton``: a ``tritonclient.http`` or ``tritonclient.grpc`` ``InferenceServerClient``;
    ``client``: a tensorshm Client. ``headers``: sent with every region (un)registration, e.g.
    ``{"triton-access-token": token}`` where the shared-memory endpoints are restricted (PyTriton's
    default; over gRPC the key is ``triton-grpc-protocol-triton-access-token``).
    ``cuda_device_ids``: this process's CUDA ordinal -> Triton's, where they differ
    (CUDA_VISIBLE_DEVICES); by default the same.

    One feeder per Triton server and tensorshm daemon (its region names are the segments'), and
    not thread-safe: share one behind a lock. Regions are unregistered by ``close()`` (or the end
    of its ``with`` block; one Triton refuses to unregister raises FailedPreconditionError), and
    when the tensorshm daemon restarted: the next input or output unregisters every region made
    before (a daemon that restarted clean made new objects under the old names; one that recovered
    took the same objects back, which are registered again alike) and registers what it needs.
    """

    def __init__(
        self,
        triton: Any,
        client: Client,
        *,
        headers: Mapping[str, str] | None = None,
        cuda_device_ids: Mapping[int, int] | None = None,
        region_prefix: str = "tensorshm.",
    ) -> None:
        # The protocol of its class (or of the tritonclient class it derives from).
        protocols = [
            ".".join(cls.__module__.split(".")[:2])
            for cls in type(triton).__mro__
            if cls.__module__.split(".")[:2] in (["tritonclient", "http"], ["tritonclient", "grpc"])
        ]
        if not protocols:
            raise InvalidArgumentError(
                f"triton = {type(triton).__module__}.{type(triton).__qualname__}: expected a "
                "tritonclient.http or tritonclient.grpc InferenceServerClient"
            )
        self._protocol = importlib.import_module(protocols[0])
        self._triton = triton
        self._client = client
        self._headers = dict(headers) if headers is not None else None
        self._cuda_device_ids = dict(cuda_device_ids or {})
        self._prefix = region_prefix
        self._instance = client.daemon_instance
        # (device, device_id, segment_instance, segment_id) -> region name
        self._regions: dict[tuple[str, int, int, int], str] = {}
        self._cuda_regions: set[str] = set()
        self._by_shm_name: dict[str, tuple[str, int, int, int]] = {}  # host regions, by object

    # -- inputs and outputs --

    def input(self, name: str, tensor: Tensor, *, copy: bool = False) -> Any:
        """A Triton ``InferInput`` named ``name`` whose bytes are ``tensor``'s, in place.

        ``tensor``: an acquired (or just published, or unpublished writable) tensorshm tensor,
        C-contiguous; a strided one raises InvalidArgumentError unless ``copy=True``, which copies
        it into a new contiguous tensorshm buffer first (host tensors; the copy lives as long as
        the returned input)."""
        if not _c_contiguous(tensor.shape, tensor.strides):
            if not copy:
                raise InvalidArgumentError(
                    f"{_describe(tensor)}: strides = {tensor.strides} for shape = {tensor.shape} "
                    "are not C-contiguous, and Triton reads contiguous bytes: pass copy=True to "
                    "copy it into a contiguous tensorshm buffer first"
                )
            tensor = self._contiguous_copy(tensor)
        infer_input = self._protocol.InferInput(name, list(tensor.shape), triton_dtype(tensor.dtype))
        region, offset, nbytes = self._place(tensor, f"input {name!r}")
        infer_input.set_shared_memory(region, nbytes, offset=offset)
        if isinstance(tensor, WritableTensor):
            infer_input._tensorshm_copy = tensor  # a copy made here lives as long as the input
        return infer_input

    def output(self, name: str, tensor: WritableTensor) -> Any:
        """A Triton ``InferRequestedOutput`` named ``name`` that Triton writes into ``tensor``'s
        buffer (an unpublished, C-contiguous WritableTensor from ``client.create`` of the output's
        shape and dtype); publish it once the inference has returned."""
        if not isinstance(tensor, WritableTensor) or tensor.published:
            raise InvalidArgumentError(
                f"output {name!r}: expected an unpublished WritableTensor (client.create), got "
                + ("a published one" if isinstance(tensor, WritableTensor) else type(tensor).__name__)
            )
        if not _c_contiguous(tensor.shape, tensor.strides):
            raise InvalidArgumentError(
                f"output {name!r}: strides = {tensor.strides} for shape = {tensor.shape} are not "
                "C-contiguous, and Triton writes contiguous bytes"
            )
        triton_dtype(tensor.dtype)  # refuses dtypes Triton cannot produce
        requested = self._protocol.InferRequestedOutput(name)
        region, offset, nbytes = self._place(tensor, f"output {name!r}")
        requested.set_shared_memory(region, nbytes, offset=offset)
        return requested

    # -- regions --

    @property
    def regions(self) -> dict[tuple[str, int, int, int], str]:
        """The regions this feeder registered: (device, device_id, segment_instance,
        segment_id) -> region name."""
        return dict(self._regions)

    def close(self) -> None:
        """Unregisters every region this feeder registered (idempotent). A server that is gone
        holds none; one that refuses (e.g. a token it wants) raises FailedPreconditionError
        naming the regions, once every other one was unregistered."""
        self._by_shm_name.clear()
        refused = []
        while self._regions:
            _, region = self._regions.popitem()
            error = self._unregister(region)
            if error is not None:
                refused.append(f"{region!r} ({error})")
        if refused:
            raise FailedPreconditionError(
                f"Triton refused to unregister {len(refused)} region(s): {'; '.join(refused)}"
            )

    def __enter__(self) -> TritonFeeder:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            self.close()
        except FailedPreconditionError:
            if exc_type is None:
                raise  # else the block's own exception is the one to see

    def _place(self, tensor: Tensor, what: str) -> tuple[str, int, int]:
        """(region, offset, nbytes) of `tensor`, its segment registered if it was not."""
        place = tensor._segment_place()
        if self._client.daemon_instance != self._instance:
            # A restarted daemon: its segments are other objects, even those under old names.
            self.close()
            self._instance = self._client.daemon_instance
        device = "cpu" if place["device"] == "cpu" else f"cuda{place['device_id']}"
        key = (place["device"], place["device_id"], place["segment_instance"], place["segment_id"])
        region = self._regions.get(key)
        if region is None:
            # A segment the daemon gave back lends its name to a later one (a new instance): the
            # old region maps memory that is no longer the pool's, and Triton 2.51 keeps one
            # region per name at a time.
            stale = self._by_shm_name.pop(place["shm_name"], None) if place["shm_name"] else None
            if stale is not None:
                self._unregister(self._regions.pop(stale))
            region = f"{self._prefix}{key[2]:016x}.{device}.{key[3]}"
            self._register(region, place, f"{what} ({_describe(tensor)})")
            self._regions[key] = region
            if place["device"] == "cpu":
                self._by_shm_name[place["shm_name"]] = key
        return region, place["offset"], place["nbytes"]

    def _register(self, region: str, place: dict[str, Any], what: str) -> None:
        from tritonclient.utils import InferenceServerException

        try:
            self._register_once(region, place, what)
        except InferenceServerException as e:
            if "already" not in str(e).lower():
                raise self._refused(region, place, what, e) from e
            # Left by a feeder of this daemon that did not close, or registered by a call whose
            # answer was lost: the same segment under the same name. Made again, so that it maps
            # the object the name holds now.
            self._unregister(region, cuda=place["device"] == "cuda")
            try:
                self._register_once(region, place, what)
            except InferenceServerException as again:
                raise self._refused(region, place, what, again) from again
        if place["device"] == "cuda":
            self._cuda_regions.add(region)

    def _register_once(self, region: str, place: dict[str, Any], what: str) -> None:
        if place["device"] == "cuda":
            device = self._cuda_device_ids.get(place["device_id"], place["device_id"])
            self._triton.register_cuda_shared_memory(
                region,
                base64.b64encode(place["ipc_handle"]),
                device,
                place["segment_size"],
                headers=self._headers,
            )
            return
        if not place["shm_name"]:
            raise FailedPreconditionError(
                f"{what}: its segment {place['segment_id']} is an anonymous memfd, and Triton "
                "opens shared memory by name. tensorshmd makes named segments only for its own "
                "uid's buffers, and none with --segments memfd: publish (and create outputs) as "
                "the daemon's uid, with tensorshmd on --segments shm"
            )
        # Offset 0 and the whole segment: Triton 2.51 adds a region's own offset twice.
        self._triton.register_system_shared_memory(
            region, place["shm_name"], place["segment_size"], offset=0, headers=self._headers
        )

    @staticmethod
    def _refused(region: str, place: dict[str, Any], what: str, e: Exception) -> Exception:
        hint = ""
        if place["device"] == "cpu" and "unable to open" in str(e).lower():
            hint = (
                f" Triton opens {place['shm_name']} by name, read-write (even for inputs): start "
                "tensorshmd with --shm-group GROUP and run Triton in that group, or run Triton as "
                "the daemon's uid"
            )
        return FailedPreconditionError(
            f"{what}: Triton refused to register region {region!r}: {e}.{hint}"
        )

    def _unregister(self, region: str, cuda: bool | None = None) -> str | None:
        """Unregisters `region` (a CUDA one if `cuda`; by default, if registered as one).
        Returns Triton's refusal, or None: done, or the server is gone (and holds no regions)."""
        from tritonclient.utils import InferenceServerException

        if cuda is None:
            cuda = region in self._cuda_regions
        self._cuda_regions.discard(region)
        try:
            if cuda:
                self._triton.unregister_cuda_shared_memory(region, headers=self._headers)
            else:
                self._triton.unregister_system_shared_memory(region, headers=self._headers)
        except OSError:
            pass  # HTTP: the server went away
        except InferenceServerException as e:
            if "UNAVAILABLE" not in str(e.status()):  # gRPC's word for a server that is gone
                return str(e)
        return None

    def _contiguous_copy(self, tensor: Tensor) -> WritableTensor:
        if tensor.device != "cpu":
            raise InvalidArgumentError(
                f"{_describe(tensor)}: copy=True copies host tensors only (device = "
                f"{tensor.device!r}); make it contiguous on the device first"
            )
        import numpy as np

        copy = self._client.create(tensor.shape, tensor.dtype)
        np.copyto(np.from_dlpack(copy), np.from_dlpack(tensor))
        return copy
