#!/usr/bin/env python3
"""A torch DataLoader with 2 workers producing uint8 image batches (64x3x224x224, 9.6 MB): the
default collate (torch shared memory) against workers that create each batch straight into
tensorshm; prints batches/s for both, the ratio, and page faults per batch on each side.

    python bench/dataloader_bench.py [--batches 40] [--warmup 4] [--batch-size 64] [--workers 2]

Both loaders build each batch from the same bank of 16 ready samples (3x224x224 uint8), so the
work is the same and small; what differs is where the batch goes:

  default collate: Dataset items are samples; the DataLoader's default_collate stacks 64 of them
                   into a new tensor in torch shared memory (in the worker), which is sent to the
                   main process as a file descriptor over the worker's queue.
  tensorshm:       Dataset items are whole batches (batch_size=None): the worker (its own client,
                   connected in worker_init_fn) creates a writable tensor, torch.stack()s the 64
                   samples into it, publishes it as a name and yields only the name; the main
                   process gets it by name (torch.from_dlpack, zero-copy) and deletes it after use.

The main process reads one byte per page of each batch, then drops it. batches/s counts --batches
batches after --warmup batches (the workers' start-up left out). Page faults are getrusage
ru_minflt deltas: in the main process around each batch's next(), read and release; in a worker
from the end of one batch to the end of its next (so the sending of the previous batch is
counted too), sent back with the batch; medians over the timed batches. The benchmark starts its
own tensorshmd on a private socket (TENSORSHMD, default build/tensorshmd) and removes it at the
end.
"""

from __future__ import annotations

import argparse
import os

# No method here calls BLAS, but numpy's OpenBLAS starts a thread per core that was seen taking
# ~9% of the CPU while every method ran; on a 2-core machine that skews every row. One thread,
# for every row alike (children inherit it).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import pathlib
import resource
import statistics
import sys
import time

import numpy as np
import torch
import torch.utils.data

import tensorshm

PAGE = 4096
ROOT = pathlib.Path(__file__).resolve().parents[1]
SAMPLE_SHAPE = (3, 224, 224)
BANK = 16

# Per worker process: the tensorshm client (tensorshm loader only) and the fault count at the
# end of its previous batch.
_worker_client: tensorshm.Client | None = None
_worker_faults = 0


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def faults_since_last_batch() -> int:
    """In a worker: the page faults since its previous batch ended."""
    global _worker_faults
    now = minor_faults()
    delta, _worker_faults = now - _worker_faults, now
    return delta


def sample_bank() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(20)
    return [torch.randint(0, 256, SAMPLE_SHAPE, dtype=torch.uint8, generator=generator)
            for _ in range(BANK)]


def touch(array: np.ndarray) -> int:
    """Reads one byte per page."""
    flat = array.reshape(-1).view(np.uint8)
    return int(flat[::PAGE].sum()) + int(flat[-1])


# ---- the default collate ----

class Samples(torch.utils.data.Dataset):
    def __init__(self, count: int) -> None:
        self.count, self.bank = count, sample_bank()

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.bank[index % BANK]


def collate_counted(samples):
    """default_collate (into torch shared memory, in a worker), with the worker's faults."""
    batch = torch.utils.data.default_collate(samples)
    return batch, faults_since_last_batch()


def start_counting(worker_id: int) -> None:
    global _worker_faults
    _worker_faults = minor_faults()


# ---- tensorshm ----

class TensorshmBatches(torch.utils.data.Dataset):
    """Item b is batch b, created in tensorshm by the worker and returned as its name."""

    def __init__(self, socket: str, prefix: str, batches: int, batch_size: int) -> None:
        self.socket, self.prefix = socket, prefix
        self.batches, self.batch_size = batches, batch_size
        self.bank = sample_bank()

    def __len__(self) -> int:
        return self.batches

    def __getitem__(self, index: int) -> tuple[str, int]:
        assert _worker_client is not None, "runs in DataLoader workers (worker_init_fn connects)"
        first = index * self.batch_size
        samples = [self.bank[(first + j) % BANK] for j in range(self.batch_size)]
        w = _worker_client.create((self.batch_size, *SAMPLE_SHAPE), "uint8", timeout=None)
        out = torch.from_dlpack(w)
        torch.stack(samples, out=out)
        del out  # no writable view kept past publish
        name = f"{self.prefix}/{index}"
        w.publish(name)
        w.release()  # the main process's get takes its own lease
        return name, faults_since_last_batch()


