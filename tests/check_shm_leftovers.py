#!/usr/bin/env python3
"""Lists what a test suite left in /dev/shm, and fails on anything there.

    python3 tests/check_shm_leftovers.py --label test-cpp --since MARKER

MARKER: a file touched when the suite began. Counted: every /dev/shm entry made since then
(its ctime) whose name is a test daemon's (PREFIXES below) or the emulated CUDA driver's
(tsmfakecu.*) of a process that has ended. A daemon still running, of the tests or
not, is not counted (it holds its prefix's lock file); a daemon of your own started during the
run, with the default prefix, would be. The entries are removed once listed, so that a rerun
starts clean.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pathlib
import sys

# The C++ tests' daemons (tsmtest-), tests/python's (tsmpy-), tensorshm.Daemon's (tsmd-), the doc
# examples' (tsmdoc-), the default prefix and the deploy tests' (tsm-), the emulated driver's.
PREFIXES = ("tsmtest-", "tsmpy-", "tsmd-", "tsmdoc-", "tsm-", "tsmfakecu.")


def alive(pid: int) -> bool:
    return pid > 0 and os.path.exists(f"/proc/{pid}")


def owner_alive(entry: pathlib.Path) -> bool:
    """Whether the process that owns `entry` still runs: the pid in a fake CUDA page's name, or
    the pid a daemon's lock file (<prefix>.lock) records."""
    if entry.name.startswith("tsmfakecu."):
        pid = entry.name.split(".")[1]
        return pid.isdigit() and alive(int(pid))
    # A daemon holds flock on its prefix's lock file while it runs (common/base/prefix_lock.h).
    lock = entry.parent / (entry.name.split(".")[0] + ".lock")
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--since", required=True, help="a file touched when the suite began")
    args = parser.parse_args()
    since = os.stat(args.since).st_mtime
    left = []
    for entry in sorted(pathlib.Path("/dev/shm").iterdir()):
        if not entry.name.startswith(PREFIXES):
            continue
        try:
            if entry.stat().st_ctime < since or owner_alive(entry):
                continue
            size = entry.stat().st_size
        except FileNotFoundError:
            continue
        left.append((entry, size))
    if not left:
        print(f"check_shm_leftovers: {args.label}: nothing left in /dev/shm")
        return 0
    print(f"check_shm_leftovers: {args.label}: left in /dev/shm ({len(left)} entries, "
          f"{sum(s for _, s in left)} bytes; removed now):", file=sys.stderr)
    for entry, size in left:
        print(f"  {entry.name} ({size} bytes)", file=sys.stderr)
        entry.unlink(missing_ok=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
