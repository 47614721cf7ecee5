"""A real Triton Inference Server fed from tensorshm through its system shared-memory extension:
a producer process publishes x, the feeder (this process) infers with x read in place and y
written by Triton into a tensorshm buffer, publishes y, and a consumer process checks every byte.
Over HTTP and gRPC; across daemon restarts; two inputs in one segment; refusals. What Triton
holds: a region per segment for one inference (offset 0, up to the tensors' end), none between
inferences, none after an inference that raised; a region of a finished inference is refused to
another client; a restarted feeder removes its predecessor's."""

from __future__ import annotations

import importlib
import os
import pathlib
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

import tensorshm
from tensorshm.triton import TritonFeeder, triton_dtype
from tritonclient.utils import InferenceServerException

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
        result = feed.infer("affine", [feed.input("x", x)], outputs)
        y.publish(y_name, replace=True)
        return float(result.as_numpy("s")[0])


def registered(triton_client) -> dict[str, tuple[str, int, int]]:
    """Triton's system regions: name -> (key, offset, byte_size), from either protocol."""
    status = triton_client.get_system_shared_memory_status()
    if isinstance(status, list):  # HTTP: a list of dicts
        return {r["name"]: (r["key"], int(r.get("offset", 0)), int(r["byte_size"])) for r in status}
    return {name: (r.key, int(r.offset), int(r.byte_size)) for name, r in status.regions.items()}


def ours(triton_client, prefix: str = "tensorshm.") -> list[str]:
    """The system and CUDA regions Triton holds under `prefix`."""
    names = list(registered(triton_client))
    status = triton_client.get_cuda_shared_memory_status()
    names += [r["name"] for r in status] if isinstance(status, list) else list(status.regions)
    return sorted(n for n in names if n.startswith(prefix))


def region_of(tensor) -> tuple[str, int, int]:
    """(region, byte size, offset) that an InferInput or InferRequestedOutput (of either
    protocol) names."""
    request = tensor._get_tensor()
    if isinstance(request, dict):  # HTTP
        p = request["parameters"]
        return (p["shared_memory_region"], p["shared_memory_byte_size"],
                p.get("shared_memory_offset", 0))
    p = request.parameters
    return (p["shared_memory_region"].string_param, p["shared_memory_byte_size"].int64_param,
            p["shared_memory_offset"].int64_param if "shared_memory_offset" in p else 0)


def watch_registrations(triton_client) -> list[tuple[str, tuple[str, int, int]]]:
    """Records, for each system region the feeder registers through `triton_client`, its name and
    what Triton holds under it right after: (key, offset, byte_size)."""
    seen = []
    register = triton_client.register_system_shared_memory

    def watched(name, *args, **kwargs):
        register(name, *args, **kwargs)
        seen.append((name, registered(triton_client)[name]))

    triton_client.register_system_shared_memory = watched
    return seen


def test_producer_to_triton_to_consumer_every_byte(daemon, triton_client):
    produce(daemon, "x")
    with tensorshm.connect(daemon.socket) as client, TritonFeeder(triton_client, client) as feed:
        seen = watch_registrations(triton_client)
        s = feed_affine(feed, triton_client, client, "x", "y")
        x_values = np.arange(N, dtype=np.float32) * 0.25 + 3
        assert s == pytest.approx(float(x_values.sum(dtype=np.float64)))
        consume(daemon, "y")
        # One region for the segment x and y share, for that inference: mapped by the segment's
        # POSIX name from offset 0 to the end of the later of the two, no further.
        with client.get("x") as x, client.get("y") as y:
            px, py = x.segment_place(), y.segment_place()
        assert (px["segment_instance"], px["segment_id"]) == (py["segment_instance"],
                                                              py["segment_id"])
        end = max(p["offset"] + p["nbytes"] for p in (px, py))
        assert len(seen) == 1 and end < px["segment_size"], (seen, end)
        name, held = seen[0]
        assert re.fullmatch(r"tensorshm\.[0-9a-f]{16}", name), name
        assert held == (px["shm_name"], 0, end)
        # Gone once the inference returned.
        assert ours(triton_client) == [] and feed.regions == []


