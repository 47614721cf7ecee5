"""Every DLPack consumer on PyPI that runs on CPU, each a real package in .venv: numpy, torch
(torch.from_dlpack, torch.utils.dlpack.from_dlpack), JAX (jnp.from_dlpack,
jax.dlpack.from_dlpack), tvm-ffi (tvm_ffi.from_dlpack) and ONNX Runtime (OrtValue.from_dlpack,
and OrtValue.ortvalue_from_numpy over np.from_dlpack).

What each one passes to ``__dlpack__`` decides what it gets: numpy and torch pass
``max_version=(1, 0)`` and get a zero-copy view flagged read-only; tvm-ffi calls the C exchange
API (``__dlpack_c_exchange_api__``) and gets a zero-copy view; JAX passes only ``stream=None``
and ``OrtValue.from_dlpack`` nothing, so they cannot receive the read-only flag and get a private
copy they own. ``OrtValue.ortvalue_from_numpy`` over numpy's zero-copy view shares the pages.
The optional packages are skipped, named, when missing; ``make test-ecosystem`` installs them
and fails on any skip.
"""

from __future__ import annotations

import ctypes
import gc
import subprocess
import sys
from typing import Any, Callable

import numpy as np
import pytest

from tensorshm import _tensorshm
from tensorshm._numpy import to_numpy

from cases import make, np_dtype
from conftest import own_leases
from onnx_model import affine_model

pytestmark = pytest.mark.ecosystem

INSTALL = "make test-ecosystem installs it into .venv"


def _need(package: str) -> Any:
    return pytest.importorskip(package, reason=f"{package} is not installed ({INSTALL})")


def _jax_from(fn_name: str) -> Callable[[Any], Any]:
    jax = _need("jax")
    import jax.dlpack
    import jax.numpy as jnp

    fn = jnp.from_dlpack if fn_name == "jnp" else jax.dlpack.from_dlpack

    def convert(t: Any) -> Any:
        with jax.enable_x64(True):  # int64/float64 stay themselves (JAX defaults to 32 bits)
            return fn(t)

    return convert


def _torch_to_numpy(x: Any) -> np.ndarray:
    torch = _need("torch")
    if x.dtype == torch.bfloat16:
        return x.float().numpy().astype(np_dtype("bfloat16"))  # bfloat16 -> float32 is exact
    return x.numpy()


def _bytes_at(x: Any, nbytes: int) -> bytes:
    """The first `nbytes` bytes at x.data_ptr() (tvm-ffi tensors and OrtValues, whose dtypes
    numpy may not know)."""
    return ctypes.string_at(x.data_ptr(), nbytes) if nbytes else b""


# ONNX Runtime's names of the dtypes (OrtValue.data_type() is "tensor(<name>)").
ORT_TYPE_NAMES = {"bool": "bool", "float32": "float", "float64": "double"}


class Consumer:
    """One way of importing a tensor: the package, the call, and how to read the result."""

    def __init__(self, name: str, package: str, zero_copy: bool, dtypes: list[str]) -> None:
        self.name, self.package, self.zero_copy, self.dtypes = name, package, zero_copy, dtypes

    def convert(self, t: Any) -> Any:
        _need(self.package)
        if self.name == "np.from_dlpack":
            return np.from_dlpack(t)
        if self.name == "torch.from_dlpack":
            import torch

            return torch.from_dlpack(t)
        if self.name == "torch.utils.dlpack.from_dlpack":
            import torch.utils.dlpack

            return torch.utils.dlpack.from_dlpack(t)
        if self.name == "jnp.from_dlpack":
            return _jax_from("jnp")(t)
        if self.name == "jax.dlpack.from_dlpack":
            return _jax_from("jax.dlpack")(t)
        if self.package == "onnxruntime":
            import onnxruntime as ort

            if self.name == "ort.OrtValue.from_dlpack":
                return ort.OrtValue.from_dlpack(t)
            return ort.OrtValue.ortvalue_from_numpy(np.from_dlpack(t))
        import tvm_ffi

        return tvm_ffi.from_dlpack(t)

    def data_ptr(self, x: Any) -> int:
        if self.package == "numpy":
            return int(x.ctypes.data)
        if self.package == "torch":
            return int(x.data_ptr())
        if self.package == "jax":
            return int(x.unsafe_buffer_pointer())
        return int(x.data_ptr())

    def assert_values(self, x: Any, expected: np.ndarray) -> None:
        if self.package == "tvm_ffi":
            assert tuple(x.shape) == expected.shape and str(x.dtype) == expected.dtype.name
            assert _bytes_at(x, expected.nbytes) == np.ascontiguousarray(expected).tobytes()
            return
        if self.package == "onnxruntime":
            name = expected.dtype.name
            assert tuple(x.shape()) == expected.shape
            assert x.data_type() == f"tensor({ORT_TYPE_NAMES.get(name, name)})"
            assert _bytes_at(x, expected.nbytes) == np.ascontiguousarray(expected).tobytes()
            return
        got = _torch_to_numpy(x) if self.package == "torch" else np.asarray(x)
        assert got.shape == expected.shape and got.dtype == expected.dtype
        np.testing.assert_array_equal(got, expected)


