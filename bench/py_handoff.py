#!/usr/bin/env python3
"""Producer process -> consumer process handoff of a numpy array, through tensorshm and the usual
alternatives; prints medians and ratios.

    python bench/py_handoff.py [--sizes 4Ki,64Ki,1Mi,16Mi,256Mi] [--max-iterations 100]

Each handoff starts when the producer holds a ready numpy array and ends when the consumer has
a numpy array of it and has read one byte per page. Both ends stamp time.monotonic_ns
(CLOCK_MONOTONIC, shared by the processes).

  tensorshm:       client.put(name, array) -> consumer waiting in client.get(name, timeout=None),
                   np.from_dlpack (zero-copy)
  shared_memory:   SharedMemory(create) + copy in + (name, shape, dtype) pickled over a Pipe ->
                   consumer attaches, wraps with np.ndarray (zero-copy)
  Pipe pickle:     conn.send(array) -> conn.recv()
  torch.mp:        torch.from_numpy(array).share_memory_() over a torch.multiprocessing queue
                   (only when torch is installed)

Then, in one process: a warm client.get + np.from_dlpack + release of a published 4 KiB tensor,
and 60,000 puts of an 8-byte tensor in a row (replace), each a median.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

PAGE = 4096
ROOT = pathlib.Path(__file__).resolve().parents[1]


def parse_size(text: str) -> int:
    for suffix, factor in (("Ki", 1 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30)):
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)


def fmt_size(n: int) -> str:
    for suffix, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor and n % factor == 0:
            return f"{n // factor} {suffix}"
    return f"{n} B"


def fmt_ns(ns: float) -> str:
    if ns < 1e6:
        return f"{ns / 1e3:.1f} us"
    if ns < 1e9:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e9:.2f} s"


def touch(array) -> int:
    """Reads one byte per page of the array's memory."""
    import numpy as np

    flat = array.reshape(-1).view(np.uint8)
    return int(flat[::PAGE].sum()) + int(flat[-1])


# ---- producers and consumers (child processes) ----

def tsm_producer(socket, size, iterations, go, report):
    import numpy as np
    import tensorshm

    client = tensorshm.connect(socket)
    array = np.full(size, 7, dtype=np.uint8)
    for i in range(iterations):
        go.recv()
        start = time.monotonic_ns()
        client.put(f"bench/{i}", array)
        report.send(start)


def tsm_consumer(socket, size, iterations, ready, report):
    import numpy as np
    import tensorshm

    client = tensorshm.connect(socket)
    for i in range(iterations):
        ready.send(True)
        t = client.get(f"bench/{i}", timeout=None)
        touch(np.from_dlpack(t))
        end = time.monotonic_ns()
        del t
        client.delete(f"bench/{i}")
        report.send(end)


def shm_producer(size, iterations, go, report, channel):
    import numpy as np
    from multiprocessing import shared_memory

    array = np.full(size, 7, dtype=np.uint8)
    for _ in range(iterations):
        go.recv()
        start = time.monotonic_ns()
        shm = shared_memory.SharedMemory(create=True, size=size)
        np.ndarray(array.shape, array.dtype, buffer=shm.buf)[:] = array
        channel.send((shm.name, array.shape, array.dtype.str))
        report.send(start)
        channel.recv()  # the consumer is done with it
        shm.close()
        shm.unlink()


def shm_consumer(size, iterations, ready, report, channel):
    import numpy as np
    from multiprocessing import shared_memory

    for _ in range(iterations):
        ready.send(True)
        name, shape, dtype = channel.recv()
        shm = shared_memory.SharedMemory(name=name)
        view = np.ndarray(shape, np.dtype(dtype), buffer=shm.buf)
        touch(view)
        end = time.monotonic_ns()
        del view
        shm.close()
        channel.send(True)
        report.send(end)


def pipe_producer(size, iterations, go, report, channel):
    import numpy as np

    array = np.full(size, 7, dtype=np.uint8)
    for _ in range(iterations):
        go.recv()
        start = time.monotonic_ns()
        channel.send(array)
        report.send(start)


def pipe_consumer(size, iterations, ready, report, channel):
    for _ in range(iterations):
        ready.send(True)
        array = channel.recv()
        touch(array)
        report.send(time.monotonic_ns())


def torch_producer(size, iterations, go, report, queue):
    import numpy as np
    import torch

    array = np.full(size, 7, dtype=np.uint8)
    for _ in range(iterations):
        go.recv()
        start = time.monotonic_ns()
        queue.put(torch.from_numpy(array).share_memory_())
        report.send(start)
        queue_done = go.recv()  # keep the tensor alive until the consumer is done
        del queue_done


def torch_consumer(size, iterations, ready, report, queue):
    for _ in range(iterations):
        ready.send(True)
        tensor = queue.get()
        touch(tensor.numpy())
        end = time.monotonic_ns()
        del tensor
        report.send(end)


# ---- the driver ----

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4Ki,64Ki,1Mi,16Mi,256Mi")
    parser.add_argument("--max-iterations", type=int, default=100)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    return drive(sizes, args.max_iterations)


