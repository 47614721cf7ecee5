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
