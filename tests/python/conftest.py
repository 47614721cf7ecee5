"""Fixtures: a real tensorshmd per test module, and clients connected to it."""

from __future__ import annotations

import importlib
import inspect
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types

import pytest

import tensorshm

# waits.py lies beside this file, which tests/triton and tests/multinode load by its path.
if str(pathlib.Path(__file__).parent) not in sys.path:
    sys.path.append(str(pathlib.Path(__file__).parent))
from waits import sleeping_on_shared_futex  # noqa: E402 - after sys.path

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tensorshmd() -> str:
    path = os.environ.get("TENSORSHMD", str(ROOT / "build" / "tensorshmd"))
    if not os.access(path, os.X_OK):
        pytest.exit(f"tensorshmd not found at {path}: build it (make build) or set TENSORSHMD", 2)
    return path


# Every shm prefix a Daemon of this process used: pytest_sessionfinish fails the run on what
# any of them left in /dev/shm.
PREFIXES: set[str] = set()
# Every directory a Daemon of this process made (its socket, its log): pytest_sessionfinish
# removes them; a restart reuses its predecessor's socket, so none goes earlier.
DIRS: set[str] = set()


class Daemon:
    """A tensorshmd on its own socket and shm prefix, stopped with SIGTERM.

    A restart passes the stopped daemon's ``socket`` and ``prefix``; a given prefix is reused as
    it is (its segments are not cleaned up first). A daemon with --keep-segments leaves them at
    stop(): end its test with remove().
    """

    def __init__(self, name: str, host_pool: str = "256Mi", extra_args: tuple = (),
                 env: dict | None = None, socket: str | None = None,
                 prefix: str | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix=f"tsm-py-{name}-")
        DIRS.add(self.dir)
        self.socket = socket or os.path.join(self.dir, "tensorshm.sock")
        self.prefix = prefix or f"tsmpy-{name}-{os.getpid()}"
        if prefix is None:
            for leftover in pathlib.Path("/dev/shm").glob(self.prefix + ".*"):
                leftover.unlink()
        PREFIXES.add(self.prefix)
        self.log = open(os.path.join(self.dir, "daemon.log"), "w+")
        self.process = subprocess.Popen(
            [_tensorshmd(), "--socket", self.socket, "--shm-prefix", self.prefix,
             "--host-pool", host_pool, "--segment-size", "64Mi", "--log-level", "warning",
             *extra_args],
            stdout=self.log, stderr=subprocess.STDOUT,
            env=None if env is None else {**os.environ, **env},
        )
        deadline = time.monotonic() + 20
        while not os.path.exists(self.socket):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError(f"tensorshmd did not start: {self.log.read()}")
            time.sleep(0.01)

    def stop(self) -> int:
        self.process.terminate()
        code = self.process.wait(timeout=20)
        self.log.close()
        return code

    def remove(self) -> int | None:
        """Stops the daemon if it runs, then removes what its prefix left in /dev/shm (kept
        segments, a killed daemon's objects). Its exit code, None if it was not running."""
        code = self.stop() if self.process.poll() is None else None
        for path in pathlib.Path("/dev/shm").glob(self.prefix + ".*"):
            path.unlink(missing_ok=True)
        return code


