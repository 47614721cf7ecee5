"""--metrics: a real tensorshmd serving /metrics, read with prometheus_client's own parser while
real clients (this process, child processes, a raw gRPC waiter) work against it."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import tensorshm
from conftest import ROOT, Daemon, wait_for

POOL = 64 << 20


def _binary(name: str) -> str:
    """A C++ test program: in $TSM_TEST_BINARIES (tests/wheels, whose daemon is a wheel's), else
    in tests/ beside the daemon's build."""
    daemon = pathlib.Path(os.environ.get("TENSORSHMD", str(ROOT / "build" / "tensorshmd")))
    path = pathlib.Path(os.environ.get("TSM_TEST_BINARIES", daemon.parent / "tests")) / name
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} not found: build it (cmake --build build --target {name})")
    return str(path)


def _logged(d: Daemon, pattern: str) -> re.Match:
    """The first match of `pattern` in the daemon's log, waited for."""
    found = []

    def logged() -> bool:
        with open(d.log.name) as log:
            match = re.search(pattern, log.read())
        found[:] = [match] if match else []
        return bool(found)

    assert wait_for(logged), f"no {pattern!r} in the daemon's log"
    return found[0]


@pytest.fixture(scope="module")
def daemon():
    started_after = time.time()
    d = Daemon("metrics", host_pool="64Mi",
               extra_args=("--metrics", "127.0.0.1:0", "--log-level", "info"))
    # The daemon logs the address it chose (port 0: a free one).
    d.metrics_port = int(_logged(d, r"metrics: serving http://127\.0\.0\.1:(\d+)/metrics")[1])
    d.version = _logged(d, r"tensorshmd (\S+): serving on")[1]
    d.started_after = started_after
    yield d
    assert d.stop() == 0


class Scrape:
    """One GET /metrics, parsed by prometheus_client."""

    def __init__(self, port: int) -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert response.status == 200
            self.content_type = response.headers["Content-Type"]
            self.text = response.read().decode()
        self.types: dict[str, str] = {}
        self.help: dict[str, str] = {}
        self.samples: dict[tuple, float] = {}
        for family in text_string_to_metric_families(self.text):
            self.types[family.name] = family.type
            self.help[family.name] = family.documentation
            for sample in family.samples:
                self.samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value

    def __call__(self, name: str, **labels: str) -> float:
        """A sample's value; 0 for a series not (yet) there, as Prometheus counters start."""
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)

    def ops(self, op: str, code: str = "OK") -> float:
        return self("tensorshm_operations_total", op=op, code=code)

    def buckets(self, name: str, code: str) -> list[tuple[float, float]]:
        """A histogram series' buckets, (upper bound, cumulative count), by bound."""
        return sorted((float(dict(labels)["le"]), value)
                      for (sample, labels), value in self.samples.items()
                      if sample == name + "_bucket" and dict(labels)["code"] == code)

    def bucket(self, name: str, code: str, le: float) -> float:
        return dict(self.buckets(name, code)).get(le, 0.0)


def scrape(daemon) -> Scrape:
    return Scrape(daemon.metrics_port)


def settle(client) -> dict:
    """Waits until this test's client is the only session (the previous test's client has
    closed), then quiet_stat."""
    assert wait_for(lambda: client.stat()["sessions"] == 1, timeout=30)
    return quiet_stat(client)


def quiet_stat(client) -> dict:
    """Stat once nothing moves: releases flushed, and two answers in a row equal."""
    client.flush()
    while True:
        first = client.stat()
        second = client.stat()
        if first == second:
            return first


def test_families_have_help_and_type_and_the_prefix(daemon):
    m = scrape(daemon)
    assert m.content_type == "text/plain; version=0.0.4; charset=utf-8"
    expected = {
        "tensorshm_pool_capacity_bytes": "gauge", "tensorshm_pool_used_bytes": "gauge",
        "tensorshm_pool_segments": "gauge", "tensorshm_tensors": "gauge",
        "tensorshm_names": "gauge", "tensorshm_leases": "gauge", "tensorshm_sessions": "gauge",
        "tensorshm_acquire_waiting": "gauge", "tensorshm_build_info": "gauge",
        "process_start_time_seconds": "gauge",
        # prometheus_client names a counter family without its _total.
        "tensorshm_operations": "counter", "tensorshm_allocation_failures": "counter",
        "tensorshm_reclaimed_bytes": "counter", "tensorshm_reclaimed_tensors": "counter",
        "tensorshm_reclaimed_leases": "counter", "tensorshm_acquire_wait_seconds": "histogram",
        "tensorshm_creates_waiting": "gauge", "tensorshm_evicted_tensors": "counter",
        "tensorshm_evicted_bytes": "counter", "tensorshm_pool_stock_bytes": "gauge",
        "tensorshm_stocked_tensors": "gauge", "tensorshm_fast_path_acquires": "counter",
        "tensorshm_pool_largest_free_bytes": "gauge",
    }
    for name, kind in expected.items():
        assert m.types.get(name) == kind, (name, m.types.get(name))
        assert m.help[name], name
    for name in m.types:
        assert name.startswith("tensorshm_") or name == "process_start_time_seconds", name
    assert m("tensorshm_build_info", version=daemon.version) == 1
    assert daemon.started_after <= m("process_start_time_seconds") <= time.time()
    # No tensor name ever appears in the figures.
    assert "metrics/" not in m.text


