"""A PyTorch DataLoader whose workers hand batches over through tensorshm.

Each DataLoader worker (num_workers=2, the default fork start method) connects its own client
in ``worker_init_fn`` (a client does not survive fork; each process connects its own), builds
its batch, puts it into tensorshm as ``PREFIX/<index>`` and yields only the name. No tensor
bytes go through the DataLoader's pipes. The main loop gets each batch by name, zero-copy
through ``torch.from_dlpack``, checks it against the batch formula, uses it, and deletes it.

Run a daemon first, in another terminal::

    make run                                  # serves on the default socket

then::

    .venv/bin/python examples/dataloader.py [--socket PATH] [--batches 32] [--batch-size 128]

Output ends with ``validated <n> batches ... checksum=<n> expected=<n> OK``, or exits 1 naming
the batch that differed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.utils.data

import tensorshm

FEATURES = 32

# The client of this process once worker_init_fn ran (each worker process has its own).
_worker_client: tensorshm.Client | None = None


def make_batch(index: int, batch_size: int) -> np.ndarray:
    """Batch ``index``: small integers as float32, so that sums are exact."""
    values = (np.arange(batch_size * FEATURES, dtype=np.int64) * 7 + index) % 101
    return values.astype(np.float32).reshape(batch_size, FEATURES)


class SharedBatches(torch.utils.data.Dataset[str]):
    """Item ``i`` is built in the worker, put into tensorshm, and returned as its name."""

    def __init__(self, socket: str | None, prefix: str, batches: int, batch_size: int) -> None:
        self.socket, self.prefix = socket, prefix
        self.batches, self.batch_size = batches, batch_size

    def __len__(self) -> int:
        return self.batches

    def __getitem__(self, index: int) -> str:
        if _worker_client is None:
            raise RuntimeError("SharedBatches runs in DataLoader workers (num_workers > 0), "
                               "whose worker_init_fn connects them")
        name = f"{self.prefix}/{index}"
        # put(name, batch, replace=True), keeping no lease here: the main process's get takes one.
        _worker_client[name] = make_batch(index, self.batch_size)
        return name


def connect_worker(worker_id: int) -> None:
    """worker_init_fn: connect this worker's own client (after the fork, never before)."""
    global _worker_client
    info = torch.utils.data.get_worker_info()
    assert info is not None
    dataset = info.dataset
    assert isinstance(dataset, SharedBatches)
    _worker_client = tensorshm.connect(dataset.socket, client_name=f"dataloader-worker-{worker_id}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--socket", default=None,
                        help="the daemon's socket (default: TENSORSHM_SOCKET or the daemon's)")
    parser.add_argument("--batches", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--prefix", default="loader", help="batch names are PREFIX/<index>")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)

    dataset = SharedBatches(args.socket, args.prefix, args.batches, args.batch_size)
    # batch_size=None: each item already is a batch (a name); nothing is collated or copied.
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=args.workers,
                                         worker_init_fn=connect_worker)
    checksum = 0
    norms = 0.0
    start = time.perf_counter()
    with tensorshm.connect(args.socket, client_name="dataloader-main") as client:
        for index, name in enumerate(loader):
            with client[name] as tensor:  # published before the worker yielded its name
                x = torch.from_dlpack(tensor)  # zero-copy: the worker's published pages
                expected = torch.from_numpy(make_batch(index, args.batch_size))
                if name != f"{args.prefix}/{index}" or not torch.equal(x, expected):
                    print(f"batch {index} ({name}) differs from make_batch({index})",
                          file=sys.stderr)
                    return 1
                norms += float(torch.linalg.vector_norm(x, dim=1).mean())  # "use" the batch
                checksum += int(x.sum(dtype=torch.float64).item())
                del x
            del client[name]
    elapsed = time.perf_counter() - start
    want = sum(int(make_batch(i, args.batch_size).sum(dtype=np.int64))
               for i in range(args.batches))
    verdict = "OK" if checksum == want else "MISMATCH"
    print(f"validated {args.batches} batches from {args.workers} workers in {elapsed:.3f}s "
          f"(pid {os.getpid()}, mean row norm {norms / max(args.batches, 1):.3f}); "
          f"checksum={checksum} expected={want} {verdict}")
    return 0 if checksum == want else 1


if __name__ == "__main__":
    sys.exit(main())
