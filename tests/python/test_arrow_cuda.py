"""CUDA tensors through the Arrow C Device Data Interface, against the emulated driver
(tests/support/fake_cuda): __arrow_c_device_array__ says ARROW_DEVICE_CUDA, this process's
device id and the ready event as sync_event (opened once per lease, from another process's IPC
handle or the event this process recorded); __arrow_c_array__ refuses device memory; put() copies a
CUDA Arrow array device to device after its sync_event."""

from __future__ import annotations

import ctypes
import gc
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import tensorshm

from fake_cuda import Driver, two_device_daemon, use_emulated_driver

# 2 devices, seen swapped here and in order by the daemon.
FAKE = use_emulated_driver()

ARROW_DEVICE_CUDA = 2


class DeviceArray(ctypes.Structure):
    """struct ArrowDeviceArray, after its ArrowArray (10 pointer-sized fields)."""

    _fields_ = [("array", ctypes.c_int64 * 10), ("device_id", ctypes.c_int64),
                ("device_type", ctypes.c_int32), ("sync_event", ctypes.c_void_p),
                ("reserved", ctypes.c_int64 * 3)]


def device_array(capsule) -> DeviceArray:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return DeviceArray.from_address(get(capsule, b"arrow_device_array"))


class DeviceArrow:
    """A producer of Arrow device arrays without DLPack (put() takes its Arrow path)."""

    def __init__(self, array) -> None:
        self.array = array

    def __arrow_c_device_array__(self, requested_schema=None, **kwargs):
        return self.array.__arrow_c_device_array__(requested_schema, **kwargs)


@pytest.fixture(scope="module")
def daemon():
    d = two_device_daemon("arrow-cuda", FAKE)
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def driver() -> Driver:
    return Driver()


def leases(client) -> int:
    client.flush()
    return client.stat()["leases"]


def test_device_array_of_a_cuda_tensor_carries_the_ready_event(client, driver):
    data = np.arange(12, dtype=np.float32).reshape(4, 3)
    w = client.create((4, 3), "float32", device="cuda:1")
    driver.to_device(1, w._data_ptr, data)
    w.publish("arrow-gpu/own", replace=True)
    baseline = leases(client)
    t = client.get("arrow-gpu/own")
    with pytest.raises(tensorshm.InvalidArgumentError,
                       match=r"is on cuda:1: __arrow_c_array__ exports host memory only; use "
                             r"__arrow_c_device_array__"):
        t.__arrow_c_array__()
    schema, capsule = t.__arrow_c_device_array__()
    raw = device_array(capsule)
    assert raw.device_type == ARROW_DEVICE_CUDA and raw.device_id == 1
    assert raw.sync_event is not None
    event = ctypes.c_void_p.from_address(raw.sync_event).value
    assert event  # a CUevent*: the event this process recorded at publish, as it is
    # A second export hands out the same event (opened once per lease).
    again = device_array(t.__arrow_c_device_array__()[1])
    assert again.sync_event == raw.sync_event
    # The capsules hold the lease after the tensor is gone.
    del t, again
    gc.collect()
    assert leases(client) == baseline + 1
    del schema, capsule, raw
    gc.collect()
    assert leases(client) == baseline


def test_put_of_a_cuda_device_array_waits_for_its_sync_event(client, driver):
    data = np.linspace(0, 1, 256, dtype=np.float64).reshape(64, 4)
    w = client.create((64, 4), "float64", device="cuda:0")
    driver.to_device(0, w._data_ptr, data)
    w.publish("arrow-gpu/src", replace=True)
    source = client.get("arrow-gpu/src")
    before = driver.counters()
    copy = client.put("arrow-gpu/copy", DeviceArrow(source), replace=True)
    after = driver.counters()
    assert after["stream_wait_event"] == before["stream_wait_event"] + 1
    assert after["waits_on_recorded"] == before["waits_on_recorded"] + 1
    assert after["memcpy_dtod"] == before["memcpy_dtod"] + 1
    assert after["memcpy_dtoh"] == before["memcpy_dtoh"]
    assert copy.__dlpack_device__() == (2, 0) and copy.shape == (64, 4)
    assert copy._data_ptr != source._data_ptr
    assert driver.from_device(0, copy._data_ptr, data.nbytes) == data.tobytes()


PRODUCER = """
import sys, numpy as np, tensorshm
sys.path.insert(0, sys.argv[2])
from fake_cuda import Driver
client = tensorshm.connect(sys.argv[1])
w = client.create((8, 2), "int32", device="cuda:1")
Driver().to_device(1, w._data_ptr, np.arange(16, dtype=np.int32).reshape(8, 2))
w.publish("arrow-gpu/remote")
print("published", flush=True)
sys.stdin.read()   # stays until the test closes stdin: the ready event lives here
"""


def test_another_process_ready_event_is_opened_once_per_lease(daemon, client, driver):
    env = {**os.environ, "TSM_FAKE_CUDA_VISIBLE": "0,1"}  # the producer sees them in order
    producer = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, daemon.socket, str(pathlib.Path(__file__).parent)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env)
    try:
        assert producer.stdout.readline().strip() == "published", producer.stdout.read()
        t = client.get("arrow-gpu/remote")
        before = driver.counters()
        raw = device_array(t.__arrow_c_device_array__()[1])
        # Physical device 1 is this process's cuda:0.
        assert raw.device_type == ARROW_DEVICE_CUDA and raw.device_id == 0
        assert ctypes.c_void_p.from_address(raw.sync_event).value
        device_array(t.__arrow_c_device_array__()[1])
        after = driver.counters()
        assert after["ipc_open_event_handle"] == before["ipc_open_event_handle"] + 1
        copy = client.put("arrow-gpu/remote-copy", DeviceArrow(t), replace=True)
        assert driver.counters()["stream_wait_event"] == after["stream_wait_event"] + 1
        assert driver.from_device(0, copy._data_ptr, 64) == \
            np.arange(16, dtype=np.int32).tobytes()
        del t, raw, copy
        gc.collect()
    finally:
        producer.stdin.close()
        producer.wait(timeout=30)
