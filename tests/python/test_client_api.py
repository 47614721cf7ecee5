"""The client as a Python user expects it (issue 13): context managers, early release, dict-like
access, get_many, asyncio, a clean interpreter exit, and a repr that says where it is connected.
A real daemon; other processes where a case needs them."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tensorshm
from conftest import own_leases, run_python, wait_for, waiting

# Generous bound for "promptly": the waits cancelled below would otherwise last far longer.
PROMPT = 10.0


def leases(client) -> int:
    """Every session's leases: for tests that watch another client's session end."""
    client.flush()
    return client.stat()["leases"]


@pytest.fixture
def observer(daemon):
    """A second client that watches the daemon's counts."""
    with tensorshm.connect(daemon.socket, client_name="observer") as c:
        yield c


# ---- Client: with, close, closed, repr ----


def test_with_closes_the_client_and_its_session(daemon, observer):
    sessions = observer.stat()["sessions"]
    with tensorshm.connect(daemon.socket) as c:
        assert not c.closed
        assert observer.stat()["sessions"] == sessions + 1
    assert c.closed
    assert wait_for(lambda: observer.stat()["sessions"] == sessions)
    c.close()  # idempotent
    assert c.closed


def test_every_method_after_close_raises_closed_error_naming_the_session(daemon):
    c = tensorshm.connect(daemon.socket)
    session = c.session_id
    c.close()
    calls = [
        lambda: c.get("x"), lambda: c.get("x", timeout=1), lambda: c["x"],
        lambda: c.put("x", np.zeros(2)), lambda: c.create((2,)), lambda: c.delete("x"),
        lambda: c.list(), lambda: c.keys(), lambda: c.stat(), lambda: c.flush(),
        lambda: "x" in c, lambda: c.get_many(["x"]), lambda: c.__setitem__("x", np.zeros(1)),
    ]
    for call in calls:
        with pytest.raises(tensorshm.ClosedError) as info:
            call()
        assert session in str(info.value) and daemon.socket in str(info.value)
        assert isinstance(info.value, tensorshm.FailedPreconditionError)
        assert isinstance(info.value, ValueError)
    assert c.session_id == session  # still says which session it was


def test_tensors_stay_valid_after_close_and_the_session_ends_with_them(daemon, observer):
    observer.put("close/t", np.arange(100.0), replace=True)
    baseline = leases(observer)
    sessions = observer.stat()["sessions"]
    c = tensorshm.connect(daemon.socket)
    t = c.get("close/t")
    w = c.create((8,), "int32")
    wview = np.from_dlpack(w)
    wview[:] = 7
    c.close()
    assert float(np.from_dlpack(t).sum()) == float(np.arange(100.0).sum())
    assert int(wview.sum()) == 56
    with pytest.raises(tensorshm.ClosedError):
        w.publish("close/w")  # its client is closed
    assert leases(observer) == baseline + 1
    assert observer.stat()["sessions"] == sessions + 1  # kept open for its tensors
    del t, w, wview
    gc.collect()
    assert wait_for(lambda: observer.stat()["sessions"] == sessions)
    assert leases(observer) == baseline


# The futex syscall's number, for reading /proc/self/task/*/syscall.
SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine)
FUTEX_WAIT = 0


def waiting_gets(client) -> int:
    """Gets of this process that wait now: threads asleep in the fast path's futex (FUTEX_WAIT
    on a shared word; the client's mutexes wait on private words), plus the acquires the daemon
    lists as waiting (a get the fast path cannot answer waits there)."""
    sleeping = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/syscall") as f:
                fields = f.read().split()
        except OSError:
            continue  # the thread ended
        if len(fields) >= 3 and fields[0] == str(SYS_FUTEX) and int(fields[2], 16) == FUTEX_WAIT:
            sleeping += 1
    return sleeping + sum(s["waiting_acquires"] for s in client.sessions())


