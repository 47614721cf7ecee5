"""How many messages a put sends to the daemon, counted with strace: every sendmsg, sendto,
write and writev the calling thread makes to a socket, between two markers it writes to its
stderr. (The client's own threads are left out: its sender thread may probe an idle session, and
gRPC's answer its transport's pings, whatever the calls.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

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


def test_a_put_of_a_size_not_in_stock_sends_two_messages(tmp_path):
    """create and publish, over the memory channel, for puts into segments this session has not
    mapped: their descriptor comes with the create's answer (ChannelResponse.attached_segment),
    and the put's lease reads its own segment through the descriptor the producer holds, so no
    segment request is sent. (The pool is grown first, by another client: a create that must
    wait for a pool to grow is still sent to the gRPC Create.)"""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (scripts/setup.sh installs it)")
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
        trace = tmp_path / "strace.txt"
        result = subprocess.run(
            ["strace", "-f", "-qq", "-e", "trace=sendmsg,sendto,write,writev", "-o", str(trace),
             sys.executable, "-c", CHILD, daemon.socket, str(puts)],
            capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        sends = _socket_sends(trace.read_text())
        assert len(sends) == 2 * puts, (
            f"{len(sends)} sends for {puts} puts (2 each expected): {sorted(set(sends))}")
        assert set(sends) == {sends[0]}, f"all on the memory channel: {sorted(set(sends))}"
    finally:
        assert daemon.stop() == 0
