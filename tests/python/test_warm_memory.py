"""Warm memory (issue 20): producer buffers reused from freed space do not fault, what a new
buffer holds, and the API-level seal: a view of a writable tensor kept past its publish never
changes bytes that consumers read."""
import os
import resource
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tensorshm
from conftest import run_python


def _minflt() -> int:
    # Every thread of the process, the client's own threads included: a mapping the client made
    # is populated on its sender thread, and flush() returns once what was queued before is done.
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_reused_buffer_fills_without_page_faults(client):
    size = 1 << 20
    faults = []
    for i in range(12):
        w = client.create((size,), "uint8")
        view = np.from_dlpack(w)
        client.flush()  # what the create's answer queued for the sender thread (stock) is done
        before = _minflt()
        view.fill(i)  # the producer's writes: into pages populated when the buffer was handed out
        faults.append(_minflt() - before)
        del view
        w.publish("warm/reused", replace=True)
        del w
        client.delete("warm/reused")
        client.flush()
    # Every buffer was populated when handed out: no write faulted. (The first round is left
    # out: the interpreter's own first run of this loop may fault in its own memory.)
    assert faults[1:] == [0] * (len(faults) - 1), faults


def test_steady_state_put_faults_in_no_thread(client):
    """A put of a size seen before reuses a buffer its writable mapping has populated, and the
    lease put() returns reads it through the read-only mapping of the segment, which the client
    populated in the background once (flush() waits for that): no page fault in any thread."""
    array = np.full(1 << 20, 7, np.uint8)
    for _ in range(50):
        client.put("warm/steady", array, replace=True).release()
    client.flush()
    rounds = []
    for _ in range(3):
        before = _minflt()
        for _ in range(200):
            client.put("warm/steady", array, replace=True).release()
        rounds.append(_minflt() - before)
    assert rounds == [0, 0, 0], f"page faults per 200 puts of 1 MiB, in all threads: {rounds}"
    client.delete("warm/steady")


def test_new_buffer_holds_zeros_or_this_uids_leftovers(small_daemon):
    # A daemon of its own: no other test's leftovers.
    client = tensorshm.connect(small_daemon.socket)
    size = 256 << 10
    client.put("warm/leftover", np.full(size, 0x5A, np.uint8), replace=True)
    client.delete("warm/leftover")
    client.flush()
    for _ in range(4):
        w = client.create((size,), "uint8")
        values = set(np.unique(np.from_dlpack(w)).tolist())
        assert values <= {0, 0x5A}, values
        del w
    client.close()


VIEW_PAST_PUBLISH = """
import sys, numpy as np, tensorshm
client = tensorshm.connect(sys.argv[1])
w = client.create((4096,), "uint8")
view = np.from_dlpack(w)
view[:] = 7
w.publish("warm/sealed", replace=True)
print("published; view still says writeable:", view.flags.writeable, flush=True)
view[0] = 99
print("wrote through the view", flush=True)
"""


def test_view_kept_past_publish_cannot_change_what_consumers_read(client, daemon):
    result = run_python(VIEW_PAST_PUBLISH, daemon.socket)
    assert "published; view still says writeable: True" in result.stdout, result.stderr
    assert "wrote through the view" not in result.stdout
    assert result.returncode in (-11, 139), (result.returncode, result.stderr[-2000:])
    # The consumer reads what was published. (The producer died holding the tensor: it stays
    # bound to its name.)
    t = client.get("warm/sealed", timeout=10)
    assert np.all(np.from_dlpack(t) == 7)


REUSE_AFTER_SEAL = """
import sys, numpy as np, tensorshm
client = tensorshm.connect(sys.argv[1])
for round in range(3):
    w = client.create((1 << 20,), "uint8")
    view = np.from_dlpack(w)
    view[:] = round
    w.publish("warm/resealed", replace=True)   # the view is alive: the buffer is sealed
    del view, w                                # ... until the views and the lease go
    client.delete("warm/resealed")
    client.flush()
# The same process gets freed, once sealed, buffers again: writable.
for i in range(4):
    w = client.create((1 << 20,), "uint8")
    np.from_dlpack(w)[:] = 40 + i
    w.publish("warm/resealed", replace=True)
print("rewrote", flush=True)
"""


