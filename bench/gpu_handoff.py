#!/usr/bin/env python3
"""Warm gets of a CUDA tensor against a host tensor, then the producer process -> consumer
process handoff of a torch CUDA tensor, through tensorshm and through torch.multiprocessing's
CUDA IPC in the same run; prints medians and ratios.

    python bench/gpu_handoff.py [--sizes 4Ki,64Mi,1Gi] [--iterations 20] [--device 0]
                                [--warm-gets 20000]

Warm gets: a producer process publishes a 4 KiB host tensor and a 4 KiB CUDA tensor; a consumer
process gets each once, then N times in a row: client.get + __dlpack__ (the CUDA one waits on
the ready event as a consumer's stream would, on the legacy default stream) + release. Printed:
time per get+release, and, counted by strace -f -c over the whole consumer process (every
thread) with N gets against none, system calls and sendmsg calls (each call to the daemon sends
at least one message) per get+release. Runs wherever tensorshm loads a CUDA driver: a GPU's, or
the emulated one (TENSORSHM_LIBCUDA=build/tests/libtsm_fake_cuda.so).

Each handoff starts when the producer begins to make the tensor and ends when the consumer holds
a torch tensor of it whose bytes are ready (its current stream synchronized). Both ends stamp
time.monotonic_ns (CLOCK_MONOTONIC, shared by the processes). Medians leave out the first
handoff of each size (a cold start). Before each handoff the driver waits 2 ms, the same for
every method, so that the consumer is waiting.

  tensorshm:        client.create(device="cuda:N") -> torch.from_dlpack(w).fill_(7) ->
                    w.publish(name); the consumer waits in client.get(name, timeout=None), then
                    torch.from_dlpack (zero-copy; its stream waits on the producer's ready event)
  tensorshm put:    x filled on the device beforehand; client.put(name, x) (a device-to-device
                    copy into the pool, then the publish)
  torch.mp:         torch.empty(device) -> fill_(7) -> a torch.multiprocessing spawn queue's put;
                    the consumer's queue.get (CUDA IPC of the caching allocator's block)

Needs torch with a CUDA device; prints why and exits 0 without one (CI has no GPU). The daemon
is $TENSORSHMD, else build/tensorshmd, started with a CUDA pool of the given device (its pool
kind: $TSM_CUDA_POOL_KIND, default auto), as a tensorshm.Daemon.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from py_handoff import fmt_ns, fmt_size, parse_size


def tsm_producer(socket, device, size, iterations, go, report):
    import tensorshm
    import torch

    torch.cuda.set_device(device)
    client = tensorshm.connect(socket)
    for i in range(iterations):
        go.recv()
        start = time.monotonic_ns()
        w = client.create((size,), "uint8", device=f"cuda:{device}")
        torch.from_dlpack(w).fill_(7)
        w.publish(f"gpu-bench/{i}")
        report.send(start)
    go.recv()  # ready events live here until the consumer is done


def tsm_put_producer(socket, device, size, iterations, go, report):
    import tensorshm
    import torch

    torch.cuda.set_device(device)
    client = tensorshm.connect(socket)
    x = torch.full((size,), 7, dtype=torch.uint8, device=f"cuda:{device}")
    torch.cuda.synchronize()
    for i in range(iterations):
        go.recv()
        start = time.monotonic_ns()
        client.put(f"gpu-bench/{i}", x).release()
        report.send(start)
    go.recv()


def tsm_consumer(socket, device, size, iterations, ready, report):
    import tensorshm
    import torch

    torch.cuda.set_device(device)
    client = tensorshm.connect(socket)
    for i in range(iterations):
        ready.send(True)
        t = client.get(f"gpu-bench/{i}", timeout=None)
        y = torch.from_dlpack(t)
        torch.cuda.current_stream().synchronize()
        end = time.monotonic_ns()
        assert y.numel() == size
        del y
        t.release()
        client.delete(f"gpu-bench/{i}")
        report.send(end)


def torch_producer(device, size, iterations, go, report, queue):
    import torch

    torch.cuda.set_device(device)
    kept = []
    for _ in range(iterations):
        go.recv()
        start = time.monotonic_ns()
        x = torch.empty(size, dtype=torch.uint8, device=f"cuda:{device}")
        x.fill_(7)
        queue.put(x)
        report.send(start)
        kept.append(x)  # torch.mp: the sender keeps the tensor while the receiver uses it
    go.recv()


def torch_consumer(device, size, iterations, ready, report, queue):
    import torch

    torch.cuda.set_device(device)
    for _ in range(iterations):
        ready.send(True)
        y = queue.get()
        torch.cuda.current_stream().synchronize()
        end = time.monotonic_ns()
        assert y.numel() == size
        del y
        report.send(end)


def handoff(ctx, producer, consumer, base_args, queue, size, iterations):
    """The handoff times (ns) of one method and size."""
    go_parent, go_child = ctx.Pipe()
    ready_parent, ready_child = ctx.Pipe()
    start_parent, start_child = ctx.Pipe()
    end_parent, end_child = ctx.Pipe()
    extra = (queue,) if queue is not None else ()
    p = ctx.Process(target=producer, args=(*base_args, size, iterations, go_child, start_child,
                                           *extra))
    c = ctx.Process(target=consumer, args=(*base_args, size, iterations, ready_child, end_child,
                                           *extra))
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
    go_parent.send(True)
    p.join()
    c.join()
    if p.exitcode != 0 or c.exitcode != 0:
        raise RuntimeError(f"{producer.__name__}/{consumer.__name__} failed")
    return times


WARM_PRODUCER = """
import sys, numpy as np, tensorshm
client = tensorshm.connect(sys.argv[1])
client.put("warm/host", np.full(4096, 7, np.uint8), replace=True).release()
w = client.create((4096,), "uint8", device="cuda:" + sys.argv[2])
w.publish("warm/cuda", replace=True)
print("published", flush=True)
sys.stdin.read()  # the ready event lives here
"""

WARM_CONSUMER = """
import sys, time, tensorshm
client = tensorshm.connect(sys.argv[1])
name, n = sys.argv[2], int(sys.argv[3])
t = client.get(name); t.__dlpack__(max_version=(1, 3)); t.release()  # maps the segment
start = time.perf_counter_ns()
for _ in range(n):
    t = client.get(name)
    t.__dlpack__(max_version=(1, 3))
    t.release()
