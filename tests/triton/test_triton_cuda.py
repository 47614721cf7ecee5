"""CUDA tensors through Triton's CUDA shared-memory extension, against the emulated driver
(tests/support/fake_cuda): what the feeder registers for one inference (the segment's IPC handle,
base64, Triton's device ordinal, and the segment's bytes up to the end of the inference's last
tensor in it), each input's (region, offset, length), and the unregister after. A separate
process, as Triton would, opens that handle and reads the tensor's bytes at that offset. The CPU
tritonserver here cannot open CUDA handles; tests/gpu runs a real device where one is lent."""

from __future__ import annotations

import base64
import os
import subprocess
import sys

import numpy as np
import pytest

import tensorshm
from tensorshm.triton import TritonFeeder

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tests" / "python"))

from fake_cuda import Driver, two_device_daemon, use_emulated_driver  # noqa: E402 - after sys.path

# 2 devices, seen swapped here and in order by the daemon (and the "Triton" reader below).
FAKE = use_emulated_driver()

import tritonclient.http as httpclient  # noqa: E402

# What Triton does with a registered CUDA region: cudaIpcOpenMemHandle, then base + offset.
READER = """
import base64, ctypes, os, sys
lib = ctypes.CDLL(os.environ["TENSORSHM_LIBCUDA"])
handle, ordinal, offset, nbytes = base64.b64decode(sys.argv[1]), *map(int, sys.argv[2:5])
class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]
h = Handle()
ctypes.memmove(ctypes.addressof(h), handle, 64)
device, context, base = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
assert lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(device), ordinal) == 0
assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
assert lib.cuCtxPushCurrent_v2(context) == 0
assert lib.cuIpcOpenMemHandle_v2(ctypes.byref(base), h, ctypes.c_uint(1)) == 0
out = ctypes.create_string_buffer(nbytes)
lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
assert lib.cuMemcpyDtoH_v2(out, base.value + offset, nbytes) == 0
sys.stdout.write(out.raw.hex())
"""


class RecordingTriton(httpclient.InferenceServerClient):
    """A tritonclient HTTP client whose region calls and inferences are recorded, not sent."""

    def __init__(self) -> None:
        super().__init__("127.0.0.1:9")
        self.calls: list[tuple] = []

    def get_system_shared_memory_status(self, region_name="", headers=None, query_params=None):
        return []

    def get_cuda_shared_memory_status(self, region_name="", headers=None, query_params=None):
        return []

    def infer(self, model_name, inputs, outputs=None, **kwargs):
        self.calls.append(("infer", model_name))

    def register_cuda_shared_memory(self, name, raw_handle, device_id, byte_size, headers=None):
        self.calls.append(("register", name, raw_handle, device_id, byte_size))

    def unregister_cuda_shared_memory(self, name="", headers=None):
        self.calls.append(("unregister", name))

    def register_system_shared_memory(self, name, key, byte_size, offset=0, headers=None):
        self.calls.append(("register_system", name, key, byte_size, offset))

    def unregister_system_shared_memory(self, name="", headers=None):
        self.calls.append(("unregister_system", name))


def shm_parameters(tensor) -> tuple[str, int, int]:
    """The (region, byte size, offset) a tritonclient HTTP input or output sends (an offset of
    0 is left out of the request)."""
    params = tensor._get_tensor()["parameters"]
    return (params["shared_memory_region"], params["shared_memory_byte_size"],
            params.get("shared_memory_offset", 0))


@pytest.fixture(scope="module")
def daemon():
    # Triton's CUDA shared memory registers a cudaIpcMemHandle: legacy pools.
    d = two_device_daemon("triton-cuda", FAKE, kind="ipc")
    yield d
    assert d.stop() == 0


