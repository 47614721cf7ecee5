"""A client across a daemon restart, and across fork(): lease status, reconnection, and children
that must connect again."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import threading

import numpy as np
import pytest

import tensorshm
from conftest import Daemon, run_python, wait_for


def within(seconds: float, call):
    """call() on a helper thread: its result or exception, or a test failure if it has not
    returned in `seconds` (a hang fails the test instead of blocking the run)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{call.__qualname__}() did not return in {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def leases(client) -> int:
    within(30, client.flush)
    return client.stat()["leases"]


@pytest.fixture
def own_daemon(request):
    """A daemon for this test alone, on a fixed socket and --shm-prefix."""
    d = Daemon(request.node.name.replace("_", "-")[5:25])
    yield d
    assert d.stop() == 0


def test_alive_for_fresh_tensors(own_daemon):
    client = tensorshm.connect(own_daemon.socket)
    put = client.put("alive/a", np.arange(16, dtype=np.int32))
    got = client.get("alive/a")
    assert put.alive and got.alive
    assert put.check() is None and got.check() is None
    w = client.create((8,), "uint8")
    assert w.alive and w.check() is None  # unpublished: no lease to lose
    w.publish("alive/w")
    assert w.alive and w.check() is None  # the lease taken at publish
    back = through_exchange_api(got)
    assert back is not got and back.alive and back.check() is None


def through_exchange_api(tensor: tensorshm.Tensor) -> tensorshm.Tensor:
    """A new tensorshm.Tensor over `tensor`'s export, made by the DLPack exchange API's
    managed_tensor_from_py_object_no_sync and managed_tensor_to_py_object_no_sync (as a library
    handing our tensor back to Python would)."""
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    api = get_pointer(tensorshm.Tensor.__dlpack_c_exchange_api__, b"dlpack_exchange_api")
    slots = [ctypes.c_void_p.from_address(api + 16 + 8 * i).value for i in range(5)]
    from_py = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object,
                                ctypes.POINTER(ctypes.c_void_p))(slots[1])
    to_py = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p,
                              ctypes.POINTER(ctypes.py_object))(slots[2])
    managed = ctypes.c_void_p()
    assert from_py(tensor, ctypes.byref(managed)) == 0
    result = ctypes.py_object()
    assert to_py(managed, ctypes.byref(result)) == 0
    back = result.value
    # to_py handed over a new reference that ctypes does not own: drop it once.
    ctypes.pythonapi.Py_DecRef.argtypes = [ctypes.py_object]
    ctypes.pythonapi.Py_DecRef(back)
    return back


PUT_Y = """
import sys, numpy as np, tensorshm
client = tensorshm.connect(sys.argv[1])
client.put("y", np.full(4096, 42, np.uint8))
"""


def test_restarted_daemon_serves_its_own_bytes_and_reports_lost_leases():
    first = Daemon("restart")
    current = first
    try:
        a = tensorshm.connect(first.socket, client_name="restart-a")
        x = a.put("x", np.full(4096, 7, np.uint8))
        view = np.from_dlpack(x)
        back = through_exchange_api(x)
        assert (view == 7).all() and x.alive and back.alive
        instance = a.daemon_instance

        # A clean stop removes the segments; the new daemon makes new ones under the same names.
        assert first.stop() == 0
        current = Daemon("restart", socket=first.socket, prefix=first.prefix)
        result = run_python(PUT_Y, current.socket)
        assert result.returncode == 0, result.stderr

        assert wait_for(lambda: a.daemon_instance != instance, timeout=30), \
            "client A did not reconnect"
        y = a.get("y")
        # With mappings keyed by segment alone, A read its mapping of x's old segment here: 7s.
        assert (np.from_dlpack(y) == 42).all()
        assert y.alive

        # The new daemon did not take x's lease back: reported, never silently dropped.
        assert not x.alive
        with pytest.raises(tensorshm.DataLossError, match="restarted") as info:
            x.check()
        assert info.value.code == 15
        assert not back.alive  # the same lease, seen through an export of x
        # x stays mapped: its old memory still holds its bytes.
        assert (view == 7).all() and (np.from_dlpack(x) == 7).all()
        with pytest.raises(tensorshm.DataLossError, match="did not take back"):
            within(20, a.flush)
        within(20, a.flush)  # reported once
        assert not x.alive

        del view, back, x, y
        gc.collect()
        assert wait_for(lambda: leases(a) == 0)
        assert current.stop() == 0
    finally:
        if current.process.poll() is None:
            current.stop()


