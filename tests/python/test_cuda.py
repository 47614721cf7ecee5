"""CUDA tensors from Python against the emulated driver (tests/support/fake_cuda): create on a
device, put a CUDA tensor, get it zero-copy as kDLCUDA in another process, the DLPack stream rules,
and host copies. Device memory is filled and read back only through driver calls."""

from __future__ import annotations

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

KDLCPU, KDLCUDA = 1, 2


@pytest.fixture(scope="module")
def daemon():
    d = two_device_daemon("cuda", FAKE)
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def driver() -> Driver:
    return Driver()


@pytest.fixture(autouse=True)
def busy_gpu(monkeypatch):
    """The emulated GPU reports every recorded event unfinished (its producer's kernels still
    running), so that acquirers wait on it as asked instead of finding it done; tests of what a
    finished event allows set TSM_FAKE_CUDA_BUSY_QUERIES=0."""
    monkeypatch.setenv("TSM_FAKE_CUDA_BUSY_QUERIES", "1000000")


PRODUCER = """
import sys, ctypes, numpy as np, tensorshm
sys.path.insert(0, sys.argv[2])
from fake_cuda import Driver
client = tensorshm.connect(sys.argv[1])
w = client.create((64, 100), "float32", device="cuda:1")
assert w.__dlpack_device__() == (2, 1), w.__dlpack_device__()
data = np.arange(6400, dtype=np.float32).reshape(64, 100) * 0.5
Driver().to_device(1, w._data_ptr, data)
w.publish("gpu/a")
print("published", flush=True)
sys.stdin.read()   # stays until the test closes stdin: the ready event lives here
"""


def test_cuda_tensor_from_another_process(daemon, driver):
    env = {**os.environ, "TSM_FAKE_CUDA_VISIBLE": "0,1"}  # the producer sees them in order
    producer = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, daemon.socket, str(pathlib.Path(__file__).parent)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env)
    try:
        assert producer.stdout.readline().strip() == "published", producer.stdout.read()
        client = tensorshm.connect(daemon.socket)
        expected = np.arange(6400, dtype=np.float32).reshape(64, 100) * 0.5
        before = driver.counters()
        t = client.get("gpu/a")
        # Physical device 1 is this process's cuda:0.
        assert t.__dlpack_device__() == (KDLCUDA, 0)
        assert t.device == "cuda:0" and t.read_only
        raw = driver.from_device(0, t._data_ptr, expected.nbytes)
        assert raw == expected.tobytes()
        # __dlpack__ with the default stream waits on the ready event on that stream.
        capsule = t.__dlpack__(max_version=(1, 3))
        after = driver.counters()
        assert after["stream_wait_event"] == before["stream_wait_event"] + 1
        assert after["waits_on_recorded"] == before["waits_on_recorded"] + 1
        # The VMM segment's descriptor came over the memory channel and was imported once.
        assert after["vmm_import"] == before["vmm_import"] + 1
        assert after["ipc_open_calls"] == before["ipc_open_calls"]
        del capsule
        # A second get from the same segment imports and maps nothing.
        t2 = client.get("gpu/a")
        assert driver.counters()["vmm_import"] == after["vmm_import"]
        assert driver.counters()["vmm_map"] == after["vmm_map"]
        # A host copy through DLPack: numpy asks for dl_device=(1, 0) with copy=True.
        host = np.from_dlpack(t2, device="cpu", copy=True)
        np.testing.assert_array_equal(host, expected)
        assert driver.counters()["event_synchronize"] == before["event_synchronize"] + 1
        del t, t2, host
        client.flush()
        assert client.stat()["leases"] == 1   # the producer's published WritableTensor's own
    finally:
        producer.stdin.close()
        producer.wait(timeout=30)