def test_a_sealed_buffer_is_writable_again_once_freed_and_handed_out(daemon, client):
    result = run_python(REUSE_AFTER_SEAL, daemon.socket)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rewrote" in result.stdout
    assert np.all(np.from_dlpack(client.get("warm/resealed", timeout=10)) == 43)


def test_published_tensor_hands_out_no_writable_pointer(client):
    w = client.create((16,), "float32")
    np.from_dlpack(w)[:] = 1.0
    w.publish("warm/api-sealed", replace=True)
    # Every export after publish is read-only: numpy, the buffer protocol.
    assert not np.from_dlpack(w).flags.writeable
    assert memoryview(w).readonly
    assert not np.from_dlpack(client.get("warm/api-sealed")).flags.writeable


def test_large_put_copies_every_byte(client):
    # Large contiguous puts are copied by several threads, in page-aligned parts: every byte,
    # the last part's odd tail included, must arrive (fixed seed).
    rng = np.random.default_rng(20)
    for nbytes in ((24 << 20) + 4095, 9 << 20):
        source = rng.integers(0, 256, nbytes, dtype=np.uint8)
        client.put("warm/large", source, replace=True)
        np.testing.assert_array_equal(np.from_dlpack(client.get("warm/large")), source)
    # And a 2-d float array, contiguous as a whole.
    matrix = rng.standard_normal((1024, 2048)).astype(np.float32)  # 8 MiB
    client.put("warm/matrix", matrix, replace=True)
    np.testing.assert_array_equal(np.from_dlpack(client.get("warm/matrix")), matrix)


PUBLISH_LATE = r"""
import sys, time, numpy as np, tensorshm
c = tensorshm.connect(sys.argv[1], client_name="late")
time.sleep(float(sys.argv[2]))
c.put("warm/late", np.arange(1024, dtype=np.int32)).release()
print("published", flush=True)
time.sleep(5)
"""


def test_get_waits_in_the_calling_thread_woken_by_the_publish(daemon, client):
    """A get(timeout=None) on the main thread waits on the fast path itself (no thread is started
    for the wait: its wake-up would add to the handoff), still gets the tensor another process
    publishes meanwhile, and a bounded get still times out saying what it waited for."""
    def tasks() -> int:
        return len(os.listdir("/proc/self/task"))

    seen, waiting, stop = [], threading.Event(), threading.Event()

    def sample() -> None:
        # Only samples taken while get() waits count: a thread another part of the process
        # (gRPC's pools) ends just before the wait is not one the wait started.
        while not stop.is_set():
            if waiting.is_set():
                seen.append(tasks())
            time.sleep(0.005)

    assert threading.current_thread() is threading.main_thread()
    producer = subprocess.Popen([sys.executable, "-c", PUBLISH_LATE, daemon.socket, "0.5"],
                                stdout=subprocess.PIPE, text=True)
    try:
        sampler = threading.Thread(target=sample)
        sampler.start()
        time.sleep(0.05)
        before = tasks()
        waiting.set()
        t = client.get("warm/late", timeout=None)
        stop.set()
        sampler.join()
        assert np.array_equal(np.from_dlpack(t), np.arange(1024, dtype=np.int32))
        t.release()
        assert len(seen) > 20, "the sampler did not run during the wait"
        assert max(seen) <= before, f"threads during the wait: {sorted(set(seen))}, before {before}"
    finally:
        producer.kill()
        producer.wait()
    with pytest.raises(TimeoutError, match=r'name = "warm/absent": not published within 200ms'):
        client.get("warm/absent", timeout=0.2)
