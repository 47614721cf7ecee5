#!/usr/bin/env python3
"""Producer process -> consumer process handoff of a numpy array, through tensorshm and the usual
alternatives; prints medians, ratios and page faults next to a warm copy of the same bytes.

    python bench/py_handoff.py [--sizes 4Ki,64Ki,1Mi,16Mi,256Mi] [--max-iterations 100]
                               [--ray-python PATH]

Each handoff starts when the producer holds a ready numpy array and ends when the consumer has
a numpy array of it and has read one byte per page. Both ends stamp time.monotonic_ns
(CLOCK_MONOTONIC, shared by the processes). Medians are of the steady state: the first handoff
of each size (a cold start) is left out. Before each handoff the driver waits 2 ms, the same for
every method, so that the consumer is waiting.

  warm copy:       np.copyto of the same bytes into an already-touched array, in a child
                   process spawned as the producers are: the memory-bandwidth floor
  tensorshm:       client.put(name, array) -> consumer waiting in client.get(name, timeout=None),
                   np.from_dlpack (zero-copy)
  shared_memory:   SharedMemory(create) + copy in + (name, shape, dtype) pickled over a Pipe ->
                   consumer attaches, wraps with np.ndarray (zero-copy)
  Pipe pickle:     conn.send(array) -> conn.recv()
  torch.mp:        torch.from_numpy(array).share_memory_() over a torch.multiprocessing queue
                   (only when torch imports)
  Ray:             ray.put(array) in the driver -> an actor's ray.get of the ref (zero-copy from
                   the object store), on a local Ray started with ray.init(num_cpus=2); run in
                   --ray-python (or RAY_PYTHON, or .venv-ray/bin/python, or this interpreter when
                   ray imports here; `make bench-ray` makes .venv-ray; bench/py_handoff_ray.py)

Page faults per handoff (getrusage ru_minflt deltas, medians) are measured inside the producer
around its send (put, copy in, pickle, ...) and inside the consumer around its receive, read and
release, and printed as producer/consumer.

Then, in one process: a warm client.get + np.from_dlpack + release of a published 4 KiB tensor;
a put of 1 MiB, put -> delete -> put again (the space reused), next to np.copyto of 1 MiB into
a warm array, with page faults per put; and 60,000 puts of an 8-byte tensor in a row (replace),
each a median.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os

# No method here calls BLAS, but numpy's OpenBLAS starts a thread per core that was seen taking
# ~9% of the CPU while every method ran; on a 2-core machine that skews every row. One thread,
# for every row alike (children inherit it).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import statistics
import sys
import time

from py_handoff_ray import ROOT, minor_faults, ray_python, run_ray, touch  # noqa: E402 - after the env


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



# ---- producers and consumers (child processes) ----
# Each sends (monotonic_ns, page faults) per handoff on `report`: the producer its start, the
# consumer its end.

def copy_child(size, iterations, report):
    """The warm copy: np.copyto into an array touched beforehand; sends (median ns, faults)."""
    import numpy as np

    source = np.full(size, 7, dtype=np.uint8)
    destination = np.zeros(size, dtype=np.uint8)
    times, faults = [], []
    for _ in range(iterations):
        f0 = minor_faults()
        start = time.monotonic_ns()
        np.copyto(destination, source)
        times.append(time.monotonic_ns() - start)
        faults.append(minor_faults() - f0)
    report.send((statistics.median(times), statistics.median(faults)))


def tsm_producer(socket, size, iterations, go, report):
    import numpy as np
    import tensorshm

    client = tensorshm.connect(socket)
    array = np.full(size, 7, dtype=np.uint8)
    for i in range(iterations):
        go.recv()
        f0 = minor_faults()
        start = time.monotonic_ns()
        client.put(f"bench/{i}", array).release()
        report.send((start, minor_faults() - f0))


def tsm_consumer(socket, size, iterations, ready, report):
    import numpy as np
    import tensorshm

    client = tensorshm.connect(socket)
    for i in range(iterations):
        ready.send(True)
        f0 = minor_faults()
        t = client.get(f"bench/{i}", timeout=None)
        touch(np.from_dlpack(t))
        end = time.monotonic_ns()
        t.release()
        faults = minor_faults() - f0
        client.delete(f"bench/{i}")
        report.send((end, faults))


def shm_producer(size, iterations, go, report, channel):
    import numpy as np
    from multiprocessing import shared_memory

    array = np.full(size, 7, dtype=np.uint8)
    for _ in range(iterations):
        go.recv()
        f0 = minor_faults()
        start = time.monotonic_ns()
        shm = shared_memory.SharedMemory(create=True, size=size)
        np.ndarray(array.shape, array.dtype, buffer=shm.buf)[:] = array
        channel.send((shm.name, array.shape, array.dtype.str))
        report.send((start, minor_faults() - f0))
        channel.recv()  # the consumer is done with it
        shm.close()
        shm.unlink()


def shm_consumer(size, iterations, ready, report, channel):
    import numpy as np
    from multiprocessing import shared_memory

    for _ in range(iterations):
        ready.send(True)
        f0 = minor_faults()
        name, shape, dtype = channel.recv()
        shm = shared_memory.SharedMemory(name=name)
        view = np.ndarray(shape, np.dtype(dtype), buffer=shm.buf)
        touch(view)
        end = time.monotonic_ns()
        del view
        shm.close()
        faults = minor_faults() - f0
        channel.send(True)
        report.send((end, faults))


def pipe_producer(size, iterations, go, report, channel):
    import numpy as np

    array = np.full(size, 7, dtype=np.uint8)
    for _ in range(iterations):
        go.recv()
        f0 = minor_faults()
        start = time.monotonic_ns()
        channel.send(array)
        report.send((start, minor_faults() - f0))


def pipe_consumer(size, iterations, ready, report, channel):
    for _ in range(iterations):
        ready.send(True)
        f0 = minor_faults()
        array = channel.recv()
        touch(array)
        end = time.monotonic_ns()
        del array
        report.send((end, minor_faults() - f0))


def torch_producer(size, iterations, go, report, queue):
    import numpy as np
    import torch

    array = np.full(size, 7, dtype=np.uint8)
    for _ in range(iterations):
        go.recv()
        f0 = minor_faults()
        start = time.monotonic_ns()
        tensor = torch.from_numpy(array).share_memory_()
        queue.put(tensor)
        report.send((start, minor_faults() - f0))
        go.recv()  # keep the tensor alive until the consumer is done
        del tensor


def torch_consumer(size, iterations, ready, report, queue):
    for _ in range(iterations):
        ready.send(True)
        f0 = minor_faults()
        tensor = queue.get()
        touch(tensor.numpy())
        end = time.monotonic_ns()
        del tensor
        report.send((end, minor_faults() - f0))


# ---- the driver ----

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4Ki,64Ki,1Mi,16Mi,256Mi")
    parser.add_argument("--max-iterations", type=int, default=100)
    parser.add_argument("--ray-python", default=None,
                        help="the interpreter of a venv with ray (default: RAY_PYTHON, this one "
                             "if ray imports, else .venv-ray/bin/python if present)")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    return drive(sizes, args.max_iterations, ray_python(args.ray_python))


def median_after_first(values):
    """The steady-state median: the first (cold) value left out."""
    return statistics.median(values[1:] if len(values) > 1 else values)


def start_daemon(pool: int):
    """A private tensorshmd ($TENSORSHMD, else build/tensorshmd) with a host pool of `pool` bytes:
    a tensorshm.Daemon (its own socket and shm prefix), serving once this returns."""
    import tensorshm

    return tensorshm.Daemon(f"{pool}B",
                            tensorshmd=os.environ.get("TENSORSHMD",
                                                      str(ROOT / "build" / "tensorshmd")),
                            log_level="warning")


def drive(sizes, max_iterations, ray_interpreter) -> int:
    ctx = mp.get_context("spawn")
    try:
        import torch  # noqa: F401

        torch_skipped = None
    except ImportError as e:
        torch_skipped = f"torch does not import ({e})"

    # +1: the cold first handoff, left out of the medians.
    iterations = {size: max(5, min(max_iterations, (1 << 30) // size)) + 1 for size in sizes}
    ray_results = run_ray(ray_interpreter, sizes, [iterations[s] for s in sizes])
    ray_skipped = ray_results.get("skipped")

    pool = 2 * max(sizes) + (256 << 20)
    import tensorshm

    try:
        daemon = start_daemon(pool)
    except tensorshm.Error as e:
        print(e, file=sys.stderr)
        return 1
    socket = daemon.socket

    methods = [("tensorshm", tsm_producer, tsm_consumer, (socket,), None),
               ("shared_memory", shm_producer, shm_consumer, (), "pipe"),
               ("Pipe pickle", pipe_producer, pipe_consumer, (), "pipe")]
    if torch_skipped is None:
        methods.append(("torch.mp", torch_producer, torch_consumer, (), "torch"))
    names = [m[0] for m in methods] + ([] if ray_skipped else ["Ray"])

    print(__doc__.split("\n\n")[0])
    print("steady-state medians of time.monotonic_ns from the producer's start to the consumer's"
          " last read; method/tsm = how many times tensorshm is faster; tsm/copy = tensorshm"
          " over the warm copy")
    if torch_skipped:
        print(f"torch.mp: skipped: {torch_skipped}")
    if ray_skipped:
        print(f"Ray: skipped: {ray_skipped}")
    elif ray_interpreter != sys.executable:
        print(f"Ray: run by {ray_interpreter}")
    header = f"{'size':>8} {'iters':>6} {'warm copy':>11}" + "".join(f" {n:>13}" for n in names)
    header += f" {'tsm/copy':>9}" + "".join(f" {n + '/tsm':>17}" for n in names[1:])
    print(header)
    fault_rows = []
    try:
        for size in sizes:
            n = iterations[size]
            copy_ns, copy_faults = warm_copy(ctx, size, n)
            medians, faults = [], []
            for name, producer, consumer, base_args, channel_kind in methods:
                times, pf, cf = handoff(ctx, producer, consumer, base_args, channel_kind, size, n)
                medians.append(median_after_first(times))
                faults.append((median_after_first(pf), median_after_first(cf)))
            if not ray_skipped:
                times, pf, cf = ray_results[size]
                medians.append(median_after_first(times))
                faults.append((median_after_first(pf), median_after_first(cf)))
            line = f"{fmt_size(size):>8} {n - 1:>6} {fmt_ns(copy_ns):>11}"
            line += "".join(f" {fmt_ns(m):>13}" for m in medians)
            line += f" {medians[0] / copy_ns:>8.2f}x"
            line += "".join(f" {m / medians[0]:>16.2f}x" for m in medians[1:])
            print(line, flush=True)
            fault_rows.append((size, copy_faults, faults))
        print("\npage faults per handoff, producer/consumer (steady-state medians of ru_minflt"
              " deltas)")
        print(f"{'size':>8} {'warm copy':>11}" + "".join(f" {n:>13}" for n in names))
        for size, copy_faults, faults in fault_rows:
            print(f"{fmt_size(size):>8} {copy_faults:>11.0f}"
                  + "".join(f" {f'{p:.0f}/{c:.0f}':>13}" for p, c in faults))
        print()
        micro(socket)
    finally:
        daemon.stop()
    return 0


def micro(socket, gets=20000, puts=60000, big_puts=200) -> None:
    """In this process: a warm get + np.from_dlpack + release; puts of 1 MiB, space reused,
    against a warm np.copyto; puts of a tiny tensor."""
    import numpy as np
    import tensorshm

    client = tensorshm.connect(socket)
    print(f"get + np.from_dlpack + release (warm, 4 KiB): median "
          f"{fmt_ns(warm_get_ns(client, gets))} over {gets}")

    array = np.full(1 << 20, 7, dtype=np.uint8)
    put_ns, put_faults = [], []
    for _ in range(big_puts + 1):
        f0 = minor_faults()
        start = time.perf_counter_ns()
        t = client.put("micro/1MiB", array)
        put_ns.append(time.perf_counter_ns() - start)
        put_faults.append(minor_faults() - f0)
        t.release()
        client.delete("micro/1MiB")
    destination = np.zeros_like(array)
    copy_ns, copy_faults = [], []
    for _ in range(big_puts + 1):
        f0 = minor_faults()
        start = time.perf_counter_ns()
        np.copyto(destination, array)
        copy_ns.append(time.perf_counter_ns() - start)
        copy_faults.append(minor_faults() - f0)
    put, copy = median_after_first(put_ns), median_after_first(copy_ns)
    print(f"put of 1 MiB (put -> delete -> put again, the space reused): median {fmt_ns(put)}, "
          f"{median_after_first(put_faults):.0f} page faults per put (first put: "
          f"{fmt_ns(put_ns[0])}, {put_faults[0]} faults); np.copyto of 1 MiB into a warm array: "
          f"median {fmt_ns(copy)}, {median_after_first(copy_faults):.0f} faults; "
          f"put/copy {put / copy:.2f}x, over {big_puts}")

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


def warm_get_ns(client, gets: int) -> float:
    """The median of `gets` warm client.get + np.from_dlpack + release of a published 4 KiB
    tensor, in this process."""
    import numpy as np

    client.put("micro/warm", np.arange(1024, dtype=np.float32)).release()
    samples = []
    for _ in range(gets):
        start = time.perf_counter_ns()
        t = client.get("micro/warm")
        view = np.from_dlpack(t)
        del view, t
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples)


def warm_copy(ctx, size, iterations):
    """(median ns, median faults) of the warm copy, in a spawned child process."""
    report_parent, report_child = ctx.Pipe()
    p = ctx.Process(target=copy_child, args=(size, iterations, report_child))
    p.start()
    result = report_parent.recv()
    p.join()
    if p.exitcode != 0:
        raise RuntimeError("copy_child failed")
    return result


def handoff(ctx, producer, consumer, base_args, channel_kind, size, iterations):
    """Per handoff: the times, the producer's faults, the consumer's faults (lists)."""
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
    times, producer_faults, consumer_faults = [], [], []
    for _ in range(iterations):
        ready_parent.recv()
        time.sleep(0.002)  # let the consumer enter its wait
        go_parent.send(True)
        start, pf = start_parent.recv()
        end, cf = end_parent.recv()
        times.append(end - start)
        producer_faults.append(pf)
        consumer_faults.append(cf)
        if channel_kind == "torch":
            go_parent.send(True)
    p.join()
    c.join()
    if p.exitcode != 0 or c.exitcode != 0:
        raise RuntimeError(f"{producer.__name__}/{consumer.__name__} failed")
    return times, producer_faults, consumer_faults


if __name__ == "__main__":
    sys.exit(main())