def test_dlpack_stream_rules(client, driver):
    w = client.create((8,), "int32", device="cuda:0")
    driver.to_device(0, w._data_ptr, np.arange(8, dtype=np.int32))
    w.publish("gpu/streams", replace=True)
    t = client.get("gpu/streams")
    with pytest.raises(ValueError, match="stream = 0: ambiguous"):
        t.__dlpack__(max_version=(1, 3), stream=0)
    before = driver.counters()["stream_wait_event"]
    t.__dlpack__(max_version=(1, 3), stream=-1)          # no synchronisation asked
    assert driver.counters()["stream_wait_event"] == before
    t.__dlpack__(max_version=(1, 3), stream=2)           # the per-thread default stream waits
    t.__dlpack__(max_version=(1, 3))                     # None: the legacy default stream
    assert driver.counters()["stream_wait_event"] == before + 2
    with pytest.raises(BufferError, match="host copy only"):
        t.__dlpack__(max_version=(1, 3), copy=True)
    with pytest.raises(BufferError, match="copy=False forbids"):
        t.__dlpack__(max_version=(1, 3), dl_device=(KDLCPU, 0), copy=False)
    host = client.put("host/plain", np.zeros(3, np.float32), replace=True)
    with pytest.raises(ValueError, match="CPU tensors take stream=None"):
        host.__dlpack__(max_version=(1, 3), stream=1)
    # Host memory views of device tensors are refused clearly.
    with pytest.raises(BufferError, match="not in host memory"):
        memoryview(t)


def test_segment_place_of_an_acquired_cuda_tensor_waits_for_its_producer(client, driver):
    """Triton and NIXL read a tensor's segment outside our streams: the place is handed out only
    after the producer's ready event, waited on by the host; a writable buffer has none to wait
    on."""
    w = client.create((16,), "float32", device="cuda:0")
    driver.to_device(0, w._data_ptr, np.ones(16, np.float32))
    before = driver.counters()["event_synchronize"]
    assert w.segment_place()["device"] == "cuda"
    assert driver.counters()["event_synchronize"] == before
    w.publish("gpu/place", replace=True)
    with client.get("gpu/place") as t:
        place = t.segment_place()
        assert driver.counters()["event_synchronize"] == before + 1
        assert place["address"] == t._data_ptr  # the device pointer of the first byte


def test_put_copies_a_cuda_tensor_on_the_device(client, driver):
    data = np.linspace(0, 1, 1000, dtype=np.float64)
    w = client.create((1000,), "float64", device="cuda:1")
    driver.to_device(1, w._data_ptr, data)
    w.publish("gpu/source", replace=True)
    source = client.get("gpu/source")
    before = driver.counters()
    copy = client.put("gpu/copy", source, replace=True)   # through our own exchange API
    after = driver.counters()
    assert after["memcpy_dtod"] == before["memcpy_dtod"] + 1
    assert after["memcpy_htod"] == before["memcpy_htod"] and after["memcpy_dtoh"] == \
        before["memcpy_dtoh"]
    assert after["event_record"] == before["event_record"] + 1   # its own ready event
    assert copy.__dlpack_device__() == (KDLCUDA, 1)
    assert copy._data_ptr != source._data_ptr
    assert driver.from_device(1, copy._data_ptr, data.nbytes) == data.tobytes()
    used = {p["device"]: p["used_bytes"] for p in client.stat()["pools"]}
    # The daemon numbers the devices the other way round: this process's cuda:1 is its cuda:0.
    assert used["cuda:0"] >= 2 * data.nbytes


def test_bad_devices_are_refused_with_the_reason(client):
    with pytest.raises(tensorshm.InvalidArgumentError, match="cuda:5"):
        client.create((4,), "float32", device="cuda:5")
    with pytest.raises(tensorshm.InvalidArgumentError, match='device = "gpu"'):
        client.create((4,), "float32", device="gpu")


def _fnv1a(data: bytes) -> int:
    """The storage hash tsm_peer prints (FNV-1a, 64 bit)."""
    h = 0xcbf29ce484222325
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


PEER = os.environ.get("TSM_PEER", str(pathlib.Path(FAKE).parent / "tsm_peer"))