def drive(sizes, max_iterations) -> int:
    ctx = mp.get_context("spawn")
    try:
        import torch  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False

    daemon_dir = tempfile.mkdtemp(prefix="tsm-pybench-")
    socket = os.path.join(daemon_dir, "tensorshm.sock")
    tensorshmd = os.environ.get("TENSORSHMD", str(ROOT / "build" / "tensorshmd"))
    pool = 2 * max(sizes) + (256 << 20)
    daemon = subprocess.Popen([tensorshmd, "--socket", socket, "--host-pool", str(pool),
                               "--log-level", "warning"], stdout=subprocess.DEVNULL)
    while not os.path.exists(socket):
        if daemon.poll() is not None:
            print("tensorshmd did not start", file=sys.stderr)
            return 1
        time.sleep(0.01)

    methods = [("tensorshm", tsm_producer, tsm_consumer, (socket,), None),
               ("shared_memory", shm_producer, shm_consumer, (), "pipe"),
               ("Pipe pickle", pipe_producer, pipe_consumer, (), "pipe")]
    if have_torch:
        methods.append(("torch.mp", torch_producer, torch_consumer, (), "torch"))

    print(__doc__.split("\n\n")[0])
    print("medians of time.monotonic_ns from the producer's start to the consumer's last read;"
          " ratio = method / tensorshm")
    if not have_torch:
        print("torch.mp: skipped (torch is not installed)")
    header = f"{'size':>8} {'iters':>6}" + "".join(f" {m[0]:>15}" for m in methods) + \
        "".join(f" {m[0] + '/tsm':>18}" for m in methods[1:])
    print(header)
    try:
        for size in sizes:
            iterations = max(5, min(max_iterations, (1 << 30) // size))
            medians = []
            for name, producer, consumer, base_args, channel_kind in methods:
                medians.append(handoff(ctx, producer, consumer, base_args, channel_kind, size,
                                       iterations))
            line = f"{fmt_size(size):>8} {iterations:>6}" + "".join(f" {fmt_ns(m):>15}" for m in medians)
            line += "".join(f" {m / medians[0]:>17.2f}x" for m in medians[1:])
            print(line, flush=True)
        micro(socket)
    finally:
        daemon.terminate()
        daemon.wait()
    return 0


def micro(socket, gets=20000, puts=60000) -> None:
    """In this process: a warm get + np.from_dlpack + release, and puts of a tiny tensor."""
    import numpy as np
    import tensorshm

    client = tensorshm.connect(socket)
    client.put("micro/warm", np.arange(1024, dtype=np.float32))
    samples = []
    for _ in range(gets):
        start = time.perf_counter_ns()
        t = client.get("micro/warm")
        view = np.from_dlpack(t)
        del view, t
        samples.append(time.perf_counter_ns() - start)
    print(f"get + np.from_dlpack + release (warm, 4 KiB): median {fmt_ns(statistics.median(samples))}"
          f" over {gets}")
    tiny = np.zeros(2, dtype=np.float32)
    samples = []
    start_all = time.perf_counter_ns()
    for i in range(puts):
        tiny[0] = i
        start = time.perf_counter_ns()
        client.put("micro/tiny", tiny, replace=True)
        samples.append(time.perf_counter_ns() - start)
    rate = puts / ((time.perf_counter_ns() - start_all) / 1e9)
    print(f"put of a tiny tensor (8 bytes, replace), {puts} in a row: median "
          f"{fmt_ns(statistics.median(samples))} each, {rate:,.0f} puts/s")


def handoff(ctx, producer, consumer, base_args, channel_kind, size, iterations) -> float:
    go_parent, go_child = ctx.Pipe()
    ready_parent, ready_child = ctx.Pipe()
    start_parent, start_child = ctx.Pipe()
    end_parent, end_child = ctx.Pipe()
    extra_p, extra_c = (), ()
    if channel_kind == "pipe":
        a, b = ctx.Pipe()
        extra_p, extra_c = (a,), (b,)
    elif channel_kind == "torch":
        import torch.multiprocessing as tmp

        queue = tmp.get_context("spawn").Queue()
        extra_p = extra_c = (queue,)
    p = ctx.Process(target=producer, args=(*base_args, size, iterations, go_child, start_child,
                                           *extra_p))
    c = ctx.Process(target=consumer, args=(*base_args, size, iterations, ready_child, end_child,
                                           *extra_c))
    p.start()
    c.start()
    times = []
    for _ in range(iterations):
        ready_parent.recv()
        time.sleep(0.002)  # let the consumer enter its wait
        go_parent.send(True)
        start = start_parent.recv()
        end = end_parent.recv()
        times.append(end - start)
        if channel_kind == "torch":
            go_parent.send(True)
    p.join()
    c.join()
    if p.exitcode != 0 or c.exitcode != 0:
        raise RuntimeError(f"{producer.__name__}/{consumer.__name__} failed")
    return statistics.median(times)


if __name__ == "__main__":
    sys.exit(main())