def test_two_inputs_in_one_segment_at_different_offsets(daemon, triton_client):
    a = np.linspace(-5, 5, 4096, dtype=np.float32)
    b = np.arange(4096, dtype=np.float32) * 3
    with tensorshm.connect(daemon.socket) as client, TritonFeeder(triton_client, client) as feed:
        client.put("first", np.zeros(1024, np.float32), replace=True)  # a and b after it
        client.put("a", a, replace=True)
        client.put("b", b, replace=True)
        seen = watch_registrations(triton_client)
        with client.get("a") as ta, client.get("b") as tb:
            pa, pb = ta.segment_place(), tb.segment_place()
            assert (pa["segment_instance"], pa["segment_id"]) == (
                pb["segment_instance"], pb["segment_id"])
            assert pa["offset"] != pb["offset"] and min(pa["offset"], pb["offset"]) > 0
            c = client.create((4096,), "float32")
            inputs = [feed.input("a", ta), feed.input("b", tb)]
            feed.infer("add", inputs, [feed.output("c", c)])
            # Both inputs (and the output, in the same segment) through one region, each at its
            # own offset: Triton read the right bytes at nonzero offsets.
            assert len(seen) == 1, seen
            assert [region_of(i) for i in inputs] == [
                (seen[0][0], p["nbytes"], p["offset"]) for p in (pa, pb)]
            np.testing.assert_array_equal(np.from_dlpack(c), a + b)
        assert ours(triton_client) == []


def test_another_client_cannot_name_a_finished_inferences_region(daemon, triton, triton_client):
    """The regions of an inference are gone when it returns: a second client that names one (at
    the same offset, for the same bytes) is refused, and gets nothing to read or write."""
    protocol = protocol_of(triton_client)
    with tensorshm.connect(daemon.socket) as client, TritonFeeder(triton_client, client) as feed:
        client.put("secret", np.arange(64, dtype=np.float32), replace=True)
        with client.get("secret") as x:
            feed_input = feed.input("x", x)
            y = client.create((64,), "float32")
            feed_output = feed.output("y", y)
            feed.infer("affine", [feed_input], [feed_output])
            np.testing.assert_array_equal(np.from_dlpack(y),
                                          np.arange(64, dtype=np.float32) * 2 + 1)
            region, nbytes, offset = region_of(feed_input)
            assert region_of(feed_output)[0] == region
        url = triton.http_url if protocol.__name__.endswith("http") else triton.grpc_url
        with protocol.InferenceServerClient(url) as other:
            assert ours(other) == []
            stolen = protocol.InferInput("x", [64], "FP32")
            stolen.set_shared_memory(region, nbytes, offset=offset)
            with pytest.raises(InferenceServerException,
                               match=f"Unable to find shared memory region: '{re.escape(region)}'"):
                other.infer("affine", [stolen])
            inline = protocol.InferInput("x", [64], "FP32")
            inline.set_data_from_numpy(np.zeros(64, np.float32))
            overwrite = protocol.InferRequestedOutput("y")
            overwrite.set_shared_memory(region, nbytes, offset=offset)
            with pytest.raises(InferenceServerException, match="Unable to find shared memory"):
                other.infer("affine", [inline], outputs=[overwrite])


def test_regions_are_unregistered_when_the_inference_raises(daemon, triton_client):
    with tensorshm.connect(daemon.socket) as client, TritonFeeder(triton_client, client) as feed:
        client.put("x", np.ones(16, np.float32), replace=True)
        seen = watch_registrations(triton_client)
        with client.get("x") as x:
            y = client.create((16,), "float32")
            with pytest.raises(InferenceServerException, match="nonexistent"):
                feed.infer("nonexistent", [feed.input("x", x)], [feed.output("y", y)])
            with pytest.raises(InferenceServerException):
                feed.infer("affine", [feed.input("not_an_input", x)], [feed.output("y", y)])
        assert len(seen) == 2  # registered for both calls, and unregistered after each
        assert ours(triton_client) == [] and feed.regions == []


