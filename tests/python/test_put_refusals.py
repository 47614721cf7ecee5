"""What put cannot share is refused at once, naming what to pass instead (issue 37): Python
sequences and numbers, numpy arrays of objects, bytes, str or records, big-endian arrays, and a
tensor larger than the whole pool (no wait for memory that can never be enough). The exceptions
show as the package's own, and the package's namespace holds only its own names."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import tensorshm


def test_a_python_sequence_or_number_is_told_to_use_an_array(client):
    for value, kind in (([1, 2, 3], "list"), ((1.0, 2.0), "tuple"), (3, "int"), (2.5, "float")):
        with pytest.raises(TypeError) as info:
            client.put("refused/seq", value)
        message = str(info.value)
        assert f"put('refused/seq', ...): a {kind} is not a tensor" in message, message
        assert "np.asarray(value)" in message


@pytest.mark.parametrize("array,shown,kind,instead", [
    (np.array([1, "a"], dtype=object), "'|O'", "Python objects", "np.frombuffer("),
    (np.array(["ab", "c"]), "'<U2'", "str", "np.frombuffer("),
    (np.array([b"x", b"yz"]), "'|S2'", "bytes", "np.frombuffer("),
    (np.zeros(2, dtype=[("a", "<i4"), ("b", "<f4")]), "'|V8'", "structured records",
     "each field as an array of its own"),
    (np.array(["2026-11-28"], dtype="datetime64[D]"), "'<M8[D]'", "datetimes",
     "array.view(np.int64)"),
    (np.array([5], dtype="timedelta64[s]"), "'<m8[s]'", "time spans", "array.view(np.int64)"),
    (np.arange(3).view(np.recarray), "'<i8'", None, None),  # a subclass of plain numbers: goes in
])
def test_arrays_of_no_number_type_are_refused_naming_the_dtype(client, array, shown, kind,
                                                                  instead):
    if kind is None:
        client.put("refused/kind", array, replace=True)
        assert np.from_dlpack(client.get("refused/kind")).tolist() == [0, 1, 2]
        client.delete("refused/kind")
        return
    with pytest.raises(tensorshm.InvalidArgumentError) as info:
        client.put("refused/kind", array)
    message = str(info.value)
    assert f"dtype = {shown} (numpy kind '{array.dtype.kind}', {kind})" in message, message
    assert "a tensor holds numbers" in message and instead in message
    with pytest.raises(tensorshm.NotFoundError):
        client.get("refused/kind")


def test_a_masked_array_is_refused_rather_than_shared_without_its_mask(client):
    masked = np.ma.masked_array([1, 2, 3], mask=[False, True, False])
    with pytest.raises(tensorshm.InvalidArgumentError, match=r"a masked array.*array\.filled"):
        client.put("refused/masked", masked)


def test_a_big_endian_array_is_told_how_to_convert(client):
    with pytest.raises(tensorshm.InvalidArgumentError) as info:
        client.put("refused/be", np.arange(3, dtype=">i4"))
    message = str(info.value)
    assert "dtype = '>i4' is big-endian" in message, message
    assert "astype(array.dtype.newbyteorder('='))" in message
    # Converted as told, it goes in, with the values.
    array = np.arange(3, dtype=">i4")
    client.put("refused/be", array.astype(array.dtype.newbyteorder("=")))
    assert np.from_dlpack(client.get("refused/be")).tolist() == [0, 1, 2]


def test_larger_than_the_whole_pool_fails_at_once_even_with_a_timeout(daemon, client):
    pool = client.stat()["pools"][0]["capacity_bytes"]
    with pytest.raises(tensorshm.ResourceExhaustedError) as info:
        client.put("refused/huge", np.zeros(pool + 4096, dtype=np.uint8), timeout=30)
    # The daemon did not queue the create to wait for memory (a create that waited says
    # "waited ... for memory to be freed"): none that could come free would ever be enough.
    assert "larger than the whole pool" in str(info.value), info.value
    assert "waited" not in str(info.value), info.value
    assert client.stat()["creates_waiting"] == 0


def test_larger_than_the_whole_pool_does_not_queue_behind_waiting_creates(small_daemon):
    """With the pool full and another create waiting for memory, a create larger than the whole
    pool still fails at once (timeout=None: had it queued, it would wait forever)."""
    holder = tensorshm.connect(small_daemon.socket, client_name="holder")
    waiter = tensorshm.connect(small_daemon.socket, client_name="waiter")
    asker = tensorshm.connect(small_daemon.socket, client_name="asker")
    holder.put("refused/full", np.zeros(4 << 20, dtype=np.uint8)).release()
    outcome: list[object] = []

    def wait_for_memory() -> None:
        try:
            waiter.put("refused/later", np.zeros(1 << 20, dtype=np.uint8), timeout=None).release()
            outcome.append("put")
        except tensorshm.Error as e:
            outcome.append(e)

    thread = threading.Thread(target=wait_for_memory)
    thread.start()
    deadline = time.monotonic() + 30
    while asker.stat()["creates_waiting"] < 1:
        assert time.monotonic() < deadline, "the waiting create never showed in Stat"
        time.sleep(0.01)
    with pytest.raises(tensorshm.ResourceExhaustedError, match="larger than the whole pool"):
        asker.put("refused/huge", np.zeros(8 << 20, dtype=np.uint8), timeout=None)
    assert asker.stat()["creates_waiting"] == 1  # the other still waits, untouched
    holder.delete("refused/full")
    thread.join(timeout=30)
    assert outcome == ["put"], outcome
    for c in (holder, waiter, asker):
        c.close()


def test_errors_show_as_the_package_s_and_the_namespace_is_its_own():
    for name in ("Error", "InvalidArgumentError", "NotFoundError", "ResourceExhaustedError",
                 "TimeoutError", "ConnectionError", "PermissionError", "UnauthenticatedError"):
        error = getattr(tensorshm, name)
        assert error.__module__ == "tensorshm", (name, error.__module__)
        assert f"tensorshm.{name}" in repr(error), repr(error)
    assert "annotations" not in dir(tensorshm)
