"""A real Triton Inference Server fed from tensorshm through its system shared-memory extension:
a producer process publishes x, the feeder (this process) infers with x read in place and y
written by Triton into a tensorshm buffer, publishes y, and a consumer process checks every byte.
Over HTTP and gRPC; across daemon restarts; two inputs in one segment; refusals."""

from __future__ import annotations

import importlib
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest

import tensorshm
from tensorshm.triton import TritonFeeder, triton_dtype

from conftest import Daemon, run_python

N = 1 << 18  # 1 MiB of float32

PRODUCER = """
import sys, numpy as np, tensorshm
with tensorshm.connect(sys.argv[1]) as client:
    n, seed = int(sys.argv[3]), int(sys.argv[4])
    client.put(sys.argv[2], (np.arange(n, dtype=np.float32) * 0.25 + seed), replace=True)
print("published")
"""

CONSUMER = """
import sys, numpy as np, tensorshm
with tensorshm.connect(sys.argv[1]) as client, client.get(sys.argv[2]) as y:
    n, seed = int(sys.argv[3]), int(sys.argv[4])
    want = (np.arange(n, dtype=np.float32) * 0.25 + seed) * np.float32(2) + np.float32(1)
    got = np.from_dlpack(y)
    assert got.dtype == np.float32 and got.shape == (n,), (got.dtype, got.shape)
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"{bad.size} wrong elements, first at {bad[:5]}: {got[bad[:5]]}"
print("checked", n)
"""


def produce(daemon: Daemon, name: str, n: int = N, seed: int = 3) -> None:
    done = run_python(PRODUCER, daemon.socket, name, str(n), str(seed))
    assert done.returncode == 0 and "published" in done.stdout, done.stderr


def consume(daemon: Daemon, name: str, n: int = N, seed: int = 3) -> None:
    done = run_python(CONSUMER, daemon.socket, name, str(n), str(seed))
    assert done.returncode == 0 and f"checked {n}" in done.stdout, done.stdout + done.stderr


def protocol_of(triton_client):
    """tritonclient.http or tritonclient.grpc, whichever `triton_client` belongs to."""
    return importlib.import_module(".".join(type(triton_client).__module__.split(".")[:2]))


def feed_affine(feed: TritonFeeder, triton_client, client, x_name: str, y_name: str) -> float:
    """Infers affine on x_name, y into a tensorshm buffer published as y_name; returns s."""
    with client.get(x_name) as x:
        y = client.create(x.shape, x.dtype)
        outputs = [feed.output("y", y), protocol_of(triton_client).InferRequestedOutput("s")]
        result = triton_client.infer("affine", [feed.input("x", x)], outputs=outputs)
        y.publish(y_name, replace=True)
        return float(result.as_numpy("s")[0])


def region_key(place: dict) -> tuple:
    """A tensor's key in TritonFeeder.regions."""
    return (place["device"], place["device_id"], place["segment_instance"], place["segment_id"])


def registered(triton_client) -> dict[str, tuple[str, int]]:
    """Triton's system regions: name -> (key, byte_size), from either protocol's status call."""
    status = triton_client.get_system_shared_memory_status()
    if isinstance(status, list):  # HTTP: a list of dicts
        return {r["name"]: (r["key"], int(r["byte_size"])) for r in status}
    return {name: (r.key, int(r.byte_size)) for name, r in status.regions.items()}


def test_producer_to_triton_to_consumer_every_byte(daemon, triton_client):
    produce(daemon, "x")
    with tensorshm.connect(daemon.socket) as client, TritonFeeder(triton_client, client) as feed:
        s = feed_affine(feed, triton_client, client, "x", "y")
        x_values = np.arange(N, dtype=np.float32) * 0.25 + 3
        assert s == pytest.approx(float(x_values.sum(dtype=np.float64)))
        consume(daemon, "y")
        # One region, for the segment x and y share, mapped by its POSIX name, offset 0, whole.
        with client.get("x") as x:
            place = x._segment_place()
        assert len(feed.regions) == 1
        region = feed.regions[region_key(place)]
        assert region == f"tensorshm.{place['segment_instance']:016x}.cpu.{place['segment_id']}"
        assert registered(triton_client)[region] == (place["shm_name"], place["segment_size"])
    assert region not in registered(triton_client)  # close() unregistered it


