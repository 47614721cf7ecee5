"""A user's first program, for tests/wheels: run with an installed wheel, it starts the wheel's own
tensorshmd through tensorshm.Daemon (no $TENSORSHMD, no PATH entry), puts a numpy array, gets it
back zero-copy through numpy's from_dlpack, and checks that the daemon left nothing in /dev/shm.
mypy --strict checks it against the package's one stub with each interpreter."""

from __future__ import annotations

import os
import sys

import numpy as np
import numpy.typing as npt

import tensorshm


def roundtrip(values: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Puts `values` and returns a copy of what a get of it reads."""
    with tensorshm.Daemon(host_pool="64Mi") as daemon, daemon.connect() as client:
        client.put("wheel/x", values)
        with client.get("wheel/x", timeout=5) as tensor:
            assert tensor.shape == values.shape, tensor.shape
            view = np.from_dlpack(tensor)
            assert not view.flags.writeable, "a published tensor must be read-only"
            print(f"roundtrip: {tensor.dtype}{tensor.shape} through tensorshm.Daemon on "
                  f"{daemon.socket} (pid {daemon.pid})")
            return np.array(view, dtype=np.float32)  # a copy, past the lease


def main() -> int:
    before = set(os.listdir("/dev/shm"))
    values = np.arange(4096, dtype=np.float32) * np.float32(0.5)
    got = roundtrip(values)
    if not np.array_equal(got, values):
        print(f"roundtrip: {int(np.count_nonzero(got != values))} values differ", file=sys.stderr)
        return 1
    left = sorted(set(os.listdir("/dev/shm")) - before)
    if left:
        print(f"roundtrip: the daemon left {left} in /dev/shm", file=sys.stderr)
        return 1
    print("roundtrip: every value right, nothing left in /dev/shm")
    return 0


if __name__ == "__main__":
    sys.exit(main())
