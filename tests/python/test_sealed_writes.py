"""A write to a published tensor stops the process (the memory is shared and sealed), but first
it says which tensor was written (name, address range), why it is read-only, and how to get a
private copy."""
import importlib.util
import signal

import numpy as np
import pytest

import tensorshm
from conftest import run_python

CONSUMER_WRITES = r"""
import ctypes, sys, numpy as np, tensorshm
c = tensorshm.connect(sys.argv[1], client_name="writer")
t = c.get("sealed/x")
view = np.from_dlpack(t)
address = view.__array_interface__["data"][0]
print(f"{address:#x} {address + 4096:#x} {address + 8:#x}", flush=True)
ctypes.memmove(address + 8, b"\x01\x02\x03\x04", 4)
print("the write went through", flush=True)
"""

PRODUCER_WRITES = r"""
import sys, numpy as np, tensorshm
c = tensorshm.connect(sys.argv[1], client_name="writer")
w = c.create((1024,), "int32")
view = np.from_dlpack(w)
view[:] = 7
w.publish("sealed/own")
print("published", flush=True)
view[3] = 9
print("the write went through", flush=True)
"""

TORCH_ADDS = r"""
import sys, torch, tensorshm
c = tensorshm.connect(sys.argv[1], client_name="writer")
x = torch.from_dlpack(c.get("sealed/x"))
print("acquired", flush=True)
x.add_(1)
print("the write went through", flush=True)
"""

HOW_TO_COPY = "torch.from_dlpack(t).clone()"


@pytest.fixture
def published(daemon, client):
    client.put("sealed/x", np.arange(1024, dtype=np.float32), replace=True).release()
    yield
    client.delete("sealed/x")


def check_report(result, name: str) -> str:
    assert result.returncode == -signal.SIGSEGV, (result.returncode, result.stderr)
    assert "the write went through" not in result.stdout
    err = result.stderr
    assert f'tensorshm: this process wrote to the published tensor "{name}": its bytes lie at ' \
        in err, err
    assert "a published tensor is sealed: read-only in every process" in err
    assert HOW_TO_COPY in err and "np.array(np.from_dlpack(t))" in err
    assert "the process stops now (SIGSEGV)" in err
    return err


def test_a_consumer_writing_an_acquired_tensor_is_told_which_and_why(daemon, published):
    result = run_python(CONSUMER_WRITES, daemon.socket)
    start, end, hit = result.stdout.split()[:3]
    err = check_report(result, "sealed/x")
    assert f"its bytes lie at {start}-{end}, the write hit {hit}." in err


def test_a_producer_writing_through_a_view_after_publish_is_told_too(daemon, client):
    result = run_python(PRODUCER_WRITES, daemon.socket)
    assert "published" in result.stdout
    check_report(result, "sealed/own")
    # The tensor is whole: the write never reached it.
    t = client.get("sealed/own")
    assert np.array_equal(np.from_dlpack(t), np.full(1024, 7, dtype=np.int32))
    t.release()
    client.delete("sealed/own")


def test_the_report_can_be_turned_off(daemon, published):
    result = run_python("import os; os.environ['TENSORSHM_SEGV_REPORT'] = '0'\n" + CONSUMER_WRITES,
                        daemon.socket)
    assert result.returncode == -signal.SIGSEGV
    assert "tensorshm:" not in result.stderr


def test_other_faults_are_left_to_the_default_action(daemon, published):
    """A fault outside tensorshm's memory (after a tensor was acquired, so the handler is in
    place) is not reported and still stops the process as a SIGSEGV."""
    code = CONSUMER_WRITES.replace("ctypes.memmove(address + 8", "ctypes.memmove(16")
    result = run_python(code, daemon.socket)
    assert result.returncode == -signal.SIGSEGV
    assert "tensorshm:" not in result.stderr


@pytest.mark.ecosystem
@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="torch is not installed (make test-ecosystem installs it into .venv)")
def test_torch_in_place_add_on_an_acquired_tensor_says_what_happened(daemon, published):
    result = run_python(TORCH_ADDS, daemon.socket)
    assert "acquired" in result.stdout
    check_report(result, "sealed/x")
