"""The Client API and its errors."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import tensorshm
from conftest import Daemon, wait_for, waiting


def test_errors_subclass_the_builtins_a_user_catches(client):
    with pytest.raises(KeyError):
        client.get("api/absent")
    with pytest.raises(tensorshm.NotFoundError) as info:
        client.get("api/absent")
    assert "api/absent" in str(info.value) and info.value.code == 5
    with pytest.raises(ValueError, match="name = \"/abs\""):
        client.get("/abs")
    with pytest.raises(TimeoutError):
        client.get("api/absent", timeout=0.1)
    client.put("api/dup", np.zeros(2))
    with pytest.raises(tensorshm.AlreadyExistsError):
        client.put("api/dup", np.zeros(2))
    with pytest.raises(tensorshm.InvalidArgumentError, match="float33"):
        client.create((2,), "float33")
    with pytest.raises(ValueError, match="shape\\[0\\] = -1"):
        client.create((-1,), "float32")
    assert issubclass(tensorshm.ResourceExhaustedError, MemoryError)
    assert issubclass(tensorshm.PermissionError, PermissionError)


def test_connect_to_nothing_is_a_connection_error(tmp_path):
    with pytest.raises(ConnectionError, match="not reachable"):
        tensorshm.connect(str(tmp_path / "none.sock"), timeout=0.2)


def test_full_pool_is_a_memory_error():
    small = Daemon("small-pool", host_pool="16Mi")
    try:
        c = tensorshm.connect(small.socket)
        with pytest.raises(MemoryError, match="bytes"):
            c.create((32 << 20,), "uint8")
        c.create((1 << 20,), "uint8")  # still serving
    finally:
        assert small.stop() == 0


def test_get_waits_for_a_publish(client):
    def later():
        assert wait_for(lambda: waiting(client, os.getpid()), timeout=30)
        client.put("api/later", np.ones(3))

    thread = threading.Thread(target=later)
    thread.start()
    t = client.get("api/later", timeout=30)
    thread.join()
    np.testing.assert_array_equal(np.from_dlpack(t), np.ones(3))


def test_replace_delete_list_stat(client):
    client.put("api/list/a", np.zeros(3, dtype=np.int8), replace=True)
    old = client.get("api/list/a")
    client.put("api/list/a", np.ones(3, dtype=np.int8), replace=True)
    client.put("api/list/b", np.zeros((2, 2), dtype=np.float32), replace=True)
    assert np.from_dlpack(old).sum() == 0  # the old tensor lives for its lease
    assert np.from_dlpack(client.get("api/list/a")).sum() == 3
    listed = client.list("api/list/")
    assert [t["name"] for t in listed] == ["api/list/a", "api/list/b"]
    assert listed[1]["shape"] == (2, 2) and listed[1]["dtype"] == "float32"
    client.delete("api/list/b")
    with pytest.raises(KeyError):
        client.delete("api/list/b")
    stat = client.stat()
    assert {"tensors", "leases", "sessions", "pools"} <= set(stat)
    assert stat["pools"][0]["device"] == "cpu"
    assert stat["pools"][0]["capacity_bytes"] == 256 << 20


def test_create_accepts_numpy_and_ml_dtypes(client):
    import ml_dtypes

    assert client.create(4, np.float16).dtype == "float16"
    assert client.create(4, np.dtype("complex64")).dtype == "complex64"
    assert client.create(4, ml_dtypes.float8_e5m2).dtype == "float8_e5m2"
    packed = client.create(9, "float4_e2m1fn", subbyte_padded=False)
    assert packed.nbytes == 5 and not packed.subbyte_padded
    assert client.create(9, "float4_e2m1fn").nbytes == 9


def test_star_import_keeps_the_builtin_exceptions():
    names: dict[str, object] = {}
    exec("from tensorshm import *", names)  # noqa: S102 - what a user's module does
    for builtin in ("ConnectionError", "PermissionError", "TimeoutError"):
        assert builtin not in names, builtin
        # Still reachable as tensorshm.X, and caught by `except X:` of the builtin.
        assert issubclass(getattr(tensorshm, builtin), getattr(builtins, builtin)), builtin
    for name in tensorshm.__all__:
        assert names[name] is getattr(tensorshm, name)
    assert "Client" in names and "connect" in names and "NotFoundError" in names
    result = subprocess.run(
        [sys.executable, "-c", "import builtins; from tensorshm import *; "
         "print(ConnectionError is builtins.ConnectionError, "
         "PermissionError is builtins.PermissionError, TimeoutError is builtins.TimeoutError)"],
        capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "True True True", result


def test_every_name_the_package_exported_before_the_split_is_there():
    # tensorshm/__init__.py was split into _client, _aio, _put, _lifecycle: the public surface
    # stays where it was.
    for name in ("AlreadyExistsError", "CancelledError", "Client", "ClosedError",
                 "ConnectionError", "DataLossError", "Error", "FailedPreconditionError",
                 "InternalError", "InvalidArgumentError", "NotFoundError", "PermissionError",
                 "ReleasedError", "ResourceExhaustedError", "Tensor", "TimeoutError",
                 "UnauthenticatedError", "UnimplementedError", "WritableTensor", "connect",
                 "to_numpy", "__version__"):
        assert hasattr(tensorshm, name), name
    assert tensorshm.Client.__module__ == "tensorshm"
    assert set(tensorshm.__all__) <= set(dir(tensorshm))
