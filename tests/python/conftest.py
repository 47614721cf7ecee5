"""Fixtures: a real tensorshmd per test module, and clients connected to it."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time

import pytest

import tensorshm

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tensorshmd() -> str:
    path = os.environ.get("TENSORSHMD", str(ROOT / "build" / "tensorshmd"))
    if not os.access(path, os.X_OK):
        pytest.exit(f"tensorshmd not found at {path}: build it (make build) or set TENSORSHMD", 2)
    return path


class Daemon:
    """A tensorshmd on its own socket and shm prefix, stopped with SIGTERM.

    A restart passes the stopped daemon's ``socket`` and ``prefix``; a given prefix is reused as
    it is (its segments are not cleaned up first).
    """

    def __init__(self, name: str, host_pool: str = "256Mi", extra_args: tuple = (),
                 env: dict | None = None, socket: str | None = None,
                 prefix: str | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix=f"tsm-py-{name}-")
        self.socket = socket or os.path.join(self.dir, "tensorshm.sock")
        self.prefix = prefix or f"tsmpy-{name}-{os.getpid()}"
        if prefix is None:
            for leftover in pathlib.Path("/dev/shm").glob(self.prefix + ".*"):
                leftover.unlink()
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


@pytest.fixture(scope="module")
def daemon(request):
    d = Daemon(request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")[:20])
    yield d
    assert d.stop() == 0


@pytest.fixture
def client(daemon):
    c = tensorshm.connect(daemon.socket, client_name="pytest")
    yield c


def wait_for(predicate, timeout: float = 10.0) -> bool:
    """Polls `predicate` until true (bounded; the daemon reclaims within milliseconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def run_python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (a separate client process)."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout)