@pytest.fixture(scope="module")
def daemon(request):
    d = Daemon(request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")[:20])
    yield d
    assert d.stop() == 0


@pytest.fixture
def client(daemon):
    c = tensorshm.connect(daemon.socket, client_name="pytest")
    yield c


def pytest_sessionfinish(session, exitstatus) -> None:
    """A test that leaves its daemon's objects in /dev/shm fails the run (they are removed, and
    named). The emulated CUDA driver (tests/support/fake_cuda) names its device memory and events
    /dev/shm/tsmfakecu.<pid>.*; a process that exits holding one (a producer child whose event
    outlives it, as a real driver's would not) leaves the file behind. Remove those of this
    process and of processes that are gone."""
    for directory in DIRS:
        shutil.rmtree(directory, ignore_errors=True)
    left = sorted(p for prefix in PREFIXES for p in pathlib.Path("/dev/shm").glob(prefix + ".*"))
    if left:
        for path in left:
            path.unlink(missing_ok=True)
        print(f"\nleft in /dev/shm by this run's daemons (removed now): "
              f"{', '.join(p.name for p in left)}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    for path in pathlib.Path("/dev/shm").glob("tsmfakecu.*.*"):
        pid = path.name.split(".")[1]
        if not pid.isdigit():
            continue
        if int(pid) != os.getpid() and os.path.exists(f"/proc/{pid}"):
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            pass


@pytest.fixture
def small_daemon(request):
    """A daemon of one 4 MiB segment: a 4 MiB tensor fills its pool."""
    d = Daemon(f"small{request.node.name[5:13]}", host_pool="4Mi",
               extra_args=("--segment-size", "4Mi"))
    yield d
    assert d.stop() == 0


def in_thread(fn):
    """Runs fn() in a daemon thread; returns (thread, outcome dict with "value" or "error")."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def own_leases(client) -> int:
    """The leases this client's session holds (RPC and fast path) once its releases are applied:
    unlike stat()["leases"], untouched by other sessions (earlier tests' clients end on their
    own schedule)."""
    client.flush()
    own = [s for s in client.sessions() if s["own"]]
    assert len(own) == 1, own
    return int(own[0]["rpc_leases"] + own[0]["page_leases"])


def wait_for(predicate, timeout: float = 10.0) -> bool:
    """Polls `predicate` until true (bounded; the daemon reclaims within milliseconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def waiting(client, pid: int) -> bool:
    """Whether process `pid` (a client of `client`'s daemon) is in a wait: a get asleep on the
    fast path's futex, or a get or create the daemon holds waiting."""
    if sleeping_on_shared_futex(pid):
        return True
    stats = client.stat()
    return stats["creates_waiting"] > 0 or any(
        s["waiting_acquires"] > 0 for s in client.sessions() if s["pid"] == pid)


def sigstop(pid: int) -> None:
    """Stops process `pid` (SIGSTOP) and waits until every one of its threads is stopped: kill()
    returns before they all are, and a thread still running may yet answer a call."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
            try:
                state = task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, IndexError):
                continue  # a thread that ended meanwhile
            if state not in ("T", "t"):
                return False
        return True

    assert wait_for(stopped, timeout=10), f"process {pid} did not stop within 10 s"


def run_python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (a separate client process)."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout)


# ---- the ecosystem tests (make test-ecosystem) ----
#
# A test is an ecosystem test when it is marked `ecosystem` (pytestmark = pytest.mark.ecosystem),
# when its module holds one of the optional packages below at module level (e.g.
# `torch = pytest.importorskip("torch")`), or when its function imports one or importorskips it.
# `pytest -m ecosystem` selects them. With TSM_REQUIRE_ECOSYSTEM=1 (make test-ecosystem) every
# package below must import, and a skipped test fails: a run that skipped must not pass.

OPTIONAL_PACKAGES = ("torch", "jax", "pyarrow", "nanoarrow", "onnxruntime")
REQUIRED_IN_ECOSYSTEM_RUN = OPTIONAL_PACKAGES + ("tvm_ffi",)
_OPTIONAL_USE = re.compile(
    r"importorskip\(\s*[\"'](%s)\b|^\s*(import|from)\s+(%s)\b"
    % ("|".join(OPTIONAL_PACKAGES), "|".join(OPTIONAL_PACKAGES)), re.MULTILINE)


def _require_ecosystem() -> bool:
    return os.environ.get("TSM_REQUIRE_ECOSYSTEM", "") not in ("", "0")


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "ecosystem: needs an optional package (torch, jax, pyarrow, nanoarrow, "
        "onnxruntime); make test-ecosystem runs these with skips turned into failures")
    if _require_ecosystem():
        missing = []
        for package in REQUIRED_IN_ECOSYSTEM_RUN:
            try:
                importlib.import_module(package)
            except Exception as error:  # noqa: BLE001 - any failure to import counts
                missing.append(f"{package} ({type(error).__name__}: {error})")
        if missing:
            pytest.exit("TSM_REQUIRE_ECOSYSTEM=1 but these do not import from .venv: "
                        + ", ".join(missing) + "; install scripts/requirements-ecosystem.txt "
                        "(make test-ecosystem does)", 2)


def _uses_optional_package(item) -> bool:
    module = getattr(item, "module", None)
    if module is not None:
        for value in vars(module).values():
            if isinstance(value, types.ModuleType) and \
                    value.__name__.split(".")[0] in OPTIONAL_PACKAGES:
                return True
    function = getattr(item, "function", None)
    if function is None:
        return False
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    return _OPTIONAL_USE.search(source) is not None


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.get_closest_marker("ecosystem") is None and _uses_optional_package(item):
            item.add_marker(pytest.mark.ecosystem)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _require_ecosystem() and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped in an ecosystem run (TSM_REQUIRE_ECOSYSTEM=1): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if _require_ecosystem() and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"module skipped in an ecosystem run (TSM_REQUIRE_ECOSYSTEM=1): {reason}"
