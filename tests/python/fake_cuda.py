"""The emulated CUDA driver (tests/support/fake_cuda) from Python: its counters, and host<->device
copies through its driver calls. Importing this changes nothing; tests set the environment."""

from __future__ import annotations

import ctypes
import os
import pathlib

import numpy as np
import pytest

KDLCPU, KDLCUDA = 1, 2
COUNTERS = ["mem_alloc", "mem_free", "ipc_get_mem_handle", "ipc_open_calls", "ipc_open_mappings",
            "ipc_close_calls", "ipc_unmappings", "event_create", "event_record",
            "ipc_get_event_handle", "ipc_open_event_handle", "stream_wait_event",
            "waits_on_recorded", "event_synchronize", "memcpy_htod", "memcpy_dtoh", "memcpy_dtod",
            "primary_ctx_retain", "primary_ctx_release", "vmm_import", "vmm_map",
            "vmm_set_access", "event_query"]


def use_emulated_driver() -> str:
    """Points this process at the emulated driver ($TSM_FAKE_CUDA_LIB, else the build's): 2
    devices, seen swapped here, in order by the daemon (two_device_daemon). Call it before
    anything in the process loads the driver (tensorshm loads it on first CUDA use). Fails the
    calling test module when the driver is not built. Returns the library's path."""
    root = pathlib.Path(__file__).resolve().parents[2]
    fake = os.environ.get("TSM_FAKE_CUDA_LIB", str(root / "build" / "tests" / "libtsm_fake_cuda.so"))
    if not os.path.exists(fake):
        pytest.fail(f"emulated CUDA driver not built at {fake} (make build, or set "
                    "TSM_FAKE_CUDA_LIB)", pytrace=False)
    os.environ.update({"TENSORSHM_LIBCUDA": fake, "TSM_FAKE_CUDA_DEVICES": "2",
                       "TSM_FAKE_CUDA_VISIBLE": "1,0"})
    return fake


class _Counters(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in COUNTERS]


class Driver:
    """The driver calls a test needs, through the same library tensorshm loaded."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(os.environ["TENSORSHM_LIBCUDA"])
        self.lib.tsm_fake_cuda_counters.restype = ctypes.POINTER(_Counters)
        assert self.lib.cuInit(0) == 0

    def counters(self) -> dict[str, int]:
        c = self.lib.tsm_fake_cuda_counters().contents
        return {name: getattr(c, name) for name in COUNTERS}

    def _copy(self, ordinal: int, fn, *args) -> None:
        assert self._call(ordinal, fn, *args) == 0

    def _call(self, ordinal: int, fn, *args) -> int:
        """fn(*args) in device `ordinal`'s primary context; its CUresult."""
        device, context = ctypes.c_int(), ctypes.c_void_p()
        assert self.lib.cuDeviceGet(ctypes.byref(device), ordinal) == 0
        assert self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
        assert self.lib.cuCtxPushCurrent_v2(context) == 0
        try:
            return fn(*args)
        finally:
            assert self.lib.cuCtxPopCurrent_v2(ctypes.byref(context)) == 0
            assert self.lib.cuDevicePrimaryCtxRelease_v2(device) == 0

    def to_device(self, ordinal: int, pointer: int, data: np.ndarray) -> None:
        fn = self.lib.cuMemcpyHtoD_v2
        fn.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
        self._copy(ordinal, fn, pointer, data.ctypes.data, data.nbytes)

    def memset(self, ordinal: int, pointer: int, value: int, nbytes: int) -> int:
        """cuMemsetD8 through `pointer`: its CUresult (1, CUDA_ERROR_INVALID_VALUE, where this
        process may not write)."""
        fn = self.lib.cuMemsetD8_v2
        fn.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]
        return self._call(ordinal, fn, pointer, value, nbytes)

    def from_device(self, ordinal: int, pointer: int, nbytes: int) -> bytes:
        out = ctypes.create_string_buffer(nbytes)
        fn = self.lib.cuMemcpyDtoH_v2
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        self._copy(ordinal, fn, out, pointer, nbytes)
        return out.raw


def two_device_daemon(name: str, fake_lib: str, kind: str = "auto"):
    """A tensorshmd (conftest.Daemon) on the emulated driver's 2 devices, seen in order, with a
    16 MiB pool on each (`kind`: --cuda-pool-kind, auto making VMM pools): the daemon of the CUDA
    test modules."""
    from conftest import Daemon

    return Daemon(name, host_pool="16Mi",
                  extra_args=("--cuda-pool", "cuda:0=16Mi", "--cuda-pool", "cuda:1=16Mi",
                              "--cuda-pool-kind", kind),
                  env={"TENSORSHM_LIBCUDA": fake_lib, "TSM_FAKE_CUDA_DEVICES": "2",
                       "TSM_FAKE_CUDA_VISIBLE": "0,1"})

