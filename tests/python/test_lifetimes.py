"""Lifetimes are counted, not assumed: the daemon's lease count goes back to its baseline."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import tensorshm
from conftest import run_python, wait_for


def leases(client) -> int:
    client.flush()
    return client.stat()["leases"]


@pytest.fixture
def published(client):
    client.put("life/t", np.arange(1000, dtype=np.float64), replace=True)
    return "life/t"


def test_del_and_gc_give_the_lease_back(client, published):
    baseline = leases(client)
    tensors = [client.get(published) for _ in range(5)]
    arrays = [np.from_dlpack(t) for t in tensors]
    assert leases(client) == baseline + 5
    del tensors
    gc.collect()
    assert leases(client) == baseline + 5  # the numpy arrays still hold them
    del arrays
    gc.collect()
    assert leases(client) == baseline


def test_a_capsule_never_consumed_still_releases(client, published):
    baseline = leases(client)
    capsule = client.get(published).__dlpack__(max_version=(1, 3))
    gc.collect()
    assert leases(client) == baseline + 1
    del capsule
    assert leases(client) == baseline


def test_deleters_from_other_threads(client, published):
    baseline = leases(client)
    arrays = [np.from_dlpack(client.get(published)) for _ in range(64)]
    assert leases(client) == baseline + 64
    chunks = [arrays[i::8] for i in range(8)]
    del arrays

    def drop(chunk):
        while chunk:
            chunk.pop()

    threads = [threading.Thread(target=drop, args=(chunk,)) for chunk in chunks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    del chunks
    gc.collect()
    assert leases(client) == baseline


def test_tensors_outlive_their_client(daemon, published):
    other = tensorshm.connect(daemon.socket)
    observer = tensorshm.connect(daemon.socket)
    baseline = leases(observer)
    t = other.get(published)
    del other
    gc.collect()
    assert np.from_dlpack(t).sum() == np.arange(1000).sum()
    assert leases(observer) == baseline + 1
    del t
    assert wait_for(lambda: observer.stat()["leases"] == baseline)


EXIT_HOLDING = """
import sys, numpy as np, tensorshm
client = tensorshm.connect(sys.argv[1])
# Left for interpreter shutdown: a tensor, a numpy view, an unconsumed capsule, a writable
# tensor with a view, and a tensor whose client is gone.
t = client.get("life/t")
view = np.from_dlpack(client.get("life/t"))
capsule = client.get("life/t").__dlpack__(max_version=(1, 3))
w = client.create((100,), "int32")
wview = np.from_dlpack(w)
wview[:] = 1
print("holding", flush=True)
"""


def test_interpreter_exit_with_live_tensors_is_clean(client, published):
    baseline_leases = leases(client)
    used = client.stat()["pools"][0]["used_bytes"]
    result = run_python(EXIT_HOLDING, client_socket(client))
    assert result.returncode == 0, result.stderr
    assert "holding" in result.stdout
    assert wait_for(lambda: client.stat()["leases"] == baseline_leases)
    assert wait_for(lambda: client.stat()["pools"][0]["used_bytes"] == used)


def client_socket(client) -> str:
    import os

    return os.environ["TSM_TEST_SOCKET"]


@pytest.fixture(autouse=True)
def _socket_env(daemon, monkeypatch):
    monkeypatch.setenv("TSM_TEST_SOCKET", daemon.socket)


def test_writable_view_outlives_publish_and_delete(client):
    baseline = leases(client)
    w = client.create((256,), "uint8")
    view = np.from_dlpack(w)
    view[:] = 9
    w.publish("life/w", replace=True)
    del w
    client.delete("life/w")
    gc.collect()
    # The view still holds the lease taken at publish, so the buffer cannot be reused under it.
    assert leases(client) == baseline + 1
    assert int(view.sum()) == 9 * 256
    del view
    gc.collect()
    assert leases(client) == baseline