@pytest.mark.parametrize("stop", ["kill", "term"])
def test_held_tensors_survive_a_kill_and_a_clean_stop_with_keep_segments(stop):
    """A lease on a replaced tensor's old version (unbound, alive only through the lease) is
    taken back by the next daemon whether the last one was SIGKILLed or stopped cleanly with
    --keep-segments, which README promises "picks them up the same way"."""
    first = Daemon(f"held-{stop}", extra_args=("--keep-segments",))
    current = first
    try:
        c = tensorshm.connect(first.socket, client_name=f"held-{stop}")
        c.put("kept", np.arange(1000, dtype=np.uint8)).release()
        c.put("replaced", (np.arange(1000) * 7 % 251).astype(np.uint8)).release()
        kept = c.get("kept")
        old = c.get("replaced")
        c.put("replaced", np.zeros(1000, dtype=np.uint8), replace=True).release()
        instance = c.daemon_instance

        if stop == "kill":
            first.process.kill()
            first.process.wait(timeout=20)
            first.log.close()
            os.unlink(first.socket)  # a killed daemon leaves its socket file
        else:
            assert first.stop() == 0
        current = Daemon(f"held-{stop}", socket=first.socket, prefix=first.prefix)
        assert wait_for(lambda: c.daemon_instance != instance, timeout=30), (
            "client did not reconnect"
        )

        within(20, c.flush)  # DataLossError if the new daemon did not take a lease back
        assert kept.alive and old.alive
        kept.check()
        old.check()
        assert (np.from_dlpack(kept) == np.arange(1000, dtype=np.uint8)).all()
        assert (np.from_dlpack(old) == (np.arange(1000) * 7 % 251).astype(np.uint8)).all()
        current_version = c.get("replaced")
        assert (np.from_dlpack(current_version) == 0).all()
        current_version.release()
        assert leases(c) == 2

        kept.release()
        old.release()
        assert wait_for(lambda: leases(c) == 0)
        c.close()
        assert current.stop() == 0
    finally:
        if current.process.poll() is None:
            current.stop()


# The parent of the fork test runs in an interpreter of its own: a fault in the gRPC state that
# parent and child share after fork() aborts that interpreter and fails the test, not the run.
# Several children in turn, as a pool of forked workers would be.
FORK_PARENT = """
import faulthandler, gc, json, multiprocessing, os, queue, sys, time, traceback
import numpy as np, tensorshm

faulthandler.dump_traceback_later(150, exit=True)  # a hang shows where it is, then fails
socket, rounds = sys.argv[1], int(sys.argv[2])
expected = np.arange(1000, dtype=np.float32)


def within(seconds, call):
    # Flush waits without a deadline: bounded here like every other wait.
    import threading
    box = {}

    def run():
        try:
            box["value"] = call()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise AssertionError(f"{call.__qualname__}() did not return in {seconds} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def leases(client):
    within(30, client.flush)
    return client.stat()["leases"]


def allocate_through_exchange_api():
    # The DLPack exchange API's allocator, as a consumer library calls it: None, or its error.
    import ctypes
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    api = get_pointer(tensorshm.Tensor.__dlpack_c_exchange_api__, b"dlpack_exchange_api")

    class DLTensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device", ctypes.c_int32 * 2),
                    ("ndim", ctypes.c_int32), ("dtype", ctypes.c_uint8 * 4),
                    ("shape", ctypes.POINTER(ctypes.c_int64)),
                    ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]

    SetError = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p)
    allocator = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(DLTensor),
                                 ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, SetError)(
                                     ctypes.c_void_p.from_address(api + 16).value)
    shape = (ctypes.c_int64 * 1)(4)
    prototype = DLTensor(None, (ctypes.c_int32 * 2)(1, 0), 1, (ctypes.c_uint8 * 4)(1, 8, 1, 0),
                         shape, None, 0)
    managed, errors = ctypes.c_void_p(), []
    on_error = SetError(lambda ctx, kind, message: errors.append(message.decode()))
    if allocator(ctypes.byref(prototype), ctypes.byref(managed), None, on_error) != 0:
        return errors[0]
    deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(
        ctypes.c_void_p.from_address(managed.value + 16).value)  # after version, manager_ctx
    deleter(managed)
    return None


def child_main(state, results, release):
    out = {"pid": os.getpid()}
    try:
        try:
            state["client"].stat()
            out["inherited_error"] = None
        except tensorshm.FailedPreconditionError as e:
            out["inherited_error"] = str(e)
        held = state["held"]
        out["held_alive"] = held.alive
        try:
            held.check()
            out["held_check"] = None
        except tensorshm.Error as e:
            out["held_check"] = type(e).__name__
        # The inherited mapping still reads: the parent's lease keeps the memory.
        out["held_reads"] = bool(np.array_equal(np.from_dlpack(held), expected))
        del held

        # The allocator's client was the parent's: forgotten at the fork.
        out["allocator_before"] = allocate_through_exchange_api()

        fresh = tensorshm.connect(socket, client_name="fork-child", timeout=10)
        out["allocator_after"] = allocate_through_exchange_api()
        got = fresh.get("fork/t")
        out["got_reads"] = bool(np.array_equal(np.from_dlpack(got), expected))
        out["got_alive"] = got.alive
        # Only `state` refers to what the child inherited: dropping it runs the destructors
        # here, which must leave the parent's session alone.
        state.clear()
        gc.collect()
        del got
        within(30, fresh.flush)
        out["child_stat"] = fresh.stat()
    except BaseException:
        out["exception"] = traceback.format_exc()
    results.put(out)
    release.wait(timeout=60)  # stays alive, with its session, while the parent keeps calling


state = {"client": tensorshm.connect(socket, client_name="fork-parent")}
state["put"] = state["client"].put("fork/t", expected)
state["held"] = state["client"].get("fork/t")
report = {"parent_pid": os.getpid(), "parent_leases": leases(state["client"]),
          "session": state["client"].session_id, "children": []}
ctx = multiprocessing.get_context("fork")
for _ in range(rounds):
    results, release = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=child_main, args=(state, results, release))
    child.start()
    seen = {"stats": 0, "stat_errors": []}
    try:
        deadline = time.monotonic() + 60
        while "report" not in seen and time.monotonic() < deadline:
            try:
                state["client"].stat()  # the parent keeps working while the child runs
                seen["stats"] += 1
            except tensorshm.Error as e:
                seen["stat_errors"].append(f"{type(e).__name__}: {e}")
            try:
                seen["report"] = results.get(timeout=0.01)
            except queue.Empty:
                if not child.is_alive():
                    break
        for _ in range(20):  # and while the child holds its own session
            try:
                state["client"].stat()
                seen["stats"] += 1
            except tensorshm.Error as e:
                seen["stat_errors"].append(f"{type(e).__name__}: {e}")
        release.set()
        child.join(timeout=60)
        seen["child_hung"] = child.is_alive()
    finally:
        release.set()
        if child.is_alive():
            child.kill()
            child.join(timeout=10)
    seen["exitcode"] = child.exitcode
    report["children"].append(seen)
    if "report" not in seen or seen["exitcode"] != 0 or seen["stat_errors"]:
        break

client, held = state["client"], state["held"]
report["session_after"] = client.session_id
report["held_alive"] = held.alive
report["held_reads"] = bool(np.array_equal(np.from_dlpack(held), expected))
report["get_reads"] = bool(np.array_equal(np.from_dlpack(client.get("fork/t")), expected))
client.put("fork/after", np.ones(8, dtype=np.int64))
deadline = time.monotonic() + 10
while (leases(client), client.stat()["sessions"]) != (report["parent_leases"], 1):
    if time.monotonic() > deadline:
        break
    time.sleep(0.01)
report["leases_after"] = leases(client)
report["sessions_after"] = client.stat()["sessions"]
print(json.dumps(report), flush=True)
"""

