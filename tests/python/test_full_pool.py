"""Full pools from Python: create(..., timeout=) and put(..., timeout=) wait in the daemon for
memory to be freed; whether they wait is read from stat()["creates_waiting"], not the clock."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import tensorshm
from conftest import in_thread, wait_for

MIB = 1 << 20


def test_create_with_timeout_waits_and_succeeds_when_a_lease_ends(small_daemon):
    holder = tensorshm.connect(small_daemon.socket, client_name="holder")
    producer = tensorshm.connect(small_daemon.socket, client_name="producer")
    fill = holder.put("fill", np.zeros(4 * MIB, dtype=np.uint8))  # leased by `holder`
    holder.delete("fill")  # unbound; the lease keeps the memory

    with pytest.raises(tensorshm.ResourceExhaustedError):
        producer.create((MIB,), "uint8")  # timeout=0: at once, as before
    assert holder.stat()["creates_waiting"] == 0

    thread, outcome = in_thread(lambda: producer.create((MIB,), "uint8", timeout=60))
    assert wait_for(lambda: holder.stat()["creates_waiting"] == 1)
    assert not outcome  # still waiting: the pool is still full
    del fill  # the lease ends: the memory is freed
    holder.flush()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert "error" not in outcome, outcome
    w = outcome["value"]
    assert w.nbytes == MIB
    np.from_dlpack(w)[:] = 7
    w.publish("made")
    stats = holder.stat()
    assert stats["creates_waiting"] == 0
    assert stats["pools"][0]["used_bytes"] == MIB
    assert stats["evicted_tensors"] == 0 and stats["evicted_bytes"] == 0
    assert stats["names"] == 1


def test_create_timeout_passes_with_resource_exhausted(small_daemon):
    client = tensorshm.connect(small_daemon.socket, client_name="pytest")
    fill = client.put("fill", np.zeros(4 * MIB, dtype=np.uint8))
    with pytest.raises(tensorshm.ResourceExhaustedError, match=r"waited .* \(wait_ms = 200\)"):
        client.create((MIB,), "uint8", timeout=0.2)
    assert isinstance(fill, tensorshm.Tensor)
    assert client.stat()["creates_waiting"] == 0


def test_put_with_timeout_waits_for_a_delete(small_daemon):
    holder = tensorshm.connect(small_daemon.socket, client_name="holder")
    producer = tensorshm.connect(small_daemon.socket, client_name="producer")
    w = holder.create((4 * MIB,), "uint8")
    w.publish("fill")
    del w
    holder.flush()
    data = np.arange(MIB, dtype=np.uint8)
    thread, outcome = in_thread(lambda: producer.put("copy", data, timeout=None))
    assert wait_for(lambda: holder.stat()["creates_waiting"] == 1)
    assert not outcome
    holder.delete("fill")
    thread.join(timeout=60)
    assert "error" not in outcome, outcome
    assert np.array_equal(np.from_dlpack(holder.get("copy")), data)