def test_cuda_input_registers_the_segment_handle_for_the_inference_and_reaches_the_bytes(daemon):
    data = np.arange(3000, dtype=np.float32) * 1.5
    with tensorshm.connect(daemon.socket) as client:
        w = client.create((3000,), "float32", device="cuda:1")  # the daemon's device 0
        Driver().to_device(1, w._data_ptr, data)
        w.publish("g", replace=True)
        triton = RecordingTriton()
        with client.get("g") as x, TritonFeeder(triton, client, cuda_device_ids={1: 0}) as feed:
            place = x.segment_place()
            assert place["device"] == "cuda" and place["device_id"] == 1
            assert len(place["ipc_handle"]) == 64
            end = place["offset"] + data.nbytes
            assert end < place["segment_size"]  # so that the bound below says something
            infer_input, again = feed.input("x", x), feed.input("x2", x)
            assert triton.calls == []  # nothing registered until the inference
            feed.infer("m", [infer_input, again])
            # The same segment: one region, up to the tensor's end, for the call only.
            region = triton.calls[0][1]
            assert region.startswith("tensorshm.")
            assert triton.calls == [
                ("register", region, base64.b64encode(place["ipc_handle"]), 0, end),
                ("infer", "m"), ("unregister", region)]
            assert shm_parameters(infer_input) == (region, data.nbytes, place["offset"])
            assert feed.regions == []
            # Triton's process sees the devices in order, as the daemon does (its ordinal 0).
            read = subprocess.run(
                [sys.executable, "-c", READER, base64.b64encode(place["ipc_handle"]).decode(), "0",
                 str(place["offset"]), str(data.nbytes)],
                capture_output=True, text=True, timeout=60,
                env={**os.environ, "TSM_FAKE_CUDA_VISIBLE": "0,1"})
            assert read.returncode == 0, read.stderr
            assert bytes.fromhex(read.stdout) == data.tobytes()


def test_cuda_output_is_a_region_of_the_writable_buffers_segment(daemon):
    with tensorshm.connect(daemon.socket) as client:
        y = client.create((64, 4), "float32", device="cuda:0")  # the daemon's device 1
        triton = RecordingTriton()
        with TritonFeeder(triton, client) as feed:
            requested = feed.output("y", y)
            place = y.segment_place()
            with feed.registered([], [requested]) as regions:
                assert triton.calls == [("register", regions[0], base64.b64encode(
                    place["ipc_handle"]), 0, place["offset"] + 64 * 4 * 4)]  # ordinal unmapped
                assert shm_parameters(requested) == (regions[0], 64 * 4 * 4, place["offset"])
            assert triton.calls[-1] == ("unregister", regions[0])
            with pytest.raises(tensorshm.InvalidArgumentError, match="copy=True copies host"):
                w = client.create((8,), "float32", strides=(2,), device="cuda:0")
                feed.input("w", w, copy=True)


def test_a_host_and_a_cuda_segment_of_the_same_numbers_are_two_regions(daemon):
    """Host and CUDA segments are numbered apart, under the same daemon instance: (instance, id)
    alone would hand a CUDA tensor the host segment's region."""
    with tensorshm.connect(daemon.socket) as client:
        client.put("h", np.ones(16, np.float32), replace=True)
        w = client.create((16,), "float32", device="cuda:1")
        triton = RecordingTriton()
        with client.get("h") as h, TritonFeeder(triton, client) as feed:
            hp, wp = h.segment_place(), w.segment_place()
            assert (hp["segment_instance"], hp["segment_id"]) == (
                wp["segment_instance"], wp["segment_id"])  # the case this test is about
            feed.infer("m", [feed.input("h", h)], [feed.output("w", w)])
            assert [call[0] for call in triton.calls] == [
                "register_system", "register", "infer", "unregister_system", "unregister"]
            assert triton.calls[0][1] != triton.calls[1][1]


def test_a_vmm_pool_tensor_is_refused_naming_the_pool_kind_triton_needs():
    """VMM segments (the default) have no cudaIpcMemHandle to register: the feeder says which
    flag makes a pool Triton can use, before anything reaches Triton."""
    d = two_device_daemon("triton-vmm", FAKE)
    try:
        with tensorshm.connect(d.socket) as client:
            w = client.create((16,), "float32", device="cuda:1")
            Driver().to_device(1, w._data_ptr, np.ones(16, np.float32))
            w.publish("v", replace=True)
            triton = RecordingTriton()
            with client.get("v") as x, TritonFeeder(triton, client) as feed:
                assert x.segment_place()["ipc_handle"] == b""
                with pytest.raises(tensorshm.FailedPreconditionError,
                                   match="--cuda-pool-kind ipc"):
                    feed.infer("m", [feed.input("x", x)])
                assert triton.calls == []
    finally:
        assert d.stop() == 0
