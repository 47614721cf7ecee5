"""tensorshm.Daemon across pid namespaces (containers of one Pod sharing /dev/shm and the temp
directory): a Daemon start reclaims only what is provably dead, so each Daemon keeps serving
whoever starts after it, and what a killed one left is still reclaimed."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

import tensorshm

from conftest import _tensorshmd, wait_for


def _can_unshare_pid() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True,
                              timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


pytestmark = pytest.mark.skipif(
    not _can_unshare_pid(),
    reason="needs `unshare --pid --fork` (util-linux, and root or user namespaces) to start a "
           "Daemon in another pid namespace")


@pytest.fixture(autouse=True)
def daemon_binary(monkeypatch):
    monkeypatch.setenv("TENSORSHMD", _tensorshmd())


def shm_objects(prefix: str) -> list[str]:
    return sorted(p.name for p in pathlib.Path("/dev/shm").glob(f"{prefix}.*"))


def held(path: str) -> bool:
    """Whether some process holds an flock on `path`."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def put_and_get(socket: str, name: str) -> None:
    with tensorshm.connect(socket, timeout=10.0) as client:
        client.put(name, np.arange(1000, dtype=np.float32))
        with client.get(name) as x:
            assert float(np.from_dlpack(x).sum()) == 499500.0


# Run as pid 1 of a new pid namespace: a Daemon serving until its stdin closes.
NAMESPACED = """
import sys, tensorshm
with tensorshm.Daemon(host_pool="32Mi", segment_size="8Mi", log_level="warning") as daemon:
    print(daemon.socket, daemon.prefix, daemon.directory, flush=True)
    sys.stdin.readline()
"""


class NamespacedDaemon:
    """A Daemon whose Python process is pid 1 of a pid namespace of its own, all of it (unshare,
    Python, tensorshmd) in a process group of its own."""

    def __init__(self) -> None:
        self.unshare = subprocess.Popen(
            ["unshare", "--pid", "--kill-child", sys.executable, "-c", NAMESPACED],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        assert self.unshare.stdout is not None and self.unshare.stderr is not None
        line = self.unshare.stdout.readline()  # or '' once it failed (Daemon's start is bounded)
        if not line:
            self.unshare.wait(timeout=30)
            pytest.fail(f"the namespaced Daemon did not start: {self.unshare.stderr.read()}")
        self.socket, self.prefix, self.directory = line.split()

    def stop(self) -> None:
        """Stops it as a program would (its with block ends); kills it if it does not stop."""
        assert self.unshare.stdin is not None and self.unshare.stderr is not None
        self.unshare.stdin.close()
        try:
            code = self.unshare.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        assert code == 0, self.unshare.stderr.read()

    def kill(self) -> None:
        """SIGKILL to all its processes at once, as a container runtime (or the OOM killer)
        kills a container: its tensorshmd has no time to clean up. Once unshare is reaped its
        group is gone (--kill-child), and its number may be another's: nothing is sent."""
        if self.unshare.poll() is None:
            os.killpg(self.unshare.pid, signal.SIGKILL)
            self.unshare.wait(timeout=30)


@contextlib.contextmanager
def namespaced_daemon() -> Iterator[NamespacedDaemon]:
    daemon = NamespacedDaemon()
    try:
        yield daemon
    finally:
        if daemon.unshare.poll() is None:
            daemon.stop()


def test_daemons_in_two_pid_namespaces_keep_serving_whichever_starts_last():
    with tensorshm.Daemon(host_pool="32Mi", segment_size="8Mi", log_level="warning") as here:
        put_and_get(here.socket, "before")
        # Its start looks at this Daemon's names from a namespace where this process's pid is
        # nobody's: a pid is no sign of life there.
        with namespaced_daemon() as there:
            put_and_get(here.socket, "after-the-other-started")
            put_and_get(there.socket, "there")
            with tensorshm.Daemon(host_pool="16Mi", segment_size="8Mi",
                                  log_level="warning") as third:
                put_and_get(there.socket, "there-after-a-third-started")
                put_and_get(third.socket, "third")
            put_and_get(here.socket, "still-here")
            there.stop()
        assert shm_objects(there.prefix) == []
        assert not os.path.exists(there.directory)
        put_and_get(here.socket, "after-the-other-stopped")


def test_a_start_reclaims_what_a_killed_daemon_in_another_pid_namespace_left():
    with namespaced_daemon() as there:
        try:
            put_and_get(there.socket, "x")
            there.kill()
            owner_lock = os.path.join(there.directory, "owner.lock")
            assert wait_for(lambda: not held(owner_lock), timeout=30), "the namespace lives on"
            assert f"{there.prefix}.lock" in shm_objects(there.prefix)  # nobody left to clean
            assert os.path.isdir(there.directory)
            with tensorshm.Daemon(host_pool="16Mi", segment_size="8Mi", log_level="warning"):
                assert shm_objects(there.prefix) == []
                assert not os.path.exists(there.directory)
        finally:  # what a failed check leaves
            there.kill()
            for name in shm_objects(there.prefix):
                os.unlink(f"/dev/shm/{name}")
            shutil.rmtree(there.directory, ignore_errors=True)