def test_close_wakes_a_get_waiting_in_another_thread(client):
    caught: list[BaseException] = []
    started = threading.Event()

    def wait() -> None:
        started.set()
        try:
            client.get("close/never", timeout=None)
        except BaseException as e:  # noqa: BLE001
            caught.append(e)

    thread = threading.Thread(target=wait)
    thread.start()
    started.wait()
    # close must wake a sleeping get: it is seen waiting first.
    assert wait_for(lambda: waiting_gets(client) == 1, timeout=30), waiting_gets(client)
    client.close()
    thread.join(PROMPT)
    assert not thread.is_alive()
    assert isinstance(caught[0], tensorshm.ClosedError), caught
    assert client.session_id in str(caught[0])


def test_repr_says_socket_session_instance_and_closed(daemon):
    c = tensorshm.connect(daemon.socket)
    text = repr(c)
    assert daemon.socket in text and c.session_id in text
    assert c.daemon_instance != 0 and str(c.daemon_instance) in text
    assert "closed" not in text
    assert c.socket == daemon.socket
    c.close()
    assert repr(c).endswith(", closed)") and c.session_id in repr(c)


# ---- Tensors: release, with, ReleasedError, views outliving the release ----


def test_release_and_with_give_the_lease_back(client):
    client.put("rel/t", np.arange(10, dtype=np.int64), replace=True)
    baseline = own_leases(client)
    t = client.get("rel/t")
    assert own_leases(client) == baseline + 1
    t.release()
    t.release()  # idempotent
    assert t.released
    assert own_leases(client) == baseline
    with client.get("rel/t") as t2:
        assert own_leases(client) == baseline + 1
        assert not t2.released
    assert t2.released
    assert own_leases(client) == baseline
    with client.put("rel/u", np.zeros(3), replace=True) as u:
        assert u.shape == (3,)
    assert own_leases(client) == baseline
    with client.create((4,), "float32") as w:
        np.from_dlpack(w)[:] = 1
        w.publish("rel/w", replace=True)
    assert w.released
    assert own_leases(client) == baseline


def test_a_released_tensor_raises_released_error_everywhere(client):
    client.put("rel/x", np.arange(4.0), replace=True)
    t = client.get("rel/x")
    t.release()
    uses = [
        lambda: t.shape, lambda: t.strides, lambda: t.dtype, lambda: t.device, lambda: t.nbytes,
        lambda: t.read_only, lambda: t.subbyte_padded, lambda: t.alive, lambda: t.check(),
        lambda: t._data_ptr, lambda: t._raw_storage(), lambda: t.__dlpack__(max_version=(1, 3)),
        lambda: t.__dlpack_device__(), lambda: memoryview(t), lambda: np.asarray(t),
        lambda: np.from_dlpack(t), lambda: tensorshm.to_numpy(t),
    ]
    for use in uses:
        with pytest.raises(tensorshm.ReleasedError) as info:
            use()
        assert "tensor 'rel/x' was released (release() or the end of its with block)" in str(
            info.value)
        assert isinstance(info.value, tensorshm.FailedPreconditionError)
        assert isinstance(info.value, ValueError)
    assert t.name == "rel/x"
    assert repr(t) == "tensorshm.Tensor(name='rel/x', released)"
    w = client.create((2,), "float32")
    w.release()
    with pytest.raises(tensorshm.ReleasedError):
        w.publish("rel/never")
    with pytest.raises(tensorshm.ReleasedError):
        _ = w.published
    assert repr(w) == "tensorshm.WritableTensor(released)"


def test_views_outlive_release_and_hold_the_lease(client):
    data = np.arange(1000, dtype=np.float32)
    client.put("rel/v", data, replace=True)
    baseline = own_leases(client)
    t = client.get("rel/v")
    views = {
        "asarray": np.asarray(t),
        "memoryview": memoryview(t),
        "to_numpy": tensorshm.to_numpy(t),
        "from_dlpack": np.from_dlpack(t),
    }
    t.release()
    gc.collect()
    assert own_leases(client) == baseline + 1  # the views hold it
    # Scribble over the pool in between: a view over unmapped or reused memory would show it.
    for i in range(4):
        client.put(f"rel/other{i}", np.full(1000, -1.0, dtype=np.float32), replace=True)
    for how, view in views.items():
        assert np.array_equal(np.asarray(view), data), how
    del view
    for how in list(views):
        del views[how]
        gc.collect()
        assert own_leases(client) == (baseline + 1 if views else baseline), how


