"""A pre-1.0 DLPack consumer (no max_version, as JAX calls it) and a published CUDA tensor:
refused with what to do, since the only copy tensorshm makes is on the host, not on the device
__dlpack_device__ names; dl_device=(1, 0) asks for that host copy explicitly. Runs against the
emulated driver (tests/support/fake_cuda) in a child process, so this process's driver stays
untouched."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from conftest import ROOT, Daemon

FAKE = os.environ.get("TSM_FAKE_CUDA_LIB", str(ROOT / "build" / "tests" / "libtsm_fake_cuda.so"))
FAKE_ENV = {"TENSORSHM_LIBCUDA": FAKE, "TSM_FAKE_CUDA_DEVICES": "1", "TSM_FAKE_CUDA_VISIBLE": "0"}


@pytest.fixture(scope="module")
def daemon():
    if not os.path.exists(FAKE):
        pytest.fail(f"emulated CUDA driver not built at {FAKE} (make build, or set "
                    "TSM_FAKE_CUDA_LIB)", pytrace=False)
    d = Daemon("legacy-cuda", host_pool="16Mi", extra_args=("--cuda-pool", "cuda:0=16Mi"),
               env=FAKE_ENV)
    yield d
    assert d.stop() == 0


CHILD = """
import sys, numpy as np, tensorshm
sys.path.insert(0, sys.argv[2])
from fake_cuda import Driver
client = tensorshm.connect(sys.argv[1])
w = client.create((5, 3), "float32", device="cuda:0")
Driver().to_device(0, w._data_ptr, np.arange(15, dtype=np.float32).reshape(5, 3))
w.publish("legacy/gpu", replace=True)
t = client.get("legacy/gpu")
for kwargs in ({}, {"stream": 1}, {"max_version": (0, 8)}, {"copy": False}):
    try:
        t.__dlpack__(**kwargs)
        print("not refused", kwargs)
    except BufferError as error:
        print("refused", kwargs, "|", error)

class Legacy:
    def __init__(self, capsule): self.capsule = capsule
    def __dlpack__(self, **kwargs): return self.capsule
    def __dlpack_device__(self): return (1, 0)

host = np.from_dlpack(Legacy(t.__dlpack__(dl_device=(1, 0))))
print("host copy", host.tolist() == np.arange(15).reshape(5, 3).tolist())
"""


def test_pre_1_0_consumer_of_a_cuda_tensor(daemon):
    result = subprocess.run(
        [sys.executable, "-c", CHILD, daemon.socket, str(pathlib.Path(__file__).parent)],
        capture_output=True, text=True, timeout=120, env={**os.environ, **FAKE_ENV})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    refused = [line for line in lines if line.startswith("refused")]
    assert len(refused) == 4, result.stdout
    for line in refused[:3]:
        assert "read-only cuda:0 memory" in line, line
        assert "dl_device=(1, 0)" in line and "max_version=(1, 0)" in line, line
    assert "copy=False forbids" in refused[3] and "dl_device=(1, 0)" in refused[3], refused[3]
    assert "host copy True" in lines, result.stdout
