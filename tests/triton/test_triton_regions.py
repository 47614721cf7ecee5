"""TritonFeeder's region bookkeeping where a real daemon is hard to drive there: a segment the
daemon gave back lends its POSIX name to a new segment (a new segment instance). The old region
maps memory that is no longer the pool's, and Triton 2.51 holds one region per name at a time,
so it is unregistered before the new one is registered."""

from __future__ import annotations

from types import SimpleNamespace

import tritonclient.http as httpclient
from tensorshm.triton import TritonFeeder


class RecordingTriton(httpclient.InferenceServerClient):
    """A tritonclient HTTP client whose system region calls are recorded, not sent."""

    def __init__(self) -> None:
        super().__init__("127.0.0.1:9")
        self.calls: list[tuple] = []

    def register_system_shared_memory(self, name, key, byte_size, offset=0, headers=None):
        self.calls.append(("register", name, key, byte_size, offset))

    def unregister_system_shared_memory(self, name="", headers=None):
        self.calls.append(("unregister", name))


def tensor_at(instance: int, segment: int, shm_name: str, offset: int) -> SimpleNamespace:
    """What the feeder reads of a tensor: its layout and _segment_place()."""
    place = {"device": "cpu", "device_id": 0, "segment_instance": instance,
             "segment_id": segment, "segment_size": 1 << 20, "offset": offset, "nbytes": 64,
             "shm_name": shm_name, "ipc_handle": b""}
    return SimpleNamespace(shape=(16,), strides=(1,), dtype="float32", name="x",
                           _segment_place=lambda: place)


def test_a_name_lent_to_a_new_segment_replaces_its_old_region():
    triton = RecordingTriton()
    client = SimpleNamespace(daemon_instance=7)
    feed = TritonFeeder(triton, client)  # type: ignore[arg-type]
    feed.input("x", tensor_at(1, 3, "/p.cpu.3", 0))  # type: ignore[arg-type]
    feed.input("x", tensor_at(1, 3, "/p.cpu.3", 4096))  # type: ignore[arg-type]
    feed.input("x", tensor_at(1, 4, "/p.cpu.4", 0))  # type: ignore[arg-type]
    feed.input("x", tensor_at(2, 3, "/p.cpu.3", 0))  # type: ignore[arg-type]
    old, other, new = (f"tensorshm.{i:016x}.cpu.{s}" for i, s in ((1, 3), (1, 4), (2, 3)))
    assert triton.calls == [
        ("register", old, "/p.cpu.3", 1 << 20, 0),
        ("register", other, "/p.cpu.4", 1 << 20, 0),
        ("unregister", old),
        ("register", new, "/p.cpu.3", 1 << 20, 0),
    ]
    assert feed.regions == {("cpu", 0, 1, 4): other, ("cpu", 0, 2, 3): new}
    feed.close()
    assert sorted(triton.calls[4:]) == sorted([("unregister", new), ("unregister", other)])
