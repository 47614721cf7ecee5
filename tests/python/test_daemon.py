"""tensorshm.Daemon: a private tensorshmd started and stopped from Python (a notebook's first
minute), and what connect() says when no daemon serves its socket."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest

import tensorshm

from conftest import _tensorshmd, run_python, wait_for


@pytest.fixture(autouse=True)
def daemon_binary(monkeypatch):
    monkeypatch.setenv("TENSORSHMD", _tensorshmd())


def shm_objects(prefix: str) -> list[str]:
    return sorted(p.name for p in pathlib.Path("/dev/shm").glob(f"{prefix}.*"))


def test_a_private_daemon_serves_other_processes_and_leaves_nothing():
    with tensorshm.Daemon(host_pool="64Mi", segment_size="16Mi", log_level="warning") as daemon:
        assert daemon.running
        assert stat.S_IMODE(os.stat(daemon.directory).st_mode) == 0o700
        assert shm_objects(daemon.prefix)  # its catalog and segments
        with daemon.connect() as client:
            client.put("x", np.arange(1000, dtype=np.float32))
        done = run_python("import sys, numpy as np, tensorshm\n"
                          "with tensorshm.connect(sys.argv[1]) as c, c.get('x') as x:\n"
                          "    print(float(np.from_dlpack(x).sum()))", daemon.socket)
        assert done.returncode == 0 and done.stdout.strip() == "499500.0", done.stderr
    assert not daemon.running
    assert not os.path.exists(daemon.directory)
    assert shm_objects(daemon.prefix) == []


def test_flags_are_keywords_and_a_daemon_that_cannot_start_says_why():
    with tensorshm.Daemon(host_pool="32Mi", segment_size="8Mi", evict="lru",
                          allow_uid=[65534, 65533]) as daemon:
        assert daemon.connect().stat()["pools"][0]["capacity_bytes"] == 32 << 20
    with pytest.raises(tensorshm.FailedPreconditionError,
                       match=r'tensorshmd did not start: .*--host-pool = "lots"'):
        tensorshm.Daemon(host_pool="lots")
    with pytest.raises(TypeError, match="socket is chosen by Daemon"):
        tensorshm.Daemon(socket="/tmp/x.sock")


STARTER = """
import sys, time, numpy as np, tensorshm
daemon = tensorshm.Daemon(host_pool="32Mi", segment_size="8Mi")
with daemon.connect() as client:
    client.put("x", np.ones(4096, np.float32))
