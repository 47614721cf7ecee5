"""put()s that wait for memory in a full pool let go of the GIL and can be woken, whichever way
the producer exports: torch through the DLPack C exchange API, numpy arrays of ml_dtypes types
through a view of a created tensor. Whether a put waits is read from stat()["creates_waiting"]."""

from __future__ import annotations

import asyncio
import threading

import ml_dtypes
import numpy as np
import pytest

import tensorshm
from conftest import in_thread, wait_for

MIB = 1 << 20


@pytest.fixture
def full(small_daemon):
    """small_daemon's one 4 MiB segment taken by a leased tensor, and a client."""
    client = tensorshm.connect(small_daemon.socket)
    hog = client.put("hog", np.zeros(4 * MIB, np.uint8))
    yield small_daemon, client
    hog.release()
    client.close()


def test_a_waiting_torch_put_lets_other_threads_run(full):
    torch = pytest.importorskip("torch", reason="torch is not installed in .venv (make test-ecosystem installs it)")
    _, client = full
    ticks = 0
    stop = threading.Event()

    def tick():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            stop.wait(0.001)

    # Bounded, so that a put holding the GIL fails the test (ResourceExhaustedError after 20 s,
    # no tick meanwhile) instead of hanging it.
    thread, outcome = in_thread(lambda: client.put("t", torch.ones(MIB // 2), timeout=20))
    assert wait_for(lambda: client.stat()["creates_waiting"] == 1)
    ticker = threading.Thread(target=tick)
    ticker.start()
    # The ticker runs while the put waits in the daemon: the put does not hold the GIL.
    assert wait_for(lambda: ticks >= 20)
    assert thread.is_alive() and client.stat()["creates_waiting"] == 1
    stop.set()
    ticker.join()
    client.close()  # wakes it
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), tensorshm.ClosedError), outcome


def test_cancelling_an_aput_of_an_ml_dtypes_array_is_prompt(full):
    _, client = full
    source = np.ones(MIB, dtype=ml_dtypes.bfloat16)  # numpy's __dlpack__ refuses bfloat16

    async def main():
        task = asyncio.ensure_future(client.aput("b", source, timeout=None))
        while client.stat()["creates_waiting"] == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return "cancelled"

    # Bounded: an uncancellable wait would block the loop's thread until memory comes (never).
    thread, outcome = in_thread(lambda: asyncio.run(main()))
    thread.join(timeout=60)
    assert not thread.is_alive(), "the cancelled aput kept waiting for memory"
    assert outcome == {"value": "cancelled"}, outcome
    # The daemon drops the waiting create once the cancelled call reaches it.
    assert wait_for(lambda: client.stat()["creates_waiting"] == 0)
    assert "b" not in client


def test_aget_of_a_published_host_tensor_needs_no_worker_thread(full, monkeypatch):
    _, client = full
    started = []
    real_start = threading.Thread.start

    def counting_start(self):
        started.append(self.name)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", counting_start)

    async def main():
        ready = await client.aget("hog")  # published: the fast path answers on the loop
        assert ready.shape == (4 * MIB,) and ready.name == "hog"
        with pytest.raises(tensorshm.NotFoundError):
            await client.aget("not-yet")  # timeout 0: the worker answers NOT_FOUND
        return started

    assert asyncio.run(main()) == ["tensorshm-async"]