print((time.perf_counter_ns() - start) / max(n, 1))
"""


def strace_counts(argv) -> tuple[int, int]:
    """(system calls, sendmsg calls) of `argv` and its threads, by strace -f -c."""
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
        subprocess.run(["strace", "-f", "-c", "-o", out.name, *argv], check=True,
                       stdout=subprocess.DEVNULL)
        text = out.read()
    total = re.search(r"^\S+\s+\S+\s+\S+\s+\S+\s+(\d+)\s+(?:\d+\s+)?total$", text, re.M)
    sendmsg = re.search(r"^.*\s(\d+)\s+(?:\d+\s+)?sendmsg$", text, re.M)
    return int(total.group(1)) if total else -1, int(sendmsg.group(1)) if sendmsg else 0


def warm_gets(device: int, gets: int) -> None:
    import tensorshm

    with tensorshm.Daemon("64Mi", cuda_pool=f"cuda:{device}=64Mi",
                          cuda_pool_kind=os.environ.get("TSM_CUDA_POOL_KIND", "auto")) as daemon:
        warm_gets_on(daemon.socket, device, gets)


def warm_gets_on(socket: str, device: int, gets: int) -> None:
    producer = subprocess.Popen([sys.executable, "-c", WARM_PRODUCER, socket, str(device)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if producer.stdout.readline().strip() != "published":
            raise RuntimeError("the warm producer failed")
        driver = os.environ.get("TENSORSHM_LIBCUDA", "libcuda.so.1")
        print(f"warm get+__dlpack__+release of a 4 KiB tensor, {gets} in a row (driver {driver})")
        print(f"{'tensor':>8} {'per get':>10} {'syscalls/get':>13} {'sendmsg/get':>12}   "
              "(strace: calls with the gets / without)")
        per = {}
        for kind in ("host", "cuda"):
            name = f"warm/{kind}"
            run = [sys.executable, "-c", WARM_CONSUMER, socket, name]
            ns = statistics.median(
                float(subprocess.run(run + [str(gets)], check=True, capture_output=True,
                                     text=True).stdout) for _ in range(3))
            per[kind] = ns
            if shutil.which("strace"):
                with_gets = strace_counts(run + [str(gets)])
                without = strace_counts(run + ["0"])
                calls = (with_gets[0] - without[0]) / gets
                sends = (with_gets[1] - without[1]) / gets
                print(f"{kind:>8} {fmt_ns(ns):>10} {max(calls, 0.0):>13.3f} "
                      f"{max(sends, 0.0):>12.3f}   ({with_gets[0]} / {without[0]})")
            else:
                print(f"{kind:>8} {fmt_ns(ns):>10} {'(no strace)':>13}")
        print(f"cuda / host: {per['cuda'] / per['host']:.2f}x\n")
    finally:
        producer.stdin.close()
        producer.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4Ki,64Mi,1Gi")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--warm-gets", type=int, default=20000)
    args = parser.parse_args()
    try:
        warm_gets(args.device, args.warm_gets)
    except Exception as e:  # no driver, or no device: say so and go on to the handoff
        print(f"gpu_handoff: warm gets skipped: {e}")
    try:
        import torch
    except ImportError as e:
        print(f"gpu_handoff: skipped: torch does not import ({e})")
        return 0
    if not torch.cuda.is_available():
        print("gpu_handoff: skipped: no CUDA device (torch.cuda.is_available() is False)")
        return 0
    import torch.multiprocessing as tmp

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    ctx = tmp.get_context("spawn")
    pool = 3 * max(sizes) + (64 << 20)
    kind = os.environ.get("TSM_CUDA_POOL_KIND", "auto")
    import tensorshm

    daemon = tensorshm.Daemon("64Mi", cuda_pool=f"cuda:{args.device}={pool}B",
                              cuda_pool_kind=kind)
    socket = daemon.socket
    print(f"gpu_handoff: {torch.cuda.get_device_name(args.device)}, torch {torch.__version__}, "
          f"--cuda-pool-kind {kind}; medians of {args.iterations - 1} handoffs after a cold one "
          "(producer starts -> consumer holds, stream synchronized)")
    rows = []
    try:
        for size in sizes:
            iterations = args.iterations if size < (256 << 20) else max(4, args.iterations // 4)
            row = {"size": size}
            row["tensorshm"] = handoff(ctx, tsm_producer, tsm_consumer, (socket, args.device),
                                       None, size, iterations)
            row["tensorshm put"] = handoff(ctx, tsm_put_producer, tsm_consumer,
                                           (socket, args.device), None, size, iterations)
            row["torch.mp"] = handoff(ctx, torch_producer, torch_consumer, (args.device,),
                                      ctx.Queue(), size, iterations)
            rows.append(row)
    finally:
        daemon.stop()
    print(f"{'size':>8} {'tensorshm':>12} {'put':>12} {'torch.mp':>12} {'tsm/torch':>10} "
          f"{'put/torch':>10}")
    for row in rows:
        med = {k: statistics.median(v[1:]) for k, v in row.items() if k != "size"}
        print(f"{fmt_size(row['size']):>8} {fmt_ns(med['tensorshm']):>12} "
              f"{fmt_ns(med['tensorshm put']):>12} {fmt_ns(med['torch.mp']):>12} "
              f"{med['tensorshm'] / med['torch.mp']:>9.2f}x {med['tensorshm put'] / med['torch.mp']:>9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