BASE = ["bool", "int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64"]
CONSUMERS = [
    Consumer("np.from_dlpack", "numpy", True, BASE + ["uint16", "uint32", "uint64"]),
    Consumer("torch.from_dlpack", "torch", True, BASE + ["bfloat16"]),
    Consumer("torch.utils.dlpack.from_dlpack", "torch", True, BASE + ["bfloat16"]),
    Consumer("jnp.from_dlpack", "jax", False, BASE + ["bfloat16", "uint16", "uint32", "uint64"]),
    Consumer("jax.dlpack.from_dlpack", "jax", False, BASE + ["bfloat16"]),
    Consumer("tvm_ffi.from_dlpack", "tvm_ffi", True,
             BASE + ["bfloat16", "uint16", "uint32", "uint64"]),
    # numpy's view has no bfloat16 (ml_dtypes' type is not a DLPack dtype to numpy).
    Consumer("ort.OrtValue.ortvalue_from_numpy:np.from_dlpack", "onnxruntime", True,
             BASE + ["uint16", "uint32", "uint64"]),
    Consumer("ort.OrtValue.from_dlpack", "onnxruntime", False,
             BASE + ["bfloat16", "uint16", "uint32", "uint64"]),
]
BY_NAME = {c.name: c for c in CONSUMERS}
LAYOUTS = ["0d", "empty", "c"]


def _cases() -> list[Any]:
    return [pytest.param(c.name, d, layout, id=f"{c.name}-{d}-{layout}")
            for c in CONSUMERS for d in c.dtypes for layout in LAYOUTS]


@pytest.mark.parametrize("consumer,dtype,layout", _cases())
def test_values_and_zero_copy(client, consumer, dtype, layout):
    c = BY_NAME[consumer]
    expected = make(dtype, layout)
    name = f"consumers/{consumer}/{dtype}/{layout}"
    client.put(name, expected, replace=True)
    t = client.get(name)
    x = c.convert(t)
    c.assert_values(x, expected)
    if expected.size > 0:
        # zero-copy consumers see the daemon's pages; JAX sees a private copy.
        assert (c.data_ptr(x) == t._data_ptr) is c.zero_copy, (c.data_ptr(x), t._data_ptr)
    client.delete(name)


@pytest.mark.parametrize("consumer", [c.name for c in CONSUMERS])
def test_lease_lives_as_long_as_a_zero_copy_array(client, consumer):
    c = BY_NAME[consumer]
    client.put("consumers/lease", np.arange(100, dtype=np.float32), replace=True)
    baseline = own_leases(client)
    t = client.get("consumers/lease")
    x = c.convert(t)
    del t
    gc.collect()
    if c.zero_copy:
        assert own_leases(client) == baseline + 1  # the array holds the tensor's lease
    else:
        assert own_leases(client) == baseline  # a private copy holds none
    c.assert_values(x, np.arange(100, dtype=np.float32))
    del x
    gc.collect()
    assert own_leases(client) == baseline


@pytest.mark.parametrize("consumer", [c.name for c in CONSUMERS if not c.zero_copy])
def test_private_copy_outlives_the_tensor_and_its_memory(client, consumer):
    c = BY_NAME[consumer]
    first = np.arange(4096, dtype=np.int32)
    client.put("consumers/copy-a", first, replace=True)
    t = client.get("consumers/copy-a")
    old_ptr = t._data_ptr
    x = c.convert(t)
    assert c.data_ptr(x) != old_ptr
    del t
    client.delete("consumers/copy-a")
    gc.collect()
    client.flush()
    # Another tensor of the same size takes the freed memory and overwrites it.
    reused = client.put("consumers/copy-b", np.full(4096, -7, dtype=np.int32), replace=True)
    assert reused._data_ptr == old_ptr, "the allocator did not reuse the freed block"
    np.testing.assert_array_equal(to_numpy(reused), np.full(4096, -7, dtype=np.int32))
    c.assert_values(x, first)
    client.delete("consumers/copy-b")


