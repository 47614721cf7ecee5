"""States a test waits for instead of sleeping: what a process is blocked in, read from /proc and
the kernel's socket queues. Standard library only, so that child interpreters can import it."""

from __future__ import annotations

import array
import fcntl
import os
import pathlib
import platform
import subprocess
import termios

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}[platform.machine()]
_FUTEX_WAIT = 0
_FUTEX_WAIT_BITSET = 9
_FUTEX_PRIVATE_FLAG = 128
_FUTEX_CMD_MASK = ~(128 | 256)


def sleeping_on_shared_futex(pid: int) -> bool:
    """Whether a thread of process `pid` sleeps in a shared (not process-private) FUTEX_WAIT, as
    the client's fast path does waiting for a publish (the daemon wakes it from its own mapping;
    the interpreter's, gRPC's and the C++ runtime's waits are all private)."""
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            # "NR ARG0 ARG1 ...", arguments in hex; "running" or "-1 ..." outside a call.
            fields = task.joinpath("syscall").read_text().split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
        if len(fields) < 3 or fields[0] != str(_SYS_FUTEX):
            continue
        op = int(fields[2], 16)
        waits = op & _FUTEX_CMD_MASK in (_FUTEX_WAIT, _FUTEX_WAIT_BITSET)
        if waits and not op & _FUTEX_PRIVATE_FLAG:
            return True
    return False


def unread_socket_bytes() -> int:
    """Bytes this process has written into its sockets that their peers have not read yet
    (SIOCOUTQ, summed over every socket it has open): grows when a request is sent to a stopped
    daemon."""
    total = 0
    for entry in pathlib.Path("/proc/self/fd").iterdir():
        try:
            fd = int(entry.name)
            if not os.readlink(entry).startswith("socket:"):
                continue
            queued = array.array("i", [0])
            fcntl.ioctl(fd, termios.TIOCOUTQ, queued)  # SIOCOUTQ has TIOCOUTQ's number
            total += queued[0]
        except OSError:
            continue  # closed meanwhile, or not a socket that keeps a send queue
    return total


def listen_backlog(path: str) -> int:
    """Connections waiting in the backlog of the Unix socket listening at `path` (a stopped
    daemon accepts none): `ss`'s Recv-Q of a listening socket."""
    out = subprocess.run(["ss", "-xlnH", "src", path], capture_output=True, text=True,
                         check=True).stdout.split()
    return int(out[2]) if len(out) > 2 else 0
