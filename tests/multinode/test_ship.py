"""Two movers, each in its own process on its own daemon, ship tensors between the daemons with
NIXL: every byte is checked on the destination by a separate consumer process, and a mover
killed mid-transfer or a daemon restart leaves nothing behind."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import tensorshm
from conftest import Daemon, Node, run_python, wait_for

# What each test ships, made the same way by the producer and the consumer.
CONSUMER = """
import sys, numpy as np, tensorshm
socket, name, kind = sys.argv[1:4]
with tensorshm.connect(socket) as c:
    t = c.get(name, timeout=10)
    got = np.from_dlpack(t)
    n = int(kind.split(":")[1]) if ":" in kind else 0
    if kind.startswith("bytes"):
        want = (np.arange(n, dtype=np.uint32) * 2654435761 % 251).astype(np.uint8)
    elif kind.startswith("f32"):
        want = np.arange(n, dtype=np.float32) * 0.5
    else:
        want = np.arange(64 * 64, dtype=np.int16).reshape(64, 64)[::2, ::2]
        assert t.strides == (128, 2), t.strides
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape)
    wrong = int(np.count_nonzero(got != want))
    print(f"{name}: {got.dtype}{list(got.shape)} strides {t.strides}, {wrong} wrong")
    sys.exit(1 if wrong else 0)