def test_two_inputs_in_one_segment_at_different_offsets(daemon, triton_client):
    a = np.linspace(-5, 5, 4096, dtype=np.float32)
    b = np.arange(4096, dtype=np.float32) * 3
    with tensorshm.connect(daemon.socket) as client, TritonFeeder(triton_client, client) as feed:
        client.put("a", a, replace=True)
        client.put("b", b, replace=True)
        with client.get("a") as ta, client.get("b") as tb:
            pa, pb = ta._segment_place(), tb._segment_place()
            assert (pa["segment_instance"], pa["segment_id"]) == (
                pb["segment_instance"], pb["segment_id"])
            assert pa["offset"] != pb["offset"]
            c = client.create((4096,), "float32")
            triton_client.infer("add", [feed.input("a", ta), feed.input("b", tb)],
                                outputs=[feed.output("c", c)])
            assert len(feed.regions) == 1  # both inputs and the output through one region
            np.testing.assert_array_equal(np.from_dlpack(c), a + b)


def test_strided_input_is_refused_or_copied_when_asked(daemon, triton_client):
    with tensorshm.connect(daemon.socket) as client, TritonFeeder(triton_client, client) as feed:
        w = client.create((1000,), "float32", strides=(2,))
        np.from_dlpack(w)[:] = np.arange(1000, dtype=np.float32)
        w.publish("strided", replace=True)
        with client.get("strided") as x:
            with pytest.raises(tensorshm.InvalidArgumentError, match=r"strides = \(2,\).*copy=True"):
                feed.input("x", x)
            y = client.create((1000,), "float32")
            triton_client.infer("affine", [feed.input("x", x, copy=True)],
                                outputs=[feed.output("y", y)])
            np.testing.assert_array_equal(np.from_dlpack(y), np.arange(1000, dtype=np.float32) * 2 + 1)


def test_outputs_must_be_unpublished_writable_tensors(daemon, triton_client):
    with tensorshm.connect(daemon.socket) as client, TritonFeeder(triton_client, client) as feed:
        client.put("p", np.zeros(4, np.float32), replace=True)
        with client.get("p") as p:
            with pytest.raises(tensorshm.InvalidArgumentError, match="output 'y'.*unpublished"):
                feed.output("y", p)
        with pytest.raises(tensorshm.InvalidArgumentError, match="dtype = 'complex64'"):
            feed.output("y", client.create((4,), "complex64"))
    assert triton_dtype("bfloat16") == "BF16"


def test_daemon_restarts_between_inferences_regions_are_made_again(triton_client, tmp_path):
    daemon = Daemon("triton-restart")
    with tensorshm.connect(daemon.socket) as client, TritonFeeder(triton_client, client) as feed:
        produce(daemon, "x", seed=1)
        feed_affine(feed, triton_client, client, "x", "y")
        consume(daemon, "y", seed=1)
        before = dict(feed.regions)
        old_x = client.get("x")  # held across the restart, as is an unpublished buffer
        old_y = client.create((16,), "float32")
        # A clean stop removes the segments; the new daemon makes new objects under the same
        # names. The old regions map the old memory, so they must go before the new register
        # (Triton 2.51 also refuses a second region on a key while one is registered).
        assert daemon.stop() == 0
        daemon = Daemon("triton-restart", socket=daemon.socket, prefix=daemon.prefix)
        produce(daemon, "x", seed=2)
        feed_affine(feed, triton_client, client, "x", "y")  # rides the reconnect
        consume(daemon, "y", seed=2)
        # Their names are new objects' now: Triton must not be pointed at them.
        with pytest.raises((tensorshm.DataLossError, tensorshm.FailedPreconditionError)):
            feed.input("x", old_x)
        with pytest.raises(tensorshm.FailedPreconditionError, match="restarted without it"):
            feed.output("y", old_y)
        old_x.release()
        old_y.release()
        after = dict(feed.regions)
        assert set(before.values()).isdisjoint(after.values()), (before, after)
        assert set(before.values()).isdisjoint(registered(triton_client))
        # SIGKILL: the restarted daemon takes the segments back (same objects, same regions).
        daemon.process.send_signal(signal.SIGKILL)
        daemon.process.wait()
        daemon.log.close()
        daemon = Daemon("triton-restart", socket=daemon.socket, prefix=daemon.prefix)
        produce(daemon, "x", seed=5)
        feed_affine(feed, triton_client, client, "x", "y")
        consume(daemon, "y", seed=5)
        assert set(feed.regions.values()) == set(registered(triton_client))
    assert daemon.stop() == 0


