"""TritonFeeder's region bookkeeping, on a tritonclient whose region calls are recorded, not sent
(tests/triton/test_triton.py has the real server): one region per segment per inference, from
offset 0 to the end of the last tensor in it; none before or after; the predecessor's regions
swept once; unregistered when the inference raises; Triton's "in use" waited out; a refused
unregister kept, raised and tried again."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import tensorshm
from tensorshm.triton import TritonFeeder


class RecordingTriton(httpclient.InferenceServerClient):
    """A tritonclient HTTP client whose region calls and inferences are recorded, not sent.
    `held`: the system regions it holds; `refuse`: region name -> refusals still to give."""

    def __init__(self, held: tuple[str, ...] = ()) -> None:
        super().__init__("127.0.0.1:9")
        self.calls: list[tuple] = []
        self.held = {name: None for name in held}
        self.refuse: dict[str, list[str]] = {}

    def get_system_shared_memory_status(self, region_name="", headers=None, query_params=None):
        self.calls.append(("status",))
        return [{"name": name, "key": "/k", "offset": 0, "byte_size": 64} for name in self.held]

    def get_cuda_shared_memory_status(self, region_name="", headers=None, query_params=None):
        return []

    def register_system_shared_memory(self, name, key, byte_size, offset=0, headers=None):
        self.calls.append(("register", name, key, byte_size, offset))
        self.held[name] = None

    def unregister_system_shared_memory(self, name="", headers=None):
        self.calls.append(("unregister", name))
        if self.refuse.get(name):
            raise InferenceServerException(self.refuse[name].pop(0))
        self.held.pop(name, None)

    def infer(self, model_name, inputs, outputs=None, **kwargs):
        self.calls.append(("infer", model_name, tuple(sorted(self.held))))
        if model_name == "raises":
            raise InferenceServerException("[400] the model raised")
        return "result"


def tensor_at(segment: int, offset: int, nbytes: int = 64, instance: int = 1) -> SimpleNamespace:
    """What the feeder reads of a host tensor: its layout and segment_place()."""
    place = {"device": "cpu", "device_id": 0, "segment_instance": instance,
             "segment_id": segment, "segment_size": 1 << 20, "offset": offset, "nbytes": nbytes,
             "shm_name": f"/p.cpu.{segment}", "ipc_handle": b""}
    return SimpleNamespace(shape=(nbytes // 4,), strides=(1,), dtype="float32", name="x",
                           segment_place=lambda: place)


def feeder(triton: RecordingTriton, **kwargs) -> TritonFeeder:
    client = SimpleNamespace(daemon_instance=7)
    return TritonFeeder(triton, client, **kwargs)  # type: ignore[arg-type]


def calls(triton: RecordingTriton, kind: str) -> list[tuple]:
    return [c for c in triton.calls if c[0] == kind]


def test_one_region_per_segment_per_inference_from_offset_0_to_the_last_tensors_end():
    triton = RecordingTriton()
    feed = feeder(triton)
    inputs = [feed.input("a", tensor_at(3, 8192)), feed.input("b", tensor_at(3, 4096, 128)),
              feed.input("c", tensor_at(4, 65536))]
    assert triton.calls == [] and feed.regions == []  # building inputs registers nothing
    assert feed.infer("m", inputs) == "result"
    registers = calls(triton, "register")
    assert [(key, size, offset) for _, _, key, size, offset in registers] == [
        ("/p.cpu.3", 8192 + 64, 0), ("/p.cpu.4", 65536 + 64, 0)]
    names = [r[1] for r in registers]
    assert all(n.startswith("tensorshm.") and len(n) == len("tensorshm.") + 16 for n in names)
    # Registered for the call, and only then.
    assert calls(triton, "infer") == [("infer", "m", tuple(sorted(names)))]
    assert calls(triton, "unregister") == [("unregister", n) for n in names]
    assert triton.held == {} and feed.regions == []
    # Each input names its segment's region at its own offset.
    params = [i._get_tensor()["parameters"] for i in inputs]
    assert [(p["shared_memory_region"], p.get("shared_memory_offset", 0),
             p["shared_memory_byte_size"]) for p in params] == [
        (names[0], 8192, 64), (names[0], 4096, 128), (names[1], 65536, 64)]
    # The next inference: new names.
    feed.infer("m", inputs)
    assert set(r[1] for r in calls(triton, "register")[2:]).isdisjoint(names)


def test_the_predecessors_regions_are_swept_once_before_the_first_registration():
    triton = RecordingTriton(held=("tensorshm.0123456789abcdef", "other.region"))
    feed = feeder(triton)
    feed.infer("m", [feed.input("x", tensor_at(3, 0))])
    assert triton.calls[:3] == [("status",), ("unregister", "tensorshm.0123456789abcdef"),
                                ("register",) + triton.calls[2][1:]]
    assert triton.held == {"other.region": None}
    feed.infer("m", [feed.input("x", tensor_at(3, 0))])
    assert len(calls(triton, "status")) == 1
    with pytest.raises(tensorshm.InvalidArgumentError, match="region_prefix"):
        feeder(triton, region_prefix="")


def test_regions_are_unregistered_when_the_inference_raises():
    triton = RecordingTriton()
    feed = feeder(triton)
    with pytest.raises(InferenceServerException, match="the model raised"):
        feed.infer("raises", [feed.input("x", tensor_at(3, 0))])
    assert len(calls(triton, "register")) == 1 and triton.held == {} and feed.regions == []
    # And when the block of registered() raises.
    with pytest.raises(KeyError):
        with feed.registered([feed.input("x", tensor_at(3, 0))]) as names:
            assert feed.regions == names and list(triton.held) == names
            raise KeyError("the caller's")
    assert triton.held == {} and feed.regions == []


def test_a_region_still_in_use_is_waited_out(monkeypatch):
    """Over gRPC Triton 2.51 answers an inference a few ms before it lets go of its regions."""
    triton = RecordingTriton()
    feed = feeder(triton)
    real_register = triton.register_system_shared_memory

    def register(name, *args, **kwargs):
        real_register(name, *args, **kwargs)
        triton.refuse[name] = [f"[StatusCode.INTERNAL] Cannot unregister shared memory region "
                               f"'{name}', it is currently in use."] * 3

    monkeypatch.setattr(triton, "register_system_shared_memory", register)
    feed.infer("m", [feed.input("x", tensor_at(3, 0))])
    assert len(calls(triton, "unregister")) == 4 and triton.held == {}


def test_a_refused_unregister_is_raised_kept_and_tried_again():
    triton = RecordingTriton()
    feed = feeder(triton)
    real_register = triton.register_system_shared_memory

    def register(name, *args, **kwargs):
        real_register(name, *args, **kwargs)
        triton.refuse[name] = ["[403] This API is restricted"] * 2

    triton.register_system_shared_memory = register  # type: ignore[method-assign]
    with pytest.raises(tensorshm.FailedPreconditionError, match="refused to unregister 1 region"):
        feed.infer("m", [feed.input("x", tensor_at(3, 0))])
    left = feed.regions
    assert len(left) == 1 and list(triton.held) == left
    # The next registration tries it first, and refuses to go on while Triton keeps it.
    with pytest.raises(tensorshm.FailedPreconditionError, match=left[0]):
        feed.infer("m", [feed.input("x", tensor_at(4, 0))])
    assert len(calls(triton, "register")) == 1
    # close() too; once Triton lets go, it is done.
    feed.close()
    assert feed.regions == [] and triton.held == {}