FEEDER_DIES_DURING_AN_INFERENCE = """
import os, sys, tensorshm, tritonclient.http as httpclient
from tensorshm.triton import TritonFeeder
with tensorshm.connect(sys.argv[1]) as tsm, httpclient.InferenceServerClient(sys.argv[2]) as triton:
    feed = TritonFeeder(triton, tsm, region_prefix=sys.argv[3])
    with tsm.get("x") as x:
        y = tsm.create(x.shape, x.dtype)
        with feed.registered([feed.input("x", x)], [feed.output("y", y)]) as names:
            print(" ".join(names), flush=True)
            os._exit(0)
"""


def test_a_restarted_feeder_removes_its_predecessors_regions(daemon, triton):
    """A feeder that dies during an inference leaves its regions in Triton; the next feeder of
    the same prefix unregisters them before it registers anything, and leaves other prefixes'."""
    import tritonclient.http as httpclient

    produce(daemon, "x", seed=4)
    died = run_python(FEEDER_DIES_DURING_AN_INFERENCE, daemon.socket, triton.http_url, "feeder-a.")
    assert died.returncode == 0, died.stderr
    left = died.stdout.split()
    with httpclient.InferenceServerClient(triton.http_url) as triton_client:
        assert len(left) == 1 and ours(triton_client, "feeder-a.") == left
        # Another prefix's region, of an object of its own (Triton 2.51 holds one region per
        # object at a time).
        other = f"/tsm-triton-other-{os.getpid()}"
        with open(f"/dev/shm{other}", "wb") as f:
            f.truncate(4096)
        triton_client.register_system_shared_memory("other.region", other, 4096)
        try:
            with tensorshm.connect(daemon.socket) as client, \
                    TritonFeeder(triton_client, client, region_prefix="feeder-a.") as feed:
                feed_affine(feed, triton_client, client, "x", "y")
                consume(daemon, "y", seed=4)
                assert ours(triton_client, "feeder-a.") == []
            assert "other.region" in registered(triton_client)
        finally:
            triton_client.unregister_system_shared_memory("other.region")
            os.unlink(f"/dev/shm{other}")


def test_strided_input_is_refused_or_copied_when_asked(daemon, triton_client):
    with tensorshm.connect(daemon.socket) as client, TritonFeeder(triton_client, client) as feed:
        w = client.create((1000,), "float32", strides=(2,))
        np.from_dlpack(w)[:] = np.arange(1000, dtype=np.float32)
        w.publish("strided", replace=True)
        with client.get("strided") as x:
            with pytest.raises(tensorshm.InvalidArgumentError, match=r"strides = \(2,\).*copy=True"):
                feed.input("x", x)
            y = client.create((1000,), "float32")
            feed.infer("affine", [feed.input("x", x, copy=True)], [feed.output("y", y)])
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


def test_daemon_restarts_between_inferences(triton_client, tmp_path):
    daemon = Daemon("triton-restart")
    with tensorshm.connect(daemon.socket) as client, TritonFeeder(triton_client, client) as feed:
        produce(daemon, "x", seed=1)
        feed_affine(feed, triton_client, client, "x", "y")
        consume(daemon, "y", seed=1)
        old_x = client.get("x")  # held across the restart, as is an unpublished buffer
        old_y = client.create((16,), "float32")
        # A clean stop removes the segments; the new daemon makes new objects under the same
        # names. Nothing stays registered between inferences, so nothing maps the old memory.
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
        assert ours(triton_client) == []
        # SIGKILL: the restarted daemon takes the segments back (the same objects).
        daemon.process.send_signal(signal.SIGKILL)
        daemon.process.wait()
        daemon.log.close()
        daemon = Daemon("triton-restart", socket=daemon.socket, prefix=daemon.prefix)
        produce(daemon, "x", seed=5)
        feed_affine(feed, triton_client, client, "x", "y")
        consume(daemon, "y", seed=5)
        assert ours(triton_client) == [] and feed.regions == []
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
            assert feed.regions == []
    finally:
        assert daemon.stop() == 0