def test_unknown_path_is_404(daemon):
    for path in ("/", "/metric", "/metrics/extra", "/debug/pprof"):
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}{path}", timeout=10)
        assert error.value.code == 404, path


def test_gauges_equal_stat_at_the_same_moment(daemon, client):
    settle(client)
    client.put("metrics/g1", np.arange(1000, dtype=np.float32), replace=True)
    client.put("metrics/g2", np.arange(3000, dtype=np.int64), replace=True)
    held = client.get("metrics/g1")  # a lease
    unpublished = client.create((5000,), "uint8")  # memory, no name
    stat = quiet_stat(client)
    m = scrape(daemon)
    assert quiet_stat(client) == stat, "the daemon's figures moved during the scrape"
    names = len(client.list())

    assert m("tensorshm_tensors") == stat["tensors"]
    assert m("tensorshm_leases") == stat["leases"]
    assert m("tensorshm_sessions") == stat["sessions"]
    assert m("tensorshm_names") == names == stat["names"]
    assert m("tensorshm_creates_waiting") == stat["creates_waiting"]
    assert m("tensorshm_evicted_tensors_total") == stat["evicted_tensors"]
    assert m("tensorshm_evicted_bytes_total") == stat["evicted_bytes"]
    assert m("tensorshm_stocked_tensors") == stat["stocked_tensors"]
    assert stat["leases"] >= 1 and stat["tensors"] >= 3 and names >= 2
    assert len(stat["pools"]) == 1
    for pool in stat["pools"]:
        assert m("tensorshm_pool_capacity_bytes", device=pool["device"]) == pool["capacity_bytes"]
        assert m("tensorshm_pool_used_bytes", device=pool["device"]) == pool["used_bytes"]
        assert m("tensorshm_pool_stock_bytes", device=pool["device"]) == pool["stock_bytes"]
        assert m("tensorshm_pool_segments", device=pool["device"]) == pool["segments"]
        assert m("tensorshm_pool_segments", device=pool["device"]) >= 1
        assert (m("tensorshm_pool_largest_free_bytes", device=pool["device"])
                == pool["largest_free_bytes"])
        assert 0 < pool["largest_free_bytes"] <= pool["capacity_bytes"] - pool["used_bytes"]
    assert m("tensorshm_pool_capacity_bytes", device="cpu") == POOL
    assert m("tensorshm_pool_used_bytes", device="cpu") > 0
    del held, unpublished


def test_operations_count_exactly_what_was_done(daemon, client):
    settle(client)
    stat_calls = 0
    before = scrape(daemon)
    # Three puts of three lengths (a client stocks buffers only after 8 creates of one length):
    # a create and a publish each, whether over the memory channel or gRPC.
    client.put("metrics/a", np.arange(1000, dtype=np.float64))
    client.put("metrics/b", np.arange(2000, dtype=np.float64))
    client.put("metrics/c", np.arange(3000, dtype=np.float64))
    # A put over a name taken: created, then refused at publish.
    with pytest.raises(tensorshm.AlreadyExistsError):
        client.put("metrics/a", np.arange(4000, dtype=np.float64))
    # Host tensors are acquired in shared memory (the fast path): no Acquire call, but the
    # client counts it in its lease page, and the daemon reads it there.
    got = client.get("metrics/a")
    with pytest.raises(tensorshm.NotFoundError):
        client.get("metrics/none", timeout=0)
    client.delete("metrics/b")
    with pytest.raises(tensorshm.NotFoundError):
        client.delete("metrics/none")
    client.list("metrics/")
    client.stat()
    stat_calls += 1
    # A create the pool (64 MiB) cannot hold.
    with pytest.raises(tensorshm.ResourceExhaustedError):
        client.create((128 << 20,), "uint8")
    after = scrape(daemon)

    def moved(op: str, code: str = "OK") -> float:
        return after.ops(op, code) - before.ops(op, code)

    assert moved("create") == 4
    assert moved("create", "RESOURCE_EXHAUSTED") == 1
    assert moved("publish") == 3
    assert moved("publish", "ALREADY_EXISTS") == 1
    assert moved("delete") == 1
    assert moved("delete", "NOT_FOUND") == 1
    assert moved("list") == 1
    assert moved("stat") == stat_calls
    assert moved("acquire") == 1 and moved("acquire", "NOT_FOUND") == 0
    assert (after("tensorshm_fast_path_acquires_total")
            - before("tensorshm_fast_path_acquires_total")) == 1
    assert moved("session_open") == 0
    assert (after("tensorshm_allocation_failures_total", reason="pool")
            - before("tensorshm_allocation_failures_total", reason="pool")) == 1
    assert (after("tensorshm_allocation_failures_total", reason="quota")
            == before("tensorshm_allocation_failures_total", reason="quota"))
    # Nothing was left behind by a client.
    for name in ("bytes", "tensors", "leases"):
        reclaimed = f"tensorshm_reclaimed_{name}_total"
        assert after(reclaimed) == before(reclaimed)
    del got
    client.delete("metrics/a")
    client.delete("metrics/c")