def test_an_unpublished_writable_tensor_released_frees_its_buffer(client):
    used = client.stat()["pools"][0]["used_bytes"]
    w = client.create((1 << 20,), "uint8")
    view = np.from_dlpack(w)
    view[:] = 3
    w.release()
    assert int(view[-1]) == 3  # the view still holds the buffer
    del view
    gc.collect()
    client.flush()
    assert wait_for(lambda: client.stat()["pools"][0]["used_bytes"] == used)


# ---- dict-like access ----


def test_dict_like_access(client):
    for name in client.keys("dict/"):
        del client[name]
    client["dict/b"] = np.arange(3)
    client["dict/a"] = np.arange(2)
    client["dict/a"] = np.arange(5)  # replaces, as a dict does
    assert client.keys("dict/") == ["dict/a", "dict/b"]
    assert [n for n in client if n.startswith("dict/")] == ["dict/a", "dict/b"]
    assert "dict/a" in client
    assert "dict/" not in client and "dict/a/x" not in client and "dict" not in client
    assert 5 not in client and "" not in client and "no such name!" not in client
    with client["dict/a"] as t:
        assert t.shape == (5,)
    with pytest.raises(KeyError):
        client["dict/missing"]
    with pytest.raises(tensorshm.NotFoundError):
        client["dict/missing"]
    del client["dict/b"]
    assert "dict/b" not in client
    with pytest.raises(KeyError):
        del client["dict/b"]
    assert not hasattr(client, "__len__")  # see Client's docstring: no len()
    assert bool(client)


def test_contains_and_setitem_take_no_lease(client):
    baseline = own_leases(client)
    client["dict/c"] = np.ones(4)
    assert "dict/c" in client
    assert own_leases(client) == baseline


# ---- get_many ----


def test_get_many_returns_tensors_in_order(client):
    for i in range(3):
        client.put(f"many/{i}", np.full(2, i), replace=True)
    got = client.get_many(["many/2", "many/0", "many/1", "many/0"])
    assert [int(np.from_dlpack(t)[0]) for t in got] == [2, 0, 1, 0]
    assert [t.name for t in got] == ["many/2", "many/0", "many/1", "many/0"]


def test_get_many_waits_for_all_of_them(client, daemon):
    if "many/late" in client:
        del client["many/late"]
    client.put("many/now", np.zeros(1), replace=True)
    publisher = subprocess.Popen([sys.executable, "-c", PUBLISH_LATER, daemon.socket,
                                  "many/late", "0.3"])
    try:
        got = client.get_many(["many/now", "many/late"], timeout=60)
        assert [t.name for t in got] == ["many/now", "many/late"]
    finally:
        assert publisher.wait(60) == 0


def test_get_many_timeout_bounds_the_whole_call_and_leaves_no_lease(client):
    client.put("many/a", np.zeros(1), replace=True)
    baseline = own_leases(client)
    start = time.monotonic()
    with pytest.raises(tensorshm.TimeoutError) as info:
        client.get_many(["many/a", "many/x1", "many/x2", "many/x3"], timeout=0.3)
    # One deadline: the first missing name uses it up, the others do not wait 0.3 s each.
    assert time.monotonic() - start < 0.3 * 3
    assert "'many/x1'" in str(info.value) and "#1 of 4" in str(info.value)
    assert own_leases(client) == baseline
    with pytest.raises(tensorshm.NotFoundError) as info:
        client.get_many(["many/a", "many/a", "many/none"])
    assert "'many/none'" in str(info.value)
    assert own_leases(client) == baseline


