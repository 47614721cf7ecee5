"""connect(server_uid=...): a client refuses a socket served by a uid it does not expect.

A real tensorshmd runs as uid 65534 (setpriv) and admits root; the root client refuses it by
default and uses it once its uid is named, or where its socket's directory is one only root could
have made for it (under /run, as the packaged daemon's /run/tensorshm).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

import numpy as np
import pytest

import tensorshm
from conftest import _tensorshmd


def _tensorshmctl() -> str:
    return os.path.join(os.path.dirname(_tensorshmd()), "tensorshmctl")

NOBODY = 65534

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to start a daemon as uid 65534")


def _nobody_daemon(base: str):
    top = tempfile.mkdtemp(prefix="tsm-py-serveruid-", dir=base)
    os.chmod(top, 0o755)
    run = os.path.join(top, "run")
    os.mkdir(run, 0o700)
    os.chown(run, NOBODY, NOBODY)
    socket = os.path.join(run, "tensorshm.sock")
    prefix = f"tsmpy-serveruid-{os.getpid()}"
    log = open(os.path.join(top, "daemon.log"), "w+")
    process = subprocess.Popen(
        ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
         _tensorshmd(), "--socket", socket, "--shm-prefix", prefix, "--host-pool", "64Mi",
         "--segment-size", "16Mi", "--log-level", "warning", "--allow-uid", "0"],
        stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while not os.path.exists(socket):
        if process.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            raise RuntimeError(f"tensorshmd as uid {NOBODY} did not start: {log.read()}")
        time.sleep(0.01)
    yield socket, process.pid
    process.terminate()
    assert process.wait(timeout=20) == 0
    log.close()
    shutil.rmtree(top)


@pytest.fixture
def nobody_daemon():
    """Its socket in /tmp/tsm-py-serveruid-*/run: /tmp is writable by everyone, so nothing vouches
    for the directory's owner."""
    yield from _nobody_daemon("/tmp")


@pytest.fixture
def vouched_nobody_daemon():
    """Its socket in /run/tsm-py-serveruid-*/run, uid 65534's, below directories only root can
    write: as systemd makes /run/tensorshm for the packaged daemon."""
    yield from _nobody_daemon("/run")


def test_refuses_another_uids_daemon_by_default(nobody_daemon):
    socket, pid = nobody_daemon
    with pytest.raises(tensorshm.PermissionError) as info:
        tensorshm.connect(socket, client_name="default")
    message = str(info.value)
    print("refused:", message)
    assert f"unix:{socket}" in message
    assert f"served by uid {NOBODY} (pid {pid})" in message
    assert "expects uid 0" in message
    assert f"server_uid={NOBODY}" in message
    assert f"TENSORSHM_SERVER_UID={NOBODY}" in message
    assert "a directory only root could have made for it" in message
    assert isinstance(info.value, PermissionError)


def test_named_server_uid_connects_and_works(nobody_daemon):
    socket, _ = nobody_daemon
    client = tensorshm.connect(socket, client_name="named", server_uid=NOBODY)
    data = np.arange(4096, dtype=np.int32)
    put = client.put("named", data)
    got = client.get("named")
    assert np.array_equal(np.from_dlpack(got), data)
    del got, put
    client.flush()


def test_server_uid_must_be_a_uid(nobody_daemon):
    socket, _ = nobody_daemon
    with pytest.raises(ValueError, match="server_uid = -1"):
        tensorshm.connect(socket, server_uid=-1)


def test_server_uid_from_the_environment(nobody_daemon, monkeypatch):
    """$TENSORSHM_SERVER_UID names the uid when connect() does not (the sidecar manifests' way);
    a value that is not a uid is refused naming the variable."""
    socket, _ = nobody_daemon
    monkeypatch.setenv("TENSORSHM_SERVER_UID", str(NOBODY))
    with tensorshm.connect(socket, client_name="from-env") as client:
        client.put("env", np.arange(4, dtype=np.int32))
        np.testing.assert_array_equal(np.from_dlpack(client.get("env")), np.arange(4))
    monkeypatch.setenv("TENSORSHM_SERVER_UID", "nobody")
    with pytest.raises(tensorshm.InvalidArgumentError, match=r'\$TENSORSHM_SERVER_UID = "nobody"'):
        tensorshm.connect(socket, client_name="bad-env")
    monkeypatch.setenv("TENSORSHM_SERVER_UID", "0")  # root only: uid 65534 refused again
    with pytest.raises(tensorshm.PermissionError):
        tensorshm.connect(socket, client_name="root-env")


def test_trusts_the_daemon_of_a_directory_root_made_for_it(vouched_nobody_daemon):
    """No server_uid, no variable: the socket's directory is uid 65534's and every directory
    above it root's alone, so root made it for that uid."""
    socket, _ = vouched_nobody_daemon
    with tensorshm.connect(socket, client_name="vouched") as client:
        client.put("vouched", np.arange(8, dtype=np.int32))
        np.testing.assert_array_equal(np.from_dlpack(client.get("vouched")), np.arange(8))
    health = subprocess.run([_tensorshmctl(), "--socket", socket, "--timeout", "5s", "health"],
                            capture_output=True, text=True)
    assert health.returncode == 0 and health.stdout.strip() == "SERVING", health


def test_tensorshmctl_takes_the_server_uid_from_the_environment(nobody_daemon):
    """Every subcommand, health included, honours $TENSORSHM_SERVER_UID as clients do."""
    socket, _ = nobody_daemon
    base = [_tensorshmctl(), "--socket", socket, "--timeout", "5s"]
    env = {k: v for k, v in os.environ.items() if k != "TENSORSHM_SERVER_UID"}
    for command in (["health"], ["status"]):
        refused = subprocess.run(base + command, capture_output=True, text=True, env=env)
        assert refused.returncode == 1, refused
        assert f"TENSORSHM_SERVER_UID={NOBODY}" in refused.stderr, refused.stderr
        named = subprocess.run(base + command, capture_output=True, text=True,
                               env=dict(env, TENSORSHM_SERVER_UID=str(NOBODY)))
        assert named.returncode == 0, named
    bad = subprocess.run(base + ["health"], capture_output=True, text=True,
                         env=dict(env, TENSORSHM_SERVER_UID="nobody"))
    assert bad.returncode == 2 and '$TENSORSHM_SERVER_UID = "nobody"' in bad.stderr, bad
