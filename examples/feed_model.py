"""Feed a torch model from another process through tensorshm, zero-copy.

A producer process publishes batches as ``batch/0`` .. ``batch/N-1``; this process (the consumer)
gets each one by name as soon as it appears, runs a small ``torch.nn`` model on
``torch.from_dlpack(tensor)`` (the daemon's shared pages themselves, no copy), and deletes the
batch it consumed. At the end it prints the rate and a checksum of every value it saw.

Run a daemon first, in another terminal::

    make run                                  # serves on the default socket

then::

    .venv/bin/python examples/feed_model.py [--socket PATH] [--batches 64] [--batch-size 256]

Output ends with ``checksum=<n> expected=<n> OK`` (the sum of every input value, which the
consumer also computes from the batch formula) or exits 1 saying what differed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import numpy as np

import tensorshm

FEATURES = 64
CLASSES = 10


def make_batch(index: int, batch_size: int) -> np.ndarray:
    """Batch ``index``: small integers as float32 (so sums are exact and processes agree)."""
    values = (np.arange(batch_size * FEATURES, dtype=np.int64) + index) % 97
    return values.astype(np.float32).reshape(batch_size, FEATURES)


def expected_checksum(batches: int, batch_size: int) -> int:
    """The sum of every value of every batch, from the formula alone."""
    return sum(int(make_batch(i, batch_size).sum(dtype=np.int64)) for i in range(batches))


def produce(client: tensorshm.Client, prefix: str, batches: int, batch_size: int) -> None:
    """Publish every batch (replace: a batch left by an interrupted run is overwritten; item
    assignment is put(..., replace=True) keeping no lease in this process)."""
    for i in range(batches):
        client[f"{prefix}/{i}"] = make_batch(i, batch_size)


def consume(client: tensorshm.Client, prefix: str, batches: int, timeout: float) -> int:
    """Run the model on every batch as it arrives; returns the checksum of the inputs."""
    import torch  # here, so that the producer process does not pay for importing torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, CLASSES)).eval()
    checksum = 0
    predicted = torch.zeros(CLASSES, dtype=torch.int64)
    start = 0.0
    with torch.inference_mode():
        for i in range(batches):
            name = f"{prefix}/{i}"
            # Waits until the producer publishes it; the with block gives the lease back at its
            # end, and `x`, a view, holds its own until it goes.
            with client.get(name, timeout=timeout) as tensor:
                if i == 0:
                    start = time.perf_counter()  # the rate counts from the first batch on
                x = torch.from_dlpack(tensor)
                if x.data_ptr() != tensor._data_ptr:
                    raise SystemExit(f"{name}: torch.from_dlpack copied the batch; expected "
                                     "zero-copy")
            logits = model(x)
            predicted += torch.bincount(logits.argmax(dim=1), minlength=CLASSES)
            checksum += int(x.sum(dtype=torch.float64).item())
            del client[name]  # the name goes now; the memory once `x` goes
            del x
    elapsed = time.perf_counter() - start
    rate = (batches - 1) / elapsed if batches > 1 and elapsed > 0 else 0.0
    print(f"consumer: {batches} batches, {rate:.1f} batches/s after the first; "
          f"predicted classes {predicted.tolist()}")
    return checksum


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--socket", default=None,
                        help="the daemon's socket (default: TENSORSHM_SOCKET or the daemon's)")
    parser.add_argument("--batches", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--prefix", default="batch", help="batch names are PREFIX/0 .. PREFIX/N-1")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds the consumer waits for each batch")
    parser.add_argument("--role", choices=["both", "producer", "consumer"], default="both",
                        help="both: start a producer process and consume in this one")
    args = parser.parse_args(argv)
    with tensorshm.connect(args.socket) as client:  # closes the session at the end
        if args.role == "producer":
            produce(client, args.prefix, args.batches, args.batch_size)
            return 0
        producer = None
        if args.role == "both":
            command = [sys.executable, __file__, "--role", "producer", "--batches",
                       str(args.batches), "--batch-size", str(args.batch_size), "--prefix",
                       args.prefix]
            if args.socket is not None:
                command += ["--socket", args.socket]
            producer = subprocess.Popen(command)
        try:
            checksum = consume(client, args.prefix, args.batches, args.timeout)
        finally:
            if producer is not None:
                producer.wait(timeout=60)
    if producer is not None and producer.returncode != 0:
        print(f"producer exited with {producer.returncode}", file=sys.stderr)
        return 1
    expected = expected_checksum(args.batches, args.batch_size)
    verdict = "OK" if checksum == expected else "MISMATCH"
    print(f"checksum={checksum} expected={expected} {verdict}")
    return 0 if checksum == expected else 1


if __name__ == "__main__":
    sys.exit(main())