"""


def expected(kind: str) -> np.ndarray:
    n = int(kind.split(":")[1]) if ":" in kind else 0
    if kind.startswith("bytes"):
        return (np.arange(n, dtype=np.uint32) * 2654435761 % 251).astype(np.uint8)
    return np.arange(n, dtype=np.float32) * 0.5


def publish(client, name: str, kind: str) -> None:
    if kind == "strided":
        base = np.arange(64 * 64, dtype=np.int16).reshape(64, 64)
        w = client.create((32, 32), "int16", strides=(128, 2))
        np.from_dlpack(w)[...] = base[::2, ::2]
        w.publish(name)
        w.release()
    else:
        client.put(name, expected(kind)).release()


def consume(daemon, name: str, kind: str) -> str:
    run = run_python(CONSUMER, daemon.socket, name, kind)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout.strip()


def nothing_held(client) -> bool:
    """No lease and no unpublished buffer left in the daemon (its own client holds none)."""
    stat = client.stat()
    return stat["leases"] == 0 and stat["tensors"] == stat["names"]


SHIPS = [("tiny", "bytes:1024"), ("big", f"f32:{16 << 20}"), ("strided", "strided")]


@pytest.mark.parametrize("name,kind", SHIPS, ids=["1KiB", "64MiB", "strided"])
def test_pull_ships_every_byte_to_a_consumer_on_the_other_daemon(daemons, nodes, name, kind):
    (a, b), (node_a, node_b) = daemons, nodes
    with tensorshm.connect(a.socket) as ca, tensorshm.connect(b.socket) as cb:
        publish(ca, name, kind)
        answer = node_b.run(op="pull", peer=node_a.address, name=name, timeout=60)
        assert answer == {"ok": True, "result": name}
        print(consume(b, name, kind))
        assert wait_for(lambda: nothing_held(ca)), ca.stat()
        assert wait_for(lambda: nothing_held(cb)), cb.stat()


@pytest.mark.parametrize("name,kind", SHIPS, ids=["1KiB", "64MiB", "strided"])
def test_push_writes_into_a_buffer_the_destination_made(daemons, nodes, name, kind):
    (a, b), (node_a, node_b) = daemons, nodes
    with tensorshm.connect(a.socket) as ca, tensorshm.connect(b.socket) as cb:
        publish(ca, name, kind)
        answer = node_a.run(op="push", peer=node_b.address, name=name, **{"as": f"in/{name}"})
        assert answer == {"ok": True, "result": f"in/{name}"}
        print(consume(b, f"in/{name}", kind))
        assert name not in cb
        assert wait_for(lambda: nothing_held(ca)) and wait_for(lambda: nothing_held(cb))


def test_pull_prefix_ships_every_name_under_it(daemons, nodes):
    (a, b), (node_a, node_b) = daemons, nodes
    with tensorshm.connect(a.socket) as ca:
        for i in range(3):
            publish(ca, f"batch/{i}", f"bytes:{1000 + i}")
        publish(ca, "other", "bytes:10")
        answer = node_b.run(op="pull_prefix", peer=node_a.address, prefix="batch/", timeout=60)
        assert answer == {"ok": True, "result": ["batch/0", "batch/1", "batch/2"]}
        for i in range(3):
            consume(b, f"batch/{i}", f"bytes:{1000 + i}")
    with tensorshm.connect(b.socket) as cb:
        assert "other" not in cb


def test_a_name_not_published_is_not_found_naming_it(daemons, nodes):
    (a, b), (node_a, node_b) = daemons, nodes
    answer = node_b.run(op="pull", peer=node_a.address, name="missing/x", timeout=10)
    assert answer["ok"] is False and answer["error"] == "NotFoundError", answer
    assert 'name = "missing/x"' in answer["message"] and node_a.address in answer["message"]
    with tensorshm.connect(b.socket) as cb:
        assert nothing_held(cb) and "missing/x" not in cb


# Over UCX's TCP transport (as between nodes; allowed only with allow_tcp_rma) 512 MiB takes
# about half a second here: long enough to kill a mover while the bytes move.
SLOW = {"UCX_TLS": "tcp,self"}
TCP_RMA = {"env": SLOW, "allow_tcp_rma": True}
HALF_GIB = f"f32:{128 << 20}"


def test_source_mover_killed_mid_transfer_leaves_nothing_behind(daemons):
    a, b = daemons
    node_a, node_b = Node(a.socket, **TCP_RMA), Node(b.socket, **TCP_RMA)
    try:
        with tensorshm.connect(a.socket) as ca, tensorshm.connect(b.socket) as cb:
            publish(ca, "big", HALF_GIB)
            node_b.send(op="pull", peer=node_a.address, name="big", timeout=60)
            # The source holds its lease once it has offered the tensor, the destination its
            # buffer once it has made it; then the READ runs (about half a second).
            assert wait_for(lambda: ca.stat()["leases"] == 1, timeout=30)
            assert wait_for(lambda: cb.stat()["tensors"] == 1, timeout=30)
            time.sleep(0.1)
            os.kill(node_a.process.pid, signal.SIGKILL)
            answer = node_b.answer()
            assert answer["ok"] is False, answer
            assert answer["error"] in ("ConnectionError", "TimeoutError"), answer
            assert "big" not in cb
            assert wait_for(lambda: nothing_held(cb)), cb.stat()
            # The killed mover's session ended: its daemon took its lease back.
            assert wait_for(lambda: nothing_held(ca)), ca.stat()
            consume(a, "big", HALF_GIB)  # the source's tensor is untouched
    finally:
        node_b.stop()
        node_a.process.wait(timeout=10)


def test_destination_mover_killed_mid_transfer_leaves_nothing_behind(daemons):
    a, b = daemons
    node_a, node_b = Node(a.socket, hold_seconds=10, **TCP_RMA), Node(b.socket, **TCP_RMA)
    try:
        with tensorshm.connect(a.socket) as ca, tensorshm.connect(b.socket) as cb:
            publish(ca, "big", HALF_GIB)
            used = cb.stat()["pools"][0]["used_bytes"]
            # A short timeout: the source holds its lease for it (plus 5 s) if no one finishes,
            # and keeps the memory one hold time more (hold_seconds: 10 s) before it gives it
            # back.
            node_b.send(op="pull", peer=node_a.address, name="big", timeout=4)
            assert wait_for(lambda: ca.stat()["leases"] == 1, timeout=30)
            assert wait_for(lambda: cb.stat()["tensors"] == 1, timeout=30)  # its buffer
            time.sleep(0.1)
            os.kill(node_b.process.pid, signal.SIGKILL)
            # The killed mover's daemon reclaims its unpublished buffer; the source drops its
            # lease when the hold time passes.
            assert wait_for(lambda: nothing_held(cb) and cb.stat()["tensors"] == 0, timeout=20)
            assert cb.stat()["pools"][0]["used_bytes"] <= used
            assert wait_for(lambda: nothing_held(ca), timeout=30), ca.stat()
            # The source mover still serves.
            node_c = Node(b.socket)
            try:
                answer = node_c.run(op="pull", peer=node_a.address, name="big", timeout=60)
                assert answer == {"ok": True, "result": "big"}
                consume(b, "big", HALF_GIB)
            finally:
                node_c.stop()
    finally:
        node_a.stop()
        node_b.process.wait(timeout=10)


def test_source_daemon_restart_between_two_ships():
    a = Daemon("node-a", host_pool="1Gi", extra_args=("--keep-segments",))
    b = Daemon("node-b", host_pool="1Gi")
    node_a, node_b = Node(a.socket), Node(b.socket)
    try:
        with tensorshm.connect(a.socket) as ca:
            publish(ca, "before", f"f32:{1 << 20}")
        assert node_b.run(op="pull", peer=node_a.address, name="before")["ok"]
        consume(b, "before", f"f32:{1 << 20}")
        assert a.stop() == 0
        a = Daemon("node-a", host_pool="1Gi", extra_args=("--keep-segments",), socket=a.socket,
                   prefix=a.prefix)
        with tensorshm.connect(a.socket) as ca:
            assert "before" in ca  # recovered from the kept segments
            publish(ca, "after", "bytes:5000")
        # The source mover's client reconnected on its own; its segments are mapped anew and
        # registered again.
        for name, kind in (("after", "bytes:5000"), ("before", f"f32:{1 << 20}")):
            answer = node_b.run(op="pull", peer=node_a.address, name=name, as_name=None,
                                **{"as": f"again/{name}"}, timeout=60)
            assert answer == {"ok": True, "result": f"again/{name}"}, answer
            consume(b, f"again/{name}", kind)
    finally:
        node_a.stop()
        node_b.stop()
        a.remove()  # and its kept segments
        b.stop()
