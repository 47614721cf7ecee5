"""torch interop: runs where torch is installed (make test-torch), skipped with a reason elsewhere."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in .venv (make test-torch installs it)")


def test_torch_from_dlpack_is_zero_copy_and_read_only(client):
    client.put("torch/a", np.arange(12, dtype=np.float32).reshape(3, 4), replace=True)
    t = client.get("torch/a")
    x = torch.from_dlpack(t)
    assert x.data_ptr() == t._data_ptr
    assert x.shape == (3, 4)
    assert torch.equal(x, torch.arange(12, dtype=torch.float32).reshape(3, 4))


def test_put_of_a_torch_tensor(client):
    source = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)[:, ::2]
    t = client.put("torch/b", source, replace=True)
    assert t.dtype == "bfloat16" and t.shape == (4, 3)
    assert torch.equal(torch.from_dlpack(client.get("torch/b")), source)


def test_put_uses_torchs_exchange_api_when_it_has_one(client):
    if getattr(torch.Tensor, "__dlpack_c_exchange_api__", None) is None:
        pytest.skip(f"torch {torch.__version__} has no __dlpack_c_exchange_api__")

    class NoDunder(torch.Tensor):
        def __dlpack__(self, *args, **kwargs):
            raise AssertionError("put() used __dlpack__ although torch has an exchange API")

    source = torch.arange(10, dtype=torch.int32).as_subclass(NoDunder)
    t = client.put("torch/api", source, replace=True)
    assert torch.equal(torch.from_dlpack(client.get("torch/api")), torch.arange(10, dtype=torch.int32))
    assert t.shape == (10,)


def test_writable_tensor_filled_by_torch(client):
    w = client.create((4, 4), "float32")
    torch.from_dlpack(w).fill_(3.0)
    w.publish("torch/filled", replace=True)
    assert float(torch.from_dlpack(client.get("torch/filled")).sum()) == 48.0
