"""How many messages a put sends to the daemon, counted with strace: every sendmsg, sendto,
write and writev the calling thread makes to a socket, between two markers it writes to its
stderr. (The client's own threads are left out: its sender thread may probe an idle session, and
gRPC's answer its transport's pings, whatever the calls.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

import tensorshm
from conftest import Daemon, wait_for

CHILD = r"""
import os, sys, numpy as np, tensorshm
client = tensorshm.connect(sys.argv[1])
client.put("warm", np.ones(16, np.uint8), replace=True).release()
client.flush()
held = []
os.write(2, b"MARK-START\n")
for i in range(int(sys.argv[2])):
    # Sizes never asked for before: no stocked buffer fits, and every 8 buffers fill a segment.
    held.append(client.put(f"m/{i}", np.ones((8 << 20) + i * 4096, np.uint8)))
os.write(2, b"MARK-END\n")
del held
client.flush()
"""

_SEND = re.compile(r"^(\d+)\s+(sendmsg|sendto|write|writev)\((\d+),")


def _socket_sends(trace: str) -> list[str]:
    """The calling thread's send calls between the markers, as "call(fd" strings, its markers on
    stderr left out."""
    lines = trace.splitlines()
    start = next(i for i, line in enumerate(lines) if "MARK-START" in line)
    end = next(i for i, line in enumerate(lines) if "MARK-END" in line)
    caller = lines[start].split()[0]  # the thread that wrote the marker
    sends = []
    for line in lines[start + 1:end]:
        match = _SEND.match(line)
        if match and match.group(1) == caller and match.group(3) != "2":
            sends.append(f"{match.group(2)}({match.group(3)}")
    return sends


def _channel_sends(trace: str) -> tuple[list[str], list[str]]:
    """Between the markers: the sends on the memory channel (the descriptor of the calling
    thread's first send) of every thread, and the sends elsewhere (but stderr) of the threads
    that sent on the channel."""
    lines = trace.splitlines()
    start = next(i for i, line in enumerate(lines) if "MARK-START" in line)
    end = next(i for i, line in enumerate(lines) if "MARK-END" in line)
    caller = lines[start].split()[0]
    sends = [(m.group(1), f"{m.group(2)}({m.group(3)}") for m in
             (_SEND.match(line) for line in lines[start + 1:end]) if m and m.group(3) != "2"]
    channel = next(call for tid, call in sends if tid == caller)
    on_channel = [call for tid, call in sends if call == channel]
    senders = {tid for tid, call in sends if call == channel}
    elsewhere = [call for tid, call in sends if tid in senders and call != channel]
    return on_channel, elsewhere


def _strace(daemon: Daemon, tmp_path, child: str, *args: str) -> str:
    trace = tmp_path / "strace.txt"
    result = subprocess.run(
        ["strace", "-f", "-qq", "-e", "trace=sendmsg,sendto,write,writev", "-o", str(trace),
         sys.executable, "-c", child, daemon.socket, *args],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return trace.read_text()


def _count_sends(daemon: Daemon, tmp_path, child: str, *args: str) -> list[str]:
    """The socket sends of `child`'s calling thread between its markers, run under strace."""
    return _socket_sends(_strace(daemon, tmp_path, child, *args))


def _needs_strace():
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (scripts/setup.sh installs it)")


def test_a_put_of_a_size_not_in_stock_sends_two_messages(tmp_path):
    """create and publish, over the memory channel, for puts into segments this session has not
    mapped: their descriptor comes with the create's answer (ChannelResponse.attached_segment),
    and the put's lease reads its own segment through the descriptor the producer holds, so no
    segment request is sent. (The pool is grown first, by another client: none of the child's
    creates waits for a growth; the next test grows it.)"""
    _needs_strace()
    daemon = Daemon("messages", host_pool="1Gi")
    try:
        puts = 24  # 192 MiB and more: four segments of 64 MiB, none mapped by the child
        with tensorshm.connect(daemon.socket) as grower:
            # Twice the room the child needs, so that none of its creates waits for a growth.
            for i in range(2 * puts):
                grower.put(f"grow/{i}", np.zeros(9 << 20, np.uint8)).release()
            for i in range(2 * puts):
                grower.delete(f"grow/{i}")
        with tensorshm.connect(daemon.socket) as watcher:
            # The grower's session is gone, and with it its stocked buffers: the pool is empty.
            assert wait_for(lambda: watcher.stat()["pools"][0]["used_bytes"] == 0
                            and watcher.stat()["sessions"] == 1)
            segments = watcher.stat()["pools"][0]["segments"]
        assert segments >= 7, f"the pool grew to {segments} segments"
        sends = _count_sends(daemon, tmp_path, CHILD, str(puts))
        assert len(sends) == 2 * puts, (
            f"{len(sends)} sends for {puts} puts (2 each expected): {sorted(set(sends))}")
        assert set(sends) == {sends[0]}, f"all on the memory channel: {sorted(set(sends))}"
    finally:
        assert daemon.stop() == 0


def test_a_put_that_grows_the_pool_sends_two_messages(tmp_path):
    """The same puts into a pool that must grow for them: a create the daemon answers once its
    pool has grown is answered on the memory channel too, not sent to the gRPC Create."""
    _needs_strace()
    daemon = Daemon("messages-grow", host_pool="1Gi")
    try:
        puts = 24
        sends = _count_sends(daemon, tmp_path, CHILD, str(puts))
        with tensorshm.connect(daemon.socket) as watcher:
            segments = watcher.stat()["pools"][0]["segments"]
        assert segments >= 4, f"the pool grew to {segments} segments"
        assert len(sends) == 2 * puts, (
            f"{len(sends)} sends for {puts} puts (2 each expected): {sorted(set(sends))}")
        assert set(sends) == {sends[0]}, f"all on the memory channel: {sorted(set(sends))}"
    finally:
        assert daemon.stop() == 0


WAITING_CHILD = r"""
import os, sys, numpy as np, tensorshm
client = tensorshm.connect(sys.argv[1])
client.put("warm", np.ones(16, np.uint8), replace=True).release()
client.flush()
os.write(2, b"MARK-START\n")
# The pool is full: the create waits in the daemon until the test frees the memory.
put = client.put("waited", np.ones(2 << 20, np.uint8), timeout=60)
os.write(2, b"MARK-END\n")
put.release()
client.flush()
"""


def test_a_put_that_waits_for_memory_sends_two_messages(tmp_path):
    """A put with a timeout into a full pool: its create waits on the memory channel (answered
    once memory is freed, not redirected to the gRPC Create), then its publish. From Python the
    put first tries without waiting (with the GIL released, before it hands the wait to a
    cancellable worker thread): three messages, every one on the memory channel."""
    _needs_strace()
    daemon = Daemon("messages-wait", host_pool="4Mi", extra_args=("--segment-size", "4Mi"))
    try:
        with tensorshm.connect(daemon.socket) as owner:
            owner.put("fill", np.zeros(3 << 20, np.uint8)).release()
            freed = threading.Event()

            def free_when_waiting():
                assert wait_for(lambda: owner.stat()["creates_waiting"] == 1)
                owner.delete("fill")
                freed.set()

            helper = threading.Thread(target=free_when_waiting)
            helper.start()
            try:
                trace = _strace(daemon, tmp_path, WAITING_CHILD)
            finally:
                helper.join()
            assert freed.is_set()
        on_channel, elsewhere = _channel_sends(trace)
        assert len(on_channel) == 3, (
            f"{len(on_channel)} sends on the channel for one waiting put (3 expected)")
        assert elsewhere == [], f"the put's threads sent elsewhere too: {elsewhere}"
    finally:
        assert daemon.stop() == 0