# Publishes argv[2] and argv[3] after argv[4] and argv[5] seconds, counted from a "go" line.
PUBLISH_ON_SCHEDULE = """
import sys, time, numpy as np, tensorshm
client = tensorshm.connect(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
start = time.monotonic()
for name, at in ((sys.argv[2], float(sys.argv[4])), (sys.argv[3], float(sys.argv[5]))):
    time.sleep(max(0.0, start + at - time.monotonic()))
    client.put(name, np.zeros(1), replace=True).release()
"""


def test_get_many_timeout_is_one_deadline_not_one_per_name(client, daemon):
    # The first late name comes at 0.5 timeout, the second at 1.25: within one timeout of the
    # first (a per-name timeout would get it), after the call's one deadline.
    timeout = 2.0
    for name in ("many/t1", "many/t2"):
        if name in client:
            client.delete(name)
    client.put("many/a", np.zeros(1), replace=True)
    baseline = own_leases(client)
    publisher = subprocess.Popen(
        [sys.executable, "-c", PUBLISH_ON_SCHEDULE, daemon.socket, "many/t1", "many/t2",
         str(0.5 * timeout), str(1.25 * timeout)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    try:
        assert publisher.stdout.readline().strip() == "ready"
        publisher.stdin.write("go\n")
        publisher.stdin.flush()
        with pytest.raises(tensorshm.TimeoutError) as info:
            client.get_many(["many/a", "many/t1", "many/t2"], timeout=timeout)
        assert "'many/t2'" in str(info.value) and "#2 of 3" in str(info.value), info.value
        assert own_leases(client) == baseline
    finally:
        publisher.stdin.close()
        assert publisher.wait(60) == 0


# ---- asyncio ----

PUBLISH_LATER = """
import sys, time, numpy as np, tensorshm
client = tensorshm.connect(sys.argv[1])
time.sleep(float(sys.argv[3]))
client.put(sys.argv[2], np.arange(6, dtype=np.int32), replace=True).release()
"""


def test_aget_keeps_the_loop_ticking_while_another_process_publishes(client, daemon):
    if "async/late" in client:
        client.delete("async/late")

    async def main() -> tuple[object, int]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        tick_task = asyncio.create_task(ticker())
        publisher = await asyncio.create_subprocess_exec(
            sys.executable, "-c", PUBLISH_LATER, daemon.socket, "async/late", "0.5")
        t = await client.aget("async/late", timeout=60)
        stop.set()
        await tick_task
        assert await publisher.wait() == 0
        return t, ticks

    t, ticks = asyncio.run(main())
    assert np.array_equal(np.from_dlpack(t), np.arange(6, dtype=np.int32))
    assert ticks > 10  # the loop ran while aget waited ~0.5 s (a blocked loop ticks once)


def test_cancelling_a_waiting_aget_is_prompt_and_leaves_no_lease(client, observer):
    baseline = leases(observer)

    async def main() -> float:
        task = asyncio.create_task(client.aget("async/never", timeout=None))
        await asyncio.sleep(0.2)
        start = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - start

    assert asyncio.run(main()) < PROMPT
    # The worker thread ended (its wait was woken, not left to run).
    assert wait_for(lambda: not any(t.name == "tensorshm-async" for t in threading.enumerate()))
    assert leases(observer) == baseline


def test_aget_with_a_timeout_and_aget_many_and_aput(client):
    async def main() -> None:
        put = await client.aput("async/p", np.arange(1 << 20, dtype=np.float32), replace=True)
        assert put.shape == (1 << 20,)
        put.release()
        t = await client.aget("async/p")
        assert float(np.from_dlpack(t)[-1]) == float((1 << 20) - 1)
        many = await client.aget_many(["async/p", "async/p"], timeout=5)
        assert len(many) == 2
        with pytest.raises(tensorshm.TimeoutError):
            await client.aget("async/absent", timeout=0.1)
        with pytest.raises(tensorshm.NotFoundError):
            await client.aget("async/absent")

    asyncio.run(main())


def test_cancelling_aget_many_releases_what_it_got(client):
    client.put("async/a", np.zeros(1), replace=True)
    baseline = own_leases(client)

    async def main() -> None:
        task = asyncio.create_task(client.aget_many(["async/a", "async/never"], timeout=None))
        while not waiting(client, os.getpid()):
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert own_leases(client) == baseline


# ---- interpreter exit ----

EXIT_CASES = {
    "globals": """
t = client.get("exit/t")
view = np.asarray(t)
capsule = client.get("exit/t").__dlpack__(max_version=(1, 3))
other = tensorshm.connect(sys.argv[1])
""",
    "writable": """
w = client.create((100,), "int32")
wv = np.from_dlpack(w)
wv[:] = 1
""",
    "cycle": """
class Holder: pass
h = Holder(); h.t = client.get("exit/t"); h.me = h; h.client = client
""",
    "daemon_thread": """
def wait():
    started.set()
    try:
        client.get("exit/never", timeout=None)
    except tensorshm.CancelledError as e:
        print("cancelled:", e, flush=True)
threading.Thread(target=wait, daemon=True).start()
started.wait(); wait_until_waiting()
""",
    "thread": """
def wait():
    started.set()
    try:
        client.get("exit/never", timeout=None)
    except tensorshm.CancelledError as e:
        print("cancelled:", e, flush=True)
threading.Thread(target=wait).start()
started.wait(); wait_until_waiting()
""",
    "frozen_daemon_thread": """
def hold():
    t = client.get("exit/t"); w = client.create((10,), "float32")
    c2 = tensorshm.connect(sys.argv[1])
    started.set()
    time.sleep(1000)
threading.Thread(target=hold, daemon=True).start()
started.wait()
""",
    "pending_aget": """
async def main():
    asyncio.get_running_loop().create_task(client.aget("exit/never", timeout=None))
    while not is_waiting():
        await asyncio.sleep(0.005)
asyncio.run(main())
""",
}

EXIT_PRELUDE = f"""
import asyncio, os, sys, threading, time, numpy as np, tensorshm
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from waits import sleeping_on_shared_futex
client = tensorshm.connect(sys.argv[1])
started = threading.Event()

def is_waiting():
    # A get is asleep: on the fast path's futex, or in the daemon.
    return sleeping_on_shared_futex(os.getpid()) or any(
        s["own"] and s["waiting_acquires"] for s in client.sessions())

def wait_until_waiting():
    deadline = time.monotonic() + 30
    while not is_waiting():
        assert time.monotonic() < deadline, "the get never began to wait"
        time.sleep(0.005)
"""


@pytest.mark.parametrize("case", sorted(EXIT_CASES))
def test_interpreter_exit_is_clean_whatever_is_held(client, daemon, case):
    client.put("exit/t", np.arange(10.0), replace=True)
    baseline = leases(client)
    used = client.stat()["pools"][0]["used_bytes"]
    sessions = client.stat()["sessions"]
    code = EXIT_PRELUDE + EXIT_CASES[case] + '\nprint("holding", flush=True)\n'
    start = time.monotonic()
    result = run_python(code, daemon.socket, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "holding" in result.stdout
    if "thread" in case and "frozen" not in case:
        assert "cancelled:" in result.stdout and "interpreter is exiting" in result.stdout
    assert time.monotonic() - start < 60
    # <=: a session, lease or buffer of an earlier test may end meanwhile.
    assert wait_for(lambda: client.stat()["sessions"] <= sessions)
    assert wait_for(lambda: leases(client) <= baseline)
    assert wait_for(lambda: client.stat()["pools"][0]["used_bytes"] <= used)


def test_sessions_lists_this_session_and_its_leases(daemon):
    with tensorshm.connect(daemon.socket, client_name="sessions-test") as c:
        t = c.put("sessions/t", np.arange(4), replace=True)
        own = [s for s in c.sessions() if s["own"]]
        assert len(own) == 1
        assert own[0]["client_name"] == "sessions-test" and own[0]["pid"] == os.getpid()
        assert own[0]["uid"] == os.getuid() and not own[0]["redacted"]
        assert own[0]["rpc_leases"] + own[0]["page_leases"] == 1  # put()'s tensor
        t.release()
        assert own_leases(c) == 0