def test_cpp_and_python_processes_exchange_cuda_tensors(daemon, client, driver):
    env = {**os.environ, "TSM_FAKE_CUDA_VISIBLE": "0,1"}   # the peer sees the devices in order
    # C++ producer -> this Python process. The peer's cuda:1 is physical 1, our cuda:0.
    producer = subprocess.Popen(
        [PEER, "cuda-produce", daemon.socket, "gpu/from-cpp", "--device", "1", "--dtype", "int16",
         "--shape", "50,60", "--seed", "9"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        while not lines or lines[-1] != "published":
            line = producer.stdout.readline()
            assert line, "tsm_peer exited: " + "\n".join(lines)
            lines.append(line.strip())
        storage_hash = int(next(l for l in lines if l.startswith("checksum")).split()[1])
        t = client.get("gpu/from-cpp")
        assert t.__dlpack_device__() == (KDLCUDA, 0) and t.shape == (50, 60) and t.dtype == "int16"
        assert _fnv1a(np.from_dlpack(t, device="cpu", copy=True).tobytes()) == storage_hash
        del t
    finally:
        producer.terminate()
        producer.wait(timeout=30)
    # This Python process -> a C++ consumer, which sees our cuda:0 as its cuda:1.
    data = (np.arange(3000, dtype=np.int64) * 7919) % 1000003
    w = client.create((3000,), "int64", device="cuda:0")
    driver.to_device(0, w._data_ptr, data)
    w.publish("gpu/from-python", replace=True)
    consumer = subprocess.run([PEER, "cuda-consume", daemon.socket, "gpu/from-python"],
                              capture_output=True, text=True, env=env, timeout=60)
    assert consumer.returncode == 0, consumer.stdout + consumer.stderr
    assert "device cuda:1 flags 1" in consumer.stdout, consumer.stdout
    checksums = [l.split()[1] for l in consumer.stdout.splitlines() if l.startswith("checksum")]
    assert checksums == [str(_fnv1a(data.tobytes()))] * 2, consumer.stdout


WRITER = """
import ctypes, sys, tensorshm
client = tensorshm.connect(sys.argv[1])
t = client.get("gpu/sealed")
print("got", flush=True)
ctypes.memset(t._data_ptr, 0x5A, 16)   # the emulated device's memory is this process's
print("wrote", flush=True)
"""


def test_consumers_map_published_cuda_tensors_read_only(daemon, client, driver, monkeypatch):
    """A consumer's mapping of a VMM segment is read-only: a driver write through it is refused
    (the context stays usable) and a direct store kills the writing process with SIGSEGV, as a
    real GPU refuses the write; the bytes stay the producer's."""
    monkeypatch.setenv("TSM_FAKE_CUDA_BUSY_QUERIES", "0")
    data = np.arange(256, dtype=np.int32)
    w = client.create((256,), "int32", device="cuda:0")
    driver.to_device(0, w._data_ptr, data)
    w.publish("gpu/sealed", replace=True)
    t = client.get("gpu/sealed")
    assert t.read_only
    assert driver.memset(0, t._data_ptr, 0xFF, data.nbytes) == 1  # CUDA_ERROR_INVALID_VALUE
    assert driver.from_device(0, t._data_ptr, data.nbytes) == data.tobytes()
    writer = subprocess.run([sys.executable, "-c", WRITER, daemon.socket], capture_output=True,
                            text=True, timeout=60, env={**os.environ,
                                                        "TENSORSHM_SEGV_REPORT": "0"})
    assert writer.stdout.split() == ["got"], writer.stdout + writer.stderr
    assert writer.returncode == -11, writer.stderr  # SIGSEGV
    assert driver.from_device(0, t._data_ptr, data.nbytes) == data.tobytes()
    del t


def test_the_producers_writable_mapping_ends_at_publish(client, driver, monkeypatch):
    """A producer writes its CUDA buffer until the publish; then the same pointer is read-only,
    the bytes stay readable. A buffer's pieces (whole granules) stay writable while another
    unpublished buffer of this process lies in them, and are sealed with the last."""
    monkeypatch.setenv("TSM_FAKE_CUDA_BUSY_QUERIES", "0")
    a = client.create((64,), "uint8", device="cuda:0")
    b = client.create((64,), "uint8", device="cuda:0")
    pa, pb = a._data_ptr, b._data_ptr
    assert driver.memset(0, pa, 1, 64) == 0 and driver.memset(0, pb, 2, 64) == 0
    a.publish("gpu/sealed-a", replace=True)
    # b, unpublished, shares a's granule: both are still writable here.
    assert driver.memset(0, pb, 3, 64) == 0
    b.publish("gpu/sealed-b", replace=True)
    assert driver.memset(0, pa, 9, 64) == 1
    assert driver.memset(0, pb, 9, 64) == 1
    assert driver.from_device(0, pa, 64) == bytes([1]) * 64
    assert driver.from_device(0, pb, 64) == bytes([3]) * 64
    # A buffer given up unpublished is sealed too, and a new one in the same place is writable.
    c = client.create((64,), "uint8", device="cuda:0")
    pc = c._data_ptr
    assert driver.memset(0, pc, 4, 64) == 0
    del c
    client.flush()
    assert driver.memset(0, pc, 5, 64) == 1
    d = client.create((64,), "uint8", device="cuda:0")
    assert driver.memset(0, d._data_ptr, 6, 64) == 0
    del d


def test_the_seal_waits_for_the_producers_kernels(client, driver, monkeypatch):
    """Kernels still writing a buffer at its publish are not cut off: the seal waits for the
    ready event and is done by a later CUDA call of the client once the event has completed."""
    w = client.create((64,), "uint8", device="cuda:0")
    p = w._data_ptr
    w.publish("gpu/seal-later", replace=True)  # the GPU is busy (busy_gpu): the seal waits
    assert driver.memset(0, p, 1, 64) == 0     # the "kernel" may still write
    client.create((8,), "uint8", device="cuda:0")  # a CUDA call: still unfinished
    assert driver.memset(0, p, 2, 64) == 0
    monkeypatch.setenv("TSM_FAKE_CUDA_BUSY_QUERIES", "0")  # the kernels are done
    client.create((8,), "uint8", device="cuda:0")  # the next call seals
    assert driver.memset(0, p, 3, 64) == 1
    assert driver.from_device(0, p, 64) == bytes([2]) * 64


FAST_PRODUCER = """
import sys, numpy as np, tensorshm
sys.path.insert(0, sys.argv[2])
from fake_cuda import Driver
client = tensorshm.connect(sys.argv[1])
w = client.create((1024,), "uint8", device="cuda:0")
Driver().to_device(0, w._data_ptr, np.full(1024, 9, np.uint8))
w.publish("gpu/fast", replace=True)
print("published", flush=True)
sys.stdin.read()
"""


def test_warm_cuda_gets_are_answered_from_shared_memory(daemon, driver, monkeypatch):
    """After the first get of a CUDA tensor (which maps its segment), later gets take a lease
    slot in shared memory, as host gets do: no RPC, no new mapping, the producer's ready event
    opened once and, once finished, not waited on again."""
    producer = subprocess.Popen(
        [sys.executable, "-c", FAST_PRODUCER, daemon.socket, str(pathlib.Path(__file__).parent)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TSM_FAKE_CUDA_VISIBLE": "0,1", "TSM_FAKE_CUDA_BUSY_QUERIES": "0"})
    try:
        assert producer.stdout.readline().strip() == "published", producer.stdout.read()
        monkeypatch.setenv("TSM_FAKE_CUDA_BUSY_QUERIES", "0")
        with tensorshm.connect(daemon.socket, client_name="warm-cuda") as client:
            first = client.get("gpu/fast")
            assert first.device == "cuda:1"  # the producer's cuda:0, seen swapped here
            assert driver.from_device(1, first._data_ptr, 1024) == bytes([9]) * 1024
            before = driver.counters()
            held = [client.get("gpu/fast") for _ in range(10)]
            for t in held:
                assert t._data_ptr == first._data_ptr and t.device == "cuda:1" and t.read_only
                t.__dlpack__(max_version=(1, 3))  # waits on the ready event as asked
            after = driver.counters()
            own = [s for s in client.sessions() if s["own"]]
            assert own[0]["page_leases"] == 10 and own[0]["rpc_leases"] == 1, own
            assert after["vmm_import"] == before["vmm_import"]
            assert after["vmm_map"] == before["vmm_map"]
            assert after["ipc_open_event_handle"] - before["ipc_open_event_handle"] <= 1
            assert after["event_query"] - before["event_query"] == 10
            assert after["stream_wait_event"] == before["stream_wait_event"]  # it had finished
            for t in held:
                t.release()
            first.release()
            client.flush()
            own = [s for s in client.sessions() if s["own"]]
            assert own[0]["page_leases"] == 0 and own[0]["rpc_leases"] == 0, own
    finally:
        producer.stdin.close()
        producer.wait(timeout=30)
