"""Ctrl-C in waits: a child interpreter blocked in get(timeout=None), get_many or a create waiting
for memory gets SIGINT and raises KeyboardInterrupt at once (well before the wait would end),
holding no lease and no buffer afterwards. Against a daemon with the fast path (the wait is a
futex sleep in the client) and one without it (TENSORSHMD_TEST_CROSS_CANCEL_MS: the wait is an
RPC waiting in the daemon, which the cancel and its settle end)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import tensorshm
from conftest import Daemon, wait_for, waiting

CHILD = r"""
import sys, tensorshm
socket, what = sys.argv[1], sys.argv[2]
c = tensorshm.connect(socket, client_name="interrupted")

def own():
    c.flush()
    s = [s for s in c.sessions() if s["own"]][0]
    return s["rpc_leases"] + s["page_leases"], s["unpublished_tensors"]

print("waiting", flush=True)
try:
    if what == "get":
        c.get("never", timeout=None)
    elif what == "get_many":
        c.get_many(["there", "never"], timeout=None)
    else:
        c.create([1 << 20], "uint8", timeout=None)
except KeyboardInterrupt:
    leases, unpublished = own()
    print(f"interrupted leases={leases} unpublished={unpublished}", flush=True)
    raise
print("not interrupted", flush=True)
"""


@pytest.fixture(params=["fast-path", "rpc"])
def interrupt_daemon(request):
    env = {"TENSORSHMD_TEST_CROSS_CANCEL_MS": "100"} if request.param == "rpc" else None
    d = Daemon(f"intr-{request.param}", host_pool="4Mi", extra_args=("--segment-size", "4Mi"),
               env=env)
    yield d
    assert d.stop() == 0


@pytest.mark.parametrize("what", ["get", "get_many", "create"])
def test_sigint_interrupts_a_wait_and_leaves_nothing(interrupt_daemon, what):
    parent = tensorshm.connect(interrupt_daemon.socket, client_name="parent")
    if what == "get_many":
        parent.put("there", np.arange(16, dtype=np.float32))
    if what == "create":
        parent.put("filler", np.zeros(4 << 20, dtype=np.uint8))  # the whole pool
    child = subprocess.Popen([sys.executable, "-c", CHILD, interrupt_daemon.socket, what],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "waiting"
        # The wait has begun (a signal before it would be heard just the same).
        assert wait_for(lambda: waiting(parent, child.pid), timeout=30)
        assert child.poll() is None
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        code = child.wait(timeout=30)
        elapsed = time.monotonic() - sent
        out, err = child.communicate()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    print(f"{what}: KeyboardInterrupt {elapsed * 1000:.0f} ms after SIGINT")
    assert elapsed < 3, elapsed
    assert code == -signal.SIGINT, (code, out, err)  # an uncaught KeyboardInterrupt
    assert "KeyboardInterrupt" in err, err
    assert "interrupted leases=0 unpublished=0" in out, (out, err)
    # And the daemon agrees: nothing waits, and the parent (which dropped its tensors) and the
    # gone child hold nothing.
    parent.flush()
    assert wait_for(lambda: parent.stat()["sessions"] == 1)
    stat = parent.stat()
    assert stat["leases"] == 0, stat
    assert stat["creates_waiting"] == 0, stat
    parent.close()
