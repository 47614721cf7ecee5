"""One side of a tensor exchange through a running tensorshmd, for tests/packages:
`exchange.py produce SOCKET NAME` publishes a 4 MiB float32 tensor and exits (the daemon keeps
it); `exchange.py consume SOCKET NAME` acquires it in another process and checks every value. Each prints one line saying what it did."""

import sys

import numpy as np

import tensorshm

COUNT = 1 << 20


def expected() -> np.ndarray:
    return (np.arange(COUNT, dtype=np.float32) * 0.25).reshape(1024, 1024)


def main() -> int:
    role, socket, name = sys.argv[1:4]
    with tensorshm.connect(socket) as client:
        if role == "produce":
            client.put(name, expected())
            print(f"produce: published {name} (1024x1024 float32) on {socket}")
            return 0
        t = client.get(name, timeout=30)
        got = np.from_dlpack(t)
        if got.shape != (1024, 1024) or got.dtype != np.float32:
            print(f"consume: {name} is {got.dtype}{got.shape}, not float32(1024, 1024)")
            return 1
        wrong = int(np.count_nonzero(got != expected()))
        print(f"consume: acquired {name} from another process, {wrong} wrong values of {COUNT}")
        return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