def connect_worker(worker_id: int) -> None:
    global _worker_client
    info = torch.utils.data.get_worker_info()
    assert info is not None
    _worker_client = tensorshm.connect(info.dataset.socket, client_name=f"bench-worker-{worker_id}")
    start_counting(worker_id)


# ---- the driver ----

def run_default(args) -> tuple[float, list[int], list[int]]:
    total = args.warmup + args.batches
    loader = torch.utils.data.DataLoader(
        Samples(total * args.batch_size), batch_size=args.batch_size, num_workers=args.workers,
        collate_fn=collate_counted, worker_init_fn=start_counting)

    def receive(item) -> int:
        batch, worker_faults = item
        touch(batch.numpy())
        return worker_faults

    return consume(loader, receive, args)


def run_tensorshm(args, socket: str) -> tuple[float, list[int], list[int]]:
    total = args.warmup + args.batches
    dataset = TensorshmBatches(socket, f"dataloader-bench-{os.getpid()}", total, args.batch_size)
    with tensorshm.connect(socket, client_name="bench-main") as client:
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=args.workers,
                                             worker_init_fn=connect_worker)

        def receive(item) -> int:
            name, worker_faults = item
            with client.get(name) as t:
                x = torch.from_dlpack(t)
                touch(x.numpy())
                del x
            client.delete(name)
            return worker_faults

        return consume(loader, receive, args)


def consume(loader, receive, args) -> tuple[float, list[int], list[int]]:
    """(batches/s, worker faults per batch, main faults per batch) over the timed batches."""
    worker_faults, main_faults = [], []
    iterator = iter(loader)
    for _ in range(args.warmup):
        receive(next(iterator))
    start = time.perf_counter()
    for _ in range(args.batches):
        f0 = minor_faults()
        worker_faults.append(receive(next(iterator)))
        main_faults.append(minor_faults() - f0)
    elapsed = time.perf_counter() - start
    del iterator
    return args.batches / elapsed, worker_faults, main_faults


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=40, help="timed batches per loader")
    parser.add_argument("--warmup", type=int, default=4, help="batches before timing")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    daemon = tensorshm.Daemon("1Gi", tensorshmd=os.environ.get("TENSORSHMD",
                                                               str(ROOT / "build" / "tensorshmd")),
                              log_level="warning")
    socket = daemon.socket
    try:
        batch_bytes = args.batch_size * int(np.prod(SAMPLE_SHAPE))
        print(__doc__.split("\n\n")[0])
        print(f"batch {args.batch_size}x{'x'.join(map(str, SAMPLE_SHAPE))} uint8 "
              f"({batch_bytes / 1e6:.1f} MB), {args.workers} workers, {args.batches} timed batches"
              f" after {args.warmup}; page faults per batch are medians")
        print(f"{'loader':>16} {'batches/s':>10} {'MB/s':>8} {'faults worker':>14} "
              f"{'faults main':>12}")
        rows = []
        for label, run in (("default collate", lambda: run_default(args)),
                           ("tensorshm", lambda: run_tensorshm(args, socket))):
            rate, worker_faults, main_faults = run()
            rows.append(rate)
            print(f"{label:>16} {rate:>10.1f} {rate * batch_bytes / 1e6:>8.0f} "
                  f"{statistics.median(worker_faults):>14.0f} "
                  f"{statistics.median(main_faults):>12.0f}", flush=True)
        print(f"tensorshm / default collate: {rows[1] / rows[0]:.2f}x batches/s")
    finally:
        daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