@pytest.fixture
def dlpack_calls(monkeypatch):
    """Every call of Tensor.__dlpack__ from here on, as the kwargs it got."""
    calls: list[dict[str, Any]] = []
    original = _tensorshm.Tensor.__dlpack__

    def spy(self: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return original(self, **kwargs)

    monkeypatch.setattr(_tensorshm.Tensor, "__dlpack__", spy)
    return calls


# What each consumer passes to __dlpack__ (None: it never calls it, using the C exchange API).
EXPECTED_KWARGS: dict[str, dict[str, Any] | None] = {
    "np.from_dlpack": {"max_version": (1, 0), "dl_device": None, "copy": None},
    "torch.from_dlpack": {"max_version": (1, 0)},
    "torch.utils.dlpack.from_dlpack": {"max_version": (1, 0)},
    "jnp.from_dlpack": {"stream": None},
    "jax.dlpack.from_dlpack": {"stream": None},
    "tvm_ffi.from_dlpack": None,
    "ort.OrtValue.ortvalue_from_numpy:np.from_dlpack":
        {"max_version": (1, 0), "dl_device": None, "copy": None},  # numpy's call
    "ort.OrtValue.from_dlpack": {},
}


@pytest.mark.parametrize("consumer", [c.name for c in CONSUMERS])
def test_what_each_consumer_passes_to_dlpack(client, dlpack_calls, consumer):
    c = BY_NAME[consumer]
    client.put("consumers/kwargs", np.arange(6, dtype=np.float64), replace=True)
    t = client.get("consumers/kwargs")
    api_calls = _tensorshm._exchange_api_calls()["managed_tensor_from_py_object_no_sync"]
    x = c.convert(t)
    expected = EXPECTED_KWARGS[consumer]
    if expected is None:
        assert dlpack_calls == []
        # It went through the C exchange API instead.
        assert _tensorshm._exchange_api_calls()["managed_tensor_from_py_object_no_sync"] == \
            api_calls + 1
    else:
        assert dlpack_calls == [expected]
    # Zero-copy exactly when the consumer can be told read-only (or used the exchange API).
    can_say_read_only = expected is None or expected.get("max_version", (0, 0)) >= (1, 0)
    assert (c.data_ptr(x) == t._data_ptr) is can_say_read_only


def test_numpy_sees_read_only(client):
    client.put("consumers/ro", np.arange(8, dtype=np.int16), replace=True)
    x = np.from_dlpack(client.get("consumers/ro"))
    assert not x.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        x[0] = 1


TORCH_WRITE = """
import sys, numpy as np, tensorshm, torch
client = tensorshm.connect(sys.argv[1])
client.put("consumers/torch-ro", np.zeros(16, np.float32), replace=True)
x = torch.from_dlpack(client.get("consumers/torch-ro"))
print("torch writeable view:", not x.is_inference() and not x.requires_grad, flush=True)
x[0] = 1.0
print("wrote into shared memory", flush=True)
"""


def test_torch_drops_the_read_only_flag_and_the_mapping_stops_a_write(daemon):
    """torch 2.x accepts a read-only capsule without marking the tensor read-only (no warning
    either); a write through it hits the read-only mapping and the process dies of SIGSEGV
    before a byte changes."""
    _need("torch")
    result = subprocess.run([sys.executable, "-c", TORCH_WRITE, daemon.socket],
                            capture_output=True, text=True, timeout=120)
    assert "torch writeable view: True" in result.stdout, result.stdout + result.stderr
    assert "wrote into shared memory" not in result.stdout
    assert result.returncode in (-11, 139), (result.returncode, result.stderr[-2000:])


def test_tvm_ffi_tensor_has_no_read_only_flag(client):
    tvm_ffi = _need("tvm_ffi")
    client.put("consumers/tvm-ro", np.arange(4, dtype=np.int32), replace=True)
    t = client.get("consumers/tvm-ro")
    x = tvm_ffi.from_dlpack(t)
    assert x.data_ptr() == t._data_ptr
    assert not hasattr(x, "flags") and not hasattr(x, "read_only")


def test_onnxruntime_runs_a_model_on_the_shared_pages(client):
    """y = 2 * x + 1 with x bound through IOBinding as an OrtValue over numpy's zero-copy view:
    the bound input is the daemon's pages, and the binding holds the lease until it lets the
    input go."""
    ort = _need("onnxruntime")
    x = np.linspace(-3, 3, 1000, dtype=np.float32)
    client.put("consumers/ort-x", x, replace=True)
    baseline = own_leases(client)
    t = client.get("consumers/ort-x")
    value = ort.OrtValue.ortvalue_from_numpy(np.from_dlpack(t))
    assert value.data_ptr() == t._data_ptr
    session = ort.InferenceSession(affine_model(), providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", value)
    binding.bind_output("y")
    del t, value
    gc.collect()
    assert own_leases(client) == baseline + 1  # the binding holds the OrtValue, hence the lease
    session.run_with_iobinding(binding)
    y = binding.copy_outputs_to_cpu()[0]
    expected = x * np.float32(2) + np.float32(1)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert y.tobytes() == expected.tobytes()
    binding.clear_binding_inputs()
    gc.collect()
    assert own_leases(client) == baseline
    client.delete("consumers/ort-x")


ORT_WRITE = """
import sys, numpy as np, onnxruntime as ort, tensorshm
client = tensorshm.connect(sys.argv[1])
client.put("consumers/ort-ro", np.zeros(16, np.float32), replace=True)
value = ort.OrtValue.ortvalue_from_numpy(np.from_dlpack(client.get("consumers/ort-ro")))
print("ort writeable view:", value.numpy().flags.writeable, flush=True)
{write}
print("wrote into shared memory", flush=True)
"""


@pytest.mark.parametrize("write", ["value.numpy()[0] = 1.0",
                                   "value.update_inplace(np.ones(16, np.float32))"])
def test_onnxruntime_drops_the_read_only_flag_and_the_mapping_stops_a_write(daemon, client,
                                                                             write):
    """ortvalue_from_numpy takes numpy's read-only view without a word, and the OrtValue hands
    out a writeable numpy view of it and writes through update_inplace; either write hits the
    read-only mapping and the process dies of SIGSEGV before a byte changes."""
    _need("onnxruntime")
    result = subprocess.run([sys.executable, "-c", ORT_WRITE.format(write=write), daemon.socket],
                            capture_output=True, text=True, timeout=120)
    assert "ort writeable view: True" in result.stdout, result.stdout + result.stderr
    assert "wrote into shared memory" not in result.stdout
    assert result.returncode in (-11, 139), (result.returncode, result.stderr[-2000:])
    np.testing.assert_array_equal(to_numpy(client.get("consumers/ort-ro")),
                                  np.zeros(16, np.float32))
    client.delete("consumers/ort-ro")


def _producer_cases() -> list[Any]:
    return [pytest.param(p, d, id=f"{p}-{d}") for p in ("jax", "torch", "tvm_ffi")
            for d in BASE + ["bfloat16"]]


@pytest.mark.parametrize("producer,dtype", _producer_cases())
def test_put_round_trips_from_each_producer(client, producer, dtype):
    expected = make(dtype, "c")
    if producer == "jax":
        jax = _need("jax")
        import jax.numpy as jnp

        with jax.enable_x64(True):
            source = jnp.asarray(expected)
    elif producer == "torch":
        torch = _need("torch")
        source = torch.from_dlpack(np.ascontiguousarray(expected)) if dtype != "bfloat16" else \
            torch.from_numpy(expected.astype(np.float32)).to(torch.bfloat16)
    else:
        tvm_ffi = _need("tvm_ffi")
        source = tvm_ffi.from_dlpack(np.ascontiguousarray(expected)) if dtype != "bfloat16" else \
            tvm_ffi.from_dlpack(_need("torch").from_numpy(expected.astype(np.float32)).to(
                _need("torch").bfloat16))
    name = f"consumers/put/{producer}/{dtype}"
    t = client.put(name, source, replace=True)
    assert t.dtype == dtype and t.shape == expected.shape
    np.testing.assert_array_equal(to_numpy(client.get(name)), expected)
    client.delete(name)
