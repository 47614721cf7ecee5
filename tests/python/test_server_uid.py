"""connect(server_uid=...): a client refuses a socket served by a uid it does not expect.

A real tensorshmd runs as uid 65534 (setpriv) and admits root; the root client refuses it by
default and uses it once its uid is named, or where it serves /run/tensorshm/tensorshm.sock from a
/run/tensorshm only root could have made for it (as systemd makes the packaged daemon's).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
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


@pytest.fixture
def nobody_daemon():
    """Its socket in /tmp/tsm-py-serveruid-*/run: not the packaged daemon's path, so nothing
    vouches for the directory's owner."""
    top = tempfile.mkdtemp(prefix="tsm-py-serveruid-")
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


# In a mount namespace of its own, over a private /run (mode 0755, root's): /run/tensorshm made
# by root for uid 65534 as systemd's RuntimeDirectory= makes it, and /run/other made the same way.
# A uid-65534 daemon serves each; a root client with no settings at all finds and trusts the one at
# /run/tensorshm/tensorshm.sock, and refuses the other (the rule holds for that path only).
PACKAGED = r"""
set -eu
mount -t tmpfs -o mode=0755 tmpfs /run
for dir in tensorshm other; do
  mkdir -m 0711 /run/$dir && chown 65534:65534 /run/$dir
  setpriv --reuid 65534 --regid 65534 --clear-groups "$TENSORSHMD" \
    --socket /run/$dir/tensorshm.sock --shm-prefix "$PREFIX-$dir" --host-pool 64Mi \
    --segment-size 16Mi --log-level warning --allow-uid 0 >"$LOGS/$dir.log" 2>&1 &
done
for _ in $(seq 200); do
  [ -S /run/tensorshm/tensorshm.sock ] && [ -S /run/other/tensorshm.sock ] && break
  sleep 0.05
done
"$PYTHON" -c '
import numpy as np, tensorshm
with tensorshm.connect(client_name="packaged") as c:
    c.put("packaged", np.arange(8, dtype=np.int32))
    print("default:", c.socket, np.from_dlpack(c.get("packaged")).tolist())
try:
    tensorshm.connect("/run/other/tensorshm.sock")
    print("other: trusted")
except tensorshm.PermissionError as e:
    print("other: refused:", e)
'
echo "tensorshmctl health: $("$TENSORSHMCTL" --timeout 5s health)"
kill -TERM $(jobs -p)
wait
"""


def test_trusts_the_packaged_daemon_of_run_tensorshm_only(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) for a /run of its own")
    own = tmp_path / "xdg"  # no daemon of this user's: the client goes on to the system's
    own.mkdir(mode=0o700)
    prefix = f"tsmpy-packaged-{os.getpid()}"
    env = {k: v for k, v in os.environ.items()
           if k not in ("TENSORSHM_SOCKET", "TENSORSHM_SERVER_UID")}
    env.update(XDG_RUNTIME_DIR=str(own), TENSORSHMD=_tensorshmd(), TENSORSHMCTL=_tensorshmctl(),
               PYTHON=sys.executable, PREFIX=prefix, LOGS=str(tmp_path))
    try:
        done = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c",
                               PACKAGED], capture_output=True, text=True, env=env, timeout=120)
    finally:
        for path in glob.glob(f"/dev/shm/{prefix}-*"):
            os.unlink(path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "default: /run/tensorshm/tensorshm.sock [0, 1, 2, 3, 4, 5, 6, 7]" in out, out
    assert "other: refused:" in out and f"served by uid {NOBODY}" in out, out
    assert "tensorshmctl health: SERVING" in out, out


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