def test_fast_path_acquires_are_counted_as_acquires(daemon, client):
    settle(client)
    client.put("metrics/fast", np.arange(100, dtype=np.float32), replace=True)
    before = scrape(daemon)
    n = 37
    held = [client.get("metrics/fast") for _ in range(n)]
    # They were fast: every lease is a slot of this session's lease page, none the daemon's.
    own = next(s for s in client.sessions() if s["own"])
    assert own["page_leases"] == n and own["rpc_leases"] == 0, own
    del held
    client.flush()
    after = scrape(daemon)
    assert after.ops("acquire") - before.ops("acquire") == n
    assert (after("tensorshm_fast_path_acquires_total")
            - before("tensorshm_fast_path_acquires_total")) == n
    # The daemon answered no Acquire call: only fast acquires moved the count.
    assert after.ops("acquire", "NOT_FOUND") == before.ops("acquire", "NOT_FOUND")
    client.delete("metrics/fast")


def test_stock_is_reported_apart_from_used(daemon, client):
    settle(client)
    before = quiet_stat(client)
    assert before["stocked_tensors"] == 0 and before["pools"][0]["stock_bytes"] == 0
    length = 64 << 10  # a page multiple: a buffer is exactly this long
    # A client asks for stock of a length once it created 8 tensors of it.
    made = [client.create((length,), "uint8") for _ in range(12)]
    stat = quiet_stat(client)
    pool, base = stat["pools"][0], before["pools"][0]
    stocked = stat["stocked_tensors"]
    assert stocked > 0, stat
    assert pool["stock_bytes"] == stocked * length
    # Buffers taken out of stock (creates 9 to 12) are stock to the daemon until published.
    assert stat["tensors"] - before["tensors"] == 8 + stocked
    assert pool["used_bytes"] - base["used_bytes"] == 8 * length
    m = scrape(daemon)
    assert m("tensorshm_stocked_tensors") == stocked
    assert m("tensorshm_pool_stock_bytes", device="cpu") == stocked * length
    assert m("tensorshm_pool_used_bytes", device="cpu") == pool["used_bytes"]

    for i, w in enumerate(made):
        w.publish(f"metrics/stock{i}")
    published = quiet_stat(client)
    # Published buffers are used, never stock; what is left in stock is still stock. (A publish
    # of a stocked buffer may ask for more stock.)
    assert published["pools"][0]["used_bytes"] - base["used_bytes"] == 12 * length
    assert published["pools"][0]["stock_bytes"] == published["stocked_tensors"] * length
    assert published["tensors"] - before["tensors"] == 12 + published["stocked_tensors"]
    for i in range(len(made)):
        client.delete(f"metrics/stock{i}")