print(daemon.pid, daemon.prefix, daemon.directory, flush=True)
time.sleep(600)
"""


def test_sigkill_of_the_starter_stops_its_daemon_and_the_next_start_reclaims_the_rest():
    starter = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        line = starter.stdout.readline() if starter.stdout else ""
        assert line, starter.stderr.read() if starter.stderr else ""
        pid, prefix, directory = line.split()
        assert shm_objects(prefix)
    finally:
        starter.send_signal(signal.SIGKILL)
        starter.wait()
    # The kernel tells the daemon its parent died (SIGTERM): it stops and removes its segments.
    assert wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=30), f"{pid} lives on"
    assert shm_objects(prefix) == []
    assert os.path.isdir(directory)  # nobody was left to remove it ...
    with tensorshm.Daemon(host_pool="16Mi", segment_size="8Mi"):
        assert not os.path.exists(directory)  # ... until the next Daemon start


TEMP = pathlib.Path(tempfile.gettempdir())


def fake_leftovers(directory: str | None, shm: dict[str, str], owner: int | None = None,
                   owner_lock: bool = True) -> list[pathlib.Path]:
    """What a Daemon leaves, made by hand under a fresh tag: a directory (if `directory` is
    not None: its mkdtemp suffix) with an owner.lock unless not `owner_lock`, and /dev/shm
    objects (suffix -> text). `owner`: the uid to give them. Returns the paths, directory
    first."""
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    paths = []
    if directory is not None:
        paths.append(TEMP / f"tensorshm-daemon-{tag}-{directory}")
        paths[-1].mkdir(mode=0o700)
        if owner_lock:
            (paths[-1] / "owner.lock").touch(mode=0o600)
    for suffix, text in shm.items():
        paths.append(pathlib.Path(f"/dev/shm/tsmd-{tag}.{suffix}"))
        paths[-1].write_text(text)
    if owner is not None:
        for path in paths:
            os.chown(path, owner, owner)
            if path.is_dir() and owner_lock:
                os.chown(path / "owner.lock", owner, owner)
    return paths


def remove(paths: list[pathlib.Path]) -> None:
    for path in paths:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path)


@contextlib.contextmanager
def flock(path: pathlib.Path) -> Iterator[None]:
    """Holds an flock on `path` as another process would: a Daemon start opens the file anew,
    and flock sets one open file against another, in one process too."""
    with open(path, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


RECORD = "pid 7\nhost h\nsocket /run/x.sock\nstate serving\n"


def test_a_start_reclaims_only_what_is_provably_dead():
    dead = fake_leftovers("dead", {"lock": RECORD, "ctl": "", "cpu.0": ""})
    dead_elsewhere = fake_leftovers(None, {"lock": RECORD, "ctl": "", "cpu.0": ""})
    starting = fake_leftovers("starting", {}, owner_lock=False)
    live_python = fake_leftovers("live", {"ctl": ""})  # no prefix lock file: the owner decides
    live_elsewhere = fake_leftovers(None, {"lock": RECORD, "ctl": ""})
    unrecorded = fake_leftovers(None, {"lock": "", "ctl": ""})
    unlocked = fake_leftovers(None, {"ctl": "", "cpu.0": ""})
    left = starting + unrecorded + unlocked
    try:
        with flock(live_python[0] / "owner.lock"), flock(live_elsewhere[0]):
            with tensorshm.Daemon(host_pool="16Mi", segment_size="8Mi", log_level="warning"):
                assert not any(p.exists() for p in dead + dead_elsewhere)
                assert all(p.exists() for p in left + live_python + live_elsewhere)
        # Their locks are free now: their holders are gone.
        with tensorshm.Daemon(host_pool="16Mi", segment_size="8Mi", log_level="warning"):
            assert not any(p.exists() for p in live_python + live_elsewhere)
            assert all(p.exists() for p in left)
    finally:
        remove(dead + dead_elsewhere + left + live_python + live_elsewhere)


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's files needs root")
def test_a_start_leaves_other_users_leftovers_and_links(tmp_path):
    others = (fake_leftovers("other", {"ctl": ""}, owner=65534) +
              fake_leftovers(None, {"lock": RECORD, "ctl": ""}, owner=65534))
    (tmp_path / "owner.lock").touch()
    link = TEMP / f"tensorshm-daemon-{os.getpid()}-{secrets.token_hex(4)}-link"
    link.symlink_to(tmp_path)
    try:
        with tensorshm.Daemon(host_pool="16Mi", segment_size="8Mi", log_level="warning"):
            assert all(p.exists() for p in others)
            assert link.is_symlink() and (tmp_path / "owner.lock").exists()
    finally:
        remove(others + [link])


def test_connect_without_a_daemon_names_the_path_its_source_and_the_two_ways(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORSHM_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(tensorshm.ConnectionError) as info:
        tensorshm.connect()
    message = str(info.value)
    for part in (f"unix:{tmp_path}/tensorshm.sock", "no socket file",
                 "$XDG_RUNTIME_DIR/tensorshm.sock ($TENSORSHM_SOCKET unset)", "`tensorshmd`",
                 "`tensorshm.Daemon()`"):
        assert part in message, (part, message)
    # A path the program gave is called that, in every language (not ClientOptions::socket).
    with pytest.raises(tensorshm.ConnectionError) as info:
        tensorshm.connect(str(tmp_path / "given.sock"))
    assert "no socket file at that path (the path this program gave)" in str(info.value), \
        info.value
    assert "ClientOptions" not in str(info.value)
    if os.path.exists(f"/tmp/tensorshm-{os.getuid()}/tensorshm.sock"):
        return  # `make run` serves this user's last default path here: nothing more to see
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    with pytest.raises(tensorshm.ConnectionError) as info:
        tensorshm.connect()
    assert f"unix:/tmp/tensorshm-{os.getuid()}/tensorshm.sock" in str(info.value)
    assert "($TENSORSHM_SOCKET and $XDG_RUNTIME_DIR unset)" in str(info.value)


def test_readme_first_try_runs():
    """README's first Python example (a Daemon of the program's own, in its quick start), as
    written."""
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    example = readme.split("\n## Quick start\n", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "tensorshm.Daemon(" in example, example
    done = run_python(example)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0 1 2 3 4 5 6 7 8 9]", done.stdout
