"""Device tensors go through NIXL's VRAM registration, which NIXL refuses here (its UCX has no CUDA
support, and the emulated driver's device memory is host memory to UCX): the ship is refused
both ways, naming the device, and leaves nothing held. CUDA runs on the emulated driver
(tests/support/fake_cuda), as in tests/python; the real-GPU path needs a GPU with a CUDA-enabled
UCX."""

from __future__ import annotations

import os
import sys

import pytest

import tensorshm
from conftest import ROOT, Daemon, Node

sys.path.insert(0, str(ROOT / "tests" / "python"))
import fake_cuda  # noqa: E402


@pytest.fixture
def emulated_cuda():
    saved = dict(os.environ)
    fake_cuda.use_emulated_driver()  # for the daemons and movers started here, and this process
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_a_device_tensor_is_refused_both_ways_naming_its_device(emulated_cuda):
    a = Daemon("node-a", host_pool="64Mi", extra_args=("--cuda-pool", "cuda:0=64Mi"))
    b = Daemon("node-b", host_pool="64Mi", extra_args=("--cuda-pool", "cuda:0=64Mi"))
    node_a, node_b = Node(a.socket), Node(b.socket)
    try:
        with tensorshm.connect(a.socket) as ca, tensorshm.connect(b.socket) as cb:
            w = ca.create((1024,), "float32", device="cuda:0")
            w.publish("dev/x")
            w.release()
            pulled = node_b.run(op="pull", peer=node_a.address, name="dev/x", timeout=30)
            pushed = node_a.run(op="push", peer=node_b.address, name="dev/x", timeout=30)
            for answer in (pulled, pushed):
                assert answer["ok"] is False and answer["error"] == "UnimplementedError", answer
                assert 'device = "cuda:' in answer["message"], answer
                assert "cannot register device memory as VRAM" in answer["message"], answer
            print(pulled["message"])
            assert "dev/x" not in cb
            stat_a, stat_b = ca.stat(), cb.stat()
            assert stat_a["leases"] == 0 and stat_b["leases"] == 0, (stat_a, stat_b)
    finally:
        node_a.stop()
        node_b.stop()
        a.stop()
        b.stop()