def test_acquire_waits_in_the_daemon_are_a_histogram(daemon, client):
    acquirer = _binary("tsm_metrics_acquirer")
    settle(client)
    before = scrape(daemon)
    # A client without the fast path waits in the daemon until the publish ends its wait.
    waiter = subprocess.Popen([acquirer, daemon.socket, "metrics/later", "30000"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: scrape(daemon)("tensorshm_acquire_waiting") == 1, timeout=30)
        client.put("metrics/later", np.arange(10, dtype=np.int32))
        out, err = waiter.communicate(timeout=30)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()
    assert waiter.returncode == 0, err
    assert out.strip() == "acquire: OK"
    # One that no publish ends: its deadline does.
    expired = subprocess.run([acquirer, daemon.socket, "metrics/never", "50"],
                             capture_output=True, text=True, timeout=60)
    assert expired.returncode == 0, expired.stderr
    assert expired.stdout.strip() == "acquire: DEADLINE_EXCEEDED"
    settle(client)
    after = scrape(daemon)

    def moved(name: str, **labels: str) -> float:
        return after(name, **labels) - before(name, **labels)

    assert moved("tensorshm_operations_total", op="acquire", code="OK") == 1
    assert moved("tensorshm_operations_total", op="acquire", code="DEADLINE_EXCEEDED") == 1
    assert moved("tensorshm_operations_total", op="session_open", code="OK") == 2
    assert moved("tensorshm_operations_total", op="release", code="OK") >= 1
    assert after("tensorshm_acquire_waiting") == 0
    hist = "tensorshm_acquire_wait_seconds"
    for code in ("OK", "DEADLINE_EXCEEDED"):
        assert moved(hist + "_count", code=code) == 1
        assert moved(hist + "_sum", code=code) > 0
        for le in (60.0, float("inf")):
            assert after.bucket(hist, code, le) - before.bucket(hist, code, le) == 1, (code, le)
    # Buckets from 1 ms to 60 s, cumulative, up to +Inf, which is the count.
    for code in ("OK", "DEADLINE_EXCEEDED"):
        buckets = after.buckets(hist, code)
        assert [le for le, _ in buckets][:2] == [0.001, 0.0025]
        assert [le for le, _ in buckets][-2:] == [60.0, float("inf")]
        assert len(buckets) == 16
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)
        assert buckets[-1] == (float("inf"), after(hist + "_count", code=code))
    # The waiter released its lease before closing its session: nothing was reclaimed.
    assert moved("tensorshm_reclaimed_leases_total") == 0
    client.delete("metrics/later")


CHILD = """
import sys, time
import tensorshm
c = tensorshm.connect(sys.argv[1], client_name="doomed")
w = c.create((1 << 20,), "uint8")   # an unpublished buffer of 1 MiB
t = c.get("metrics/held")           # a lease
print("holding", flush=True)
time.sleep(600)
"""


def test_a_killed_client_is_reclaimed_and_counted(daemon, client):
    settle(client)
    client.put("metrics/held", np.arange(100, dtype=np.float32), replace=True)
    base = quiet_stat(client)
    before = scrape(daemon)
    child = subprocess.Popen([sys.executable, "-c", CHILD, daemon.socket],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "holding", child.stderr.read()
        holding = quiet_stat(client)
        assert holding["sessions"] == base["sessions"] + 1
        assert holding["leases"] == base["leases"] + 1
        held_bytes = holding["pools"][0]["used_bytes"] - base["pools"][0]["used_bytes"]
        assert held_bytes >= 1 << 20
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert wait_for(lambda: client.stat()["sessions"] == base["sessions"], timeout=30)
    after_stat = quiet_stat(client)
    after = scrape(daemon)
    assert after_stat["pools"][0]["used_bytes"] == base["pools"][0]["used_bytes"]
    assert after_stat["leases"] == base["leases"]

    def moved(name: str) -> float:
        return after(name) - before(name)

    assert moved("tensorshm_reclaimed_bytes_total") == held_bytes
    assert moved("tensorshm_reclaimed_tensors_total") == 1
    assert moved("tensorshm_reclaimed_leases_total") == 1
    assert after.ops("create") - before.ops("create") == 1
    assert after.ops("session_open") - before.ops("session_open") == 1
    assert after("tensorshm_sessions") == after_stat["sessions"]
    client.delete("metrics/held")


def test_quota_refusals_count_as_allocation_failures():
    d = Daemon("metrics-quota", host_pool="64Mi",
               extra_args=("--metrics", "127.0.0.1:0", "--log-level", "info",
                           "--session-quota", "1Mi"))
    try:
        port = int(_logged(d, r"metrics on http://127\.0\.0\.1:(\d+)/metrics")[1])
        c = tensorshm.connect(d.socket)
        with pytest.raises(tensorshm.ResourceExhaustedError):
            c.create((2 << 20,), "uint8")
        m = Scrape(port)
        assert m("tensorshm_allocation_failures_total", reason="quota") == 1
        assert m("tensorshm_allocation_failures_total", reason="pool") == 0
        assert m.ops("create", "RESOURCE_EXHAUSTED") == 1
        del c
    finally:
        assert d.stop() == 0


def _refused(*metrics_args: str) -> subprocess.CompletedProcess:
    run_dir = tempfile.mkdtemp(prefix="tsm-py-metrics-bad-")
    prefix = f"tsmpy-metrics-bad-{os.getpid()}"
    daemon_path = os.environ.get("TENSORSHMD", str(ROOT / "build" / "tensorshmd"))
    result = subprocess.run(
        [daemon_path, "--socket", os.path.join(run_dir, "s.sock"), "--shm-prefix", prefix,
         "--host-pool", "16Mi", *metrics_args],
        capture_output=True, text=True, timeout=60)
    assert not list(pathlib.Path("/dev/shm").glob(prefix + "*")), "left shm objects behind"
    assert not os.path.exists(os.path.join(run_dir, "s.sock"))
    os.rmdir(run_dir)
    return result


@pytest.mark.parametrize("value", ["127.0.0.1", "127.0.0.1:99999", "localhost:http",
                                   "::1:9464", "[::1", ":9464", ""])
def test_a_bad_metrics_value_is_refused_naming_it(value):
    result = _refused("--metrics", value)
    assert result.returncode == 2, result
    assert f'--metrics = "{value}"' in result.stderr, result.stderr


def test_a_port_in_use_fails_start_up_naming_it(daemon):
    value = f"127.0.0.1:{daemon.metrics_port}"
    result = _refused("--metrics", value)
    assert result.returncode == 1, result
    assert f'--metrics = "{value}"' in result.stderr, result.stderr
    assert "in use" in result.stderr, result.stderr


def test_a_host_that_does_not_resolve_fails_start_up(daemon):
    result = _refused("--metrics", "no-such-host.invalid:0")
    assert result.returncode == 1, result
    assert '--metrics = "no-such-host.invalid:0": host' in result.stderr, result.stderr


def test_sigterm_stops_the_metrics_server_too():
    d = Daemon("metrics-stop", host_pool="16Mi",
               extra_args=("--metrics", "[::1]:0", "--log-level", "info"))
    port = int(_logged(d, r"metrics on http://\[::1\]:(\d+)/metrics")[1])
    with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=10) as response:
        assert b"tensorshm_sessions 0" in response.read()
    # An open keep-alive connection does not hold the stop up.
    with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=10):
        assert d.stop() == 0
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=5)


