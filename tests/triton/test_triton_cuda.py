"""CUDA tensors through Triton's CUDA shared-memory extension, against the emulated driver
(tests/support/fake_cuda): what the feeder registers (the segment's IPC handle, base64, the
segment's size, Triton's device ordinal) and each input's (region, offset, length). A separate
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
    """A tritonclient HTTP client whose CUDA region calls are recorded, not sent."""

    def __init__(self) -> None:
        super().__init__("127.0.0.1:9")
        self.calls: list[tuple] = []

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
    d = two_device_daemon("triton-cuda", FAKE)
    yield d
    assert d.stop() == 0


def test_cuda_input_registers_the_segment_handle_and_reaches_the_bytes(daemon):
    data = np.arange(3000, dtype=np.float32) * 1.5
    with tensorshm.connect(daemon.socket) as client:
        w = client.create((3000,), "float32", device="cuda:1")  # the daemon's device 0
        Driver().to_device(1, w._data_ptr, data)
        w.publish("g", replace=True)
        triton = RecordingTriton()
        with client.get("g") as x, TritonFeeder(triton, client, cuda_device_ids={1: 0}) as feed:
            place = x._segment_place()
            assert place["device"] == "cuda" and place["device_id"] == 1
            assert len(place["ipc_handle"]) == 64
            infer_input = feed.input("x", x)
            feed.input("x2", x)  # the same segment: registered once
            region = feed.regions[("cuda", 1, place["segment_instance"], place["segment_id"])]
            assert region.endswith(f".cuda1.{place['segment_id']}")
            assert triton.calls == [("register", region, base64.b64encode(place["ipc_handle"]),
                                     0, place["segment_size"])]
            assert shm_parameters(infer_input) == (region, data.nbytes, place["offset"])
            # Triton's process sees the devices in order, as the daemon does (its ordinal 0).
            read = subprocess.run(
                [sys.executable, "-c", READER, base64.b64encode(place["ipc_handle"]).decode(), "0",
                 str(place["offset"]), str(data.nbytes)],
                capture_output=True, text=True, timeout=60,
                env={**os.environ, "TSM_FAKE_CUDA_VISIBLE": "0,1"})
            assert read.returncode == 0, read.stderr
            assert bytes.fromhex(read.stdout) == data.tobytes()
        assert triton.calls[-1] == ("unregister", region)


def test_cuda_output_is_a_region_of_the_writable_buffers_segment(daemon):
    with tensorshm.connect(daemon.socket) as client:
        y = client.create((64, 4), "float32", device="cuda:0")  # the daemon's device 1
        triton = RecordingTriton()
        with TritonFeeder(triton, client) as feed:
            requested = feed.output("y", y)
            place = y._segment_place()
            region = feed.regions[("cuda", 0, place["segment_instance"], place["segment_id"])]
            assert triton.calls[0][3] == 0  # this process's ordinal, unmapped
            assert shm_parameters(requested) == (region, 64 * 4 * 4, place["offset"])
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
            feed.input("h", h)
            feed.output("w", w)
            hp, wp = h._segment_place(), w._segment_place()
            assert (hp["segment_instance"], hp["segment_id"]) == (
                wp["segment_instance"], wp["segment_id"])  # the case this test is about
            assert [call[0] for call in triton.calls] == ["register_system", "register"]
            assert len(set(feed.regions.values())) == 2