def test_a_segment_triton_cannot_open_is_refused_with_the_fix(daemon, triton_client):
    """Triton opens the segment by name; one it cannot open (here: gone) names the fix."""
    with tensorshm.connect(daemon.socket) as client, TritonFeeder(triton_client, client) as feed:
        client.put("gone", np.ones(16, np.float32), replace=True)
        with client.get("gone") as x:
            place = x.segment_place()
            hidden = f"/dev/shm{place['shm_name']}.moved"
            os.rename(f"/dev/shm{place['shm_name']}", hidden)
            try:
                with pytest.raises(tensorshm.FailedPreconditionError,
                                   match=r"input 'x'.*Unable to open shared memory region.*"
                                         r"--shm-group"):
                    feed.infer("affine", [feed.input("x", x)])
                assert feed.regions == [] and ours(triton_client) == []
            finally:
                os.rename(hidden, f"/dev/shm{place['shm_name']}")


def test_a_segment_another_client_holds_a_region_of_is_refused_with_the_reason(daemon,
                                                                               triton_client):
    """Triton 2.51 maps one region per shm object at a time (a second register reuses the first
    one's closed descriptor): the feeder says so instead of Triton's "Invalid shared memory"."""
    with tensorshm.connect(daemon.socket) as client, TritonFeeder(triton_client, client) as feed:
        client.put("x", np.ones(16, np.float32), replace=True)
        with client.get("x") as x:
            triton_client.register_system_shared_memory(
                "another.client", x.segment_place()["shm_name"], 64)
            try:
                with pytest.raises(tensorshm.FailedPreconditionError,
                                   match=r"one region of .* at a time.*one feeder per"):
                    feed.infer("affine", [feed.input("x", x)])
            finally:
                triton_client.unregister_system_shared_memory("another.client")
            assert feed.regions == [] and ours(triton_client) == []


def test_restricted_shared_memory_api_takes_the_access_token(daemon, tmp_path):
    """PyTriton protects the shared-memory endpoints with a token by default (triton.yaml does
    too); headers carry it. Without it the feeder cannot list, register or unregister, and a
    client without it cannot list the regions of an inference."""
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
                    y = client.create((8,), "float32")
                    with pytest.raises(tensorshm.FailedPreconditionError, match="restricted"):
                        feed.infer("affine", [feed.input("x", x)], [feed.output("y", y)])
                with pytest.raises(InferenceServerException, match="restricted"):
                    triton_client.get_system_shared_memory_status()

                def listing_without_token(name, *args, **kwargs):
                    register(name, *args, **kwargs)
                    with pytest.raises(InferenceServerException, match="restricted"):
                        triton_client.get_system_shared_memory_status()
                    listed.append(name in str(
                        triton_client.get_system_shared_memory_status(headers=headers)))

                register, listed = triton_client.register_system_shared_memory, []
                triton_client.register_system_shared_memory = listing_without_token
                with TritonFeeder(triton_client, client, headers=headers) as feed:
                    y = client.create((8,), "float32")
                    feed.infer("affine", [feed.input("x", x)], [feed.output("y", y)])
                    np.testing.assert_array_equal(np.from_dlpack(y),
                                                  np.arange(8, dtype=np.float32) * 2 + 1)
                assert listed == [True]
                assert "tensorshm." not in str(
                    triton_client.get_system_shared_memory_status(headers=headers))


def test_readme_example_runs(daemon, triton):
    """docs/triton.md's example, as written (only Triton's address changed), in its own process:
    x from a producer process, y checked by a consumer process."""
    guide = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "triton.md").read_text()
    example = guide.split("```python\n", 1)[1].split("```", 1)[0]
    assert "localhost:8000" in example and "feed.input" in example, example
    produce(daemon, "x", seed=11)
    done = subprocess.run([sys.executable, "-c", example.replace("localhost:8000", triton.http_url)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TENSORSHM_SOCKET": daemon.socket})
    assert done.returncode == 0, done.stderr
    consume(daemon, "y", seed=11)