def test_evictions_and_waiting_creates_equal_stat():
    """--evict lru and a create waiting for memory: the figures follow Stat's."""
    mib = 1 << 20
    d = Daemon(f"metrics-evict-{os.getpid()}"[:20], host_pool="4Mi",
               extra_args=("--segment-size", "4Mi", "--evict", "lru", "--metrics", "127.0.0.1:0",
                           "--log-level", "info"))
    try:
        port = int(_logged(d, r"metrics: serving http://127\.0\.0\.1:(\d+)/metrics")[1])
        client = tensorshm.connect(d.socket, client_name="pytest")
        for i in range(4):
            client.put(f"e{i}", np.full(mib, i, dtype=np.uint8))
        # The pool is full of unleased tensors: a 2 MiB create evicts the two oldest.
        made = client.create((2 * mib,), "uint8")
        stat = quiet_stat(client)
        m = Scrape(port)
        assert stat["evicted_tensors"] == 2 and stat["evicted_bytes"] == 2 * mib
        assert m("tensorshm_evicted_tensors_total") == 2
        assert m("tensorshm_evicted_bytes_total") == 2 * mib
        assert m("tensorshm_names") == stat["names"] == 2

        # Now everything is leased or unpublished: a create with a timeout waits.
        held = [client.get("e2"), client.get("e3")]
        waiter = tensorshm.connect(d.socket, client_name="waiter")
        outcome: dict = {}

        def create() -> None:
            try:
                outcome["value"] = waiter.create((mib,), "uint8", timeout=60)
            except BaseException as e:  # noqa: BLE001 - checked below
                outcome["error"] = e

        import threading
        thread = threading.Thread(target=create)
        thread.start()
        assert wait_for(lambda: client.stat()["creates_waiting"] == 1)
        assert Scrape(port)("tensorshm_creates_waiting") == 1
        del made  # the unpublished 2 MiB buffer goes: the waiting create fits
        thread.join(timeout=60)
        assert "error" not in outcome, outcome
        assert quiet_stat(client)["creates_waiting"] == 0
        after = Scrape(port)
        assert after("tensorshm_creates_waiting") == 0
        assert after("tensorshm_evicted_tensors_total") == 2  # leased ones were not evicted
        assert after.ops("create") >= 2
        del held, outcome
    finally:
        assert d.stop() == 0
