"""Real-GPU test: torch on CUDA, two processes, a 1 GiB tensor through tensorshm's device pool.

Runs where torch sees a CUDA device and the driver (libcuda.so.1) is present; elsewhere it is
skipped with the reason. Prints the consumer's acquire time next to a cudaMemcpy (device to
device) of the same bytes.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SIZE = 1 << 30


def _gpu_reason() -> str | None:
    if os.environ.get("TENSORSHM_LIBCUDA"):
        return "TENSORSHM_LIBCUDA is set (an emulated driver): this test needs the real one"
    try:
        import torch
    except ImportError:
        return "torch is not installed (make test-torch installs it)"
    if not torch.cuda.is_available():
        return f"no CUDA device visible to torch {torch.__version__}"
    return None


REASON = _gpu_reason()
if REASON is not None:
    print(f"\ntests/gpu skipped: {REASON}", file=sys.stderr)
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

PRODUCER = """
import sys, torch, tensorshm
client = tensorshm.connect(sys.argv[1])
g = torch.Generator(device="cuda").manual_seed(1234)
x = torch.randint(0, 256, (%d,), dtype=torch.uint8, device="cuda", generator=g)
client.put("gpu/big", x)              # device-to-device on torch's current stream
print("published", int(x[::4096].sum().item()), flush=True)
sys.stdin.read()                      # the ready event lives here: stay until told
""" % SIZE


@pytest.fixture(scope="module")
def daemon():
    """The socket of a private tensorshmd (tensorshm.Daemon) with a CUDA pool on device 0."""
    import tensorshm

    daemon = tensorshm.Daemon("64Mi", tensorshmd=os.environ.get(
        "TENSORSHMD", str(ROOT / "build" / "tensorshmd")), timeout=60.0,
        cuda_pool=f"cuda:0={SIZE + (256 << 20)}B", log_level="warning")
    yield daemon.socket
    log = daemon.log()  # stop() removes the daemon's directory, its log with it
    assert daemon.stop(timeout=30) == 0, log


def test_one_gib_cuda_tensor_between_two_processes(daemon):
    import torch

    import tensorshm

    producer = subprocess.Popen([sys.executable, "-c", PRODUCER, daemon], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        words = producer.stdout.readline().split()
        assert words and words[0] == "published", words + [producer.stdout.read()]
        client = tensorshm.connect(daemon)
        torch.cuda.synchronize()
        start = time.perf_counter()
        x = torch.from_dlpack(client.get("gpu/big"))
        torch.cuda.current_stream().synchronize()
        acquire = time.perf_counter() - start
        assert x.is_cuda and x.dtype == torch.uint8 and x.numel() == SIZE
        g = torch.Generator(device="cuda").manual_seed(1234)
        expected = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, device="cuda", generator=g)
        assert torch.equal(x, expected), "bytes differ"
        assert int(x[::4096].sum().item()) == int(words[1])
        copy = torch.empty_like(expected)
        copy.copy_(expected)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        copy.copy_(x)
        torch.cuda.synchronize()
        memcpy = time.perf_counter() - start
        print(f"\n1 GiB on {torch.cuda.get_device_name()}: tensorshm acquire + from_dlpack "
              f"{acquire * 1e3:.2f} ms, cudaMemcpy D2D of the same bytes {memcpy * 1e3:.2f} ms")
        del x, copy, expected
    finally:
        producer.stdin.close()
        producer.wait(timeout=60)