FORK_ROUNDS = 16


def test_fork_children_must_connect_again_and_parent_keeps_working(own_daemon):
    result = run_python(FORK_PARENT, own_daemon.socket, str(FORK_ROUNDS), timeout=240)
    assert result.returncode == 0, f"the forking parent failed ({result.returncode}):\n" + \
        result.stderr[-6000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["parent_leases"] == 2
    for i, seen in enumerate(report["children"]):
        # The children's stderr (an abort's message, say) is in the parent's.
        where = f"child {i + 1} of {FORK_ROUNDS} (stderr: {result.stderr[-3000:]!r})"
        assert not seen["stat_errors"], f"{where}: parent's stat() failed: {seen['stat_errors']}"
        assert "report" in seen, f"{where} reported nothing (exit code {seen['exitcode']})"
        child = seen["report"]
        assert "exception" not in child, f"{where}:\n{child['exception']}"
        assert not seen["child_hung"] and seen["exitcode"] == 0, where
        message = child["inherited_error"]
        assert message is not None, f"{where}: the inherited client answered"
        assert f"process {report['parent_pid']}" in message and "connect again" in message
        assert f"process {child['pid']}" in message
        assert child["held_alive"] is False and child["held_check"] == "FailedPreconditionError"
        assert child["held_reads"] and child["got_reads"] and child["got_alive"]
        assert "no connected client" in child["allocator_before"], child["allocator_before"]
        assert child["allocator_after"] is None, child["allocator_after"]
        # The child's own session and the parent's, which the child's drops left alone.
        assert child["child_stat"]["sessions"] == 2, where
        assert seen["stats"] > 20, where
    assert len(report["children"]) == FORK_ROUNDS

    # The parent's client and tensors are untouched: same session, nothing lost or reconnected.
    assert report["session_after"] == report["session"]
    assert report["held_alive"] and report["held_reads"] and report["get_reads"]
    assert report["leases_after"] == report["parent_leases"]
    assert report["sessions_after"] == 1