def test_memfd_segments_are_refused_clearly(triton_client):
    daemon = Daemon("triton-memfd", extra_args=("--segments", "memfd"))
    try:
        with tensorshm.connect(daemon.socket) as client, TritonFeeder(triton_client, client) as feed:
            client.put("x", np.ones(16, np.float32))
            with client.get("x") as x:
                with pytest.raises(tensorshm.FailedPreconditionError,
                                   match=r"input 'x'.*memfd.*--segments shm"):
                    feed.input("x", x)
            assert feed.regions == {}
    finally:
        assert daemon.stop() == 0


def test_a_segment_triton_cannot_open_is_refused_with_the_fix(daemon, triton_client):
    """Triton opens the segment by name; one it cannot open (here: gone) names the fix."""
    with tensorshm.connect(daemon.socket) as client, TritonFeeder(triton_client, client) as feed:
        client.put("gone", np.ones(16, np.float32), replace=True)
        with client.get("gone") as x:
            place = x._segment_place()
            hidden = f"/dev/shm{place['shm_name']}.moved"
            os.rename(f"/dev/shm{place['shm_name']}", hidden)
            try:
                with pytest.raises(tensorshm.FailedPreconditionError,
                                   match=r"Unable to open shared memory region.*--shm-group"):
                    feed.input("x", x)
            finally:
                os.rename(hidden, f"/dev/shm{place['shm_name']}")


def test_restricted_shared_memory_api_takes_the_access_token(daemon, tmp_path):
    """PyTriton protects the shared-memory endpoints with a token by default; headers carry it."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from conftest import TritonServer, triton_venv, write_models

    token = "t0ken"
    with TritonServer(triton_venv(), write_models(tmp_path / "models"), tmp_path,
                      f"--http-restricted-api=shared-memory:triton-access-token={token}",
                      f"--grpc-restricted-protocol=shared-memory:triton-access-token={token}"
                      ) as server, tensorshm.connect(daemon.socket) as client:
        client.put("x", np.arange(8, dtype=np.float32), replace=True)
        for triton_client, headers in (
                (httpclient.InferenceServerClient(server.http_url),
                 {"triton-access-token": token}),
                (grpcclient.InferenceServerClient(server.grpc_url),
                 {"triton-grpc-protocol-triton-access-token": token})):
            with triton_client, client.get("x") as x:
                with TritonFeeder(triton_client, client) as feed:
                    with pytest.raises(tensorshm.FailedPreconditionError, match="restricted"):
                        feed.input("x", x)
                with TritonFeeder(triton_client, client, headers=headers) as feed:
                    y = client.create((8,), "float32")
                    triton_client.infer("affine", [feed.input("x", x)],
                                        outputs=[feed.output("y", y)])
                    np.testing.assert_array_equal(np.from_dlpack(y),
                                                  np.arange(8, dtype=np.float32) * 2 + 1)


def test_readme_example_runs(daemon, triton):
    """README's "Feeding Triton" example, as written (only Triton's address changed), in its own
    process: x from a producer process, y checked by a consumer process."""
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("\n## Feeding Triton\n", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "localhost:8000" in example and "feed.input" in example, example
    produce(daemon, "x", seed=11)
    done = subprocess.run([sys.executable, "-c", example.replace("localhost:8000", triton.http_url)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TENSORSHM_SOCKET": daemon.socket})
    assert done.returncode == 0, done.stderr
    consume(daemon, "y", seed=11)
