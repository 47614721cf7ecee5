#!/usr/bin/env python3
"""Feeding a real Triton Inference Server: tensor bytes inline in the request, tritonclient's own
system shared-memory utilities, and tensorshm zero-copy. The same Python-backend model for all
(affine: y = 2x + 1 and s = sum(x), FP32), on the CPU tritonserver PyPI's nvidia-pytriton bundles.

Per request, each row starts from x where its user has it and ends with y where its user wants it:
  inline      x (numpy) in the request body, y in the response (HTTP binary extension, or gRPC)
  shm-utils   as tritonclient's examples do: create a region for x and one for y, copy x in,
              register both, infer, copy y out, unregister, destroy
  tensorshm   x published in tensorshm by a producer process; get x, create y, infer with both
              by (region, offset), publish y for other processes (the segment registered for
              the inference and unregistered after: two more requests to Triton)
  tensorshm+put  the same, timing the producer's put of x into tensorshm too (its copy)
Prints medians (ms) per size and the ratios of tensorshm to the others.

    make bench-triton            # or: .venv/bin/python bench/triton_feed.py [--sizes 1,16,64]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time
import uuid

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "triton"))

import tensorshm  # noqa: E402
from tensorshm.triton import TritonFeeder  # noqa: E402
from tritonserver import TritonServer, write_models  # noqa: E402

MIB = 1 << 20


def median_ms(fn, runs: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def expected(x: np.ndarray) -> np.ndarray:
    return x * np.float32(2) + np.float32(1)


def inline_row(protocol, triton, x: np.ndarray):
    def run() -> None:
        infer_input = protocol.InferInput("x", list(x.shape), "FP32")
        outputs = [protocol.InferRequestedOutput("y"), protocol.InferRequestedOutput("s")]
        if protocol.__name__.endswith("http"):
            infer_input.set_data_from_numpy(x, binary_data=True)
            outputs = [protocol.InferRequestedOutput(n, binary_data=True) for n in ("y", "s")]
        else:
            infer_input.set_data_from_numpy(x)
        y = triton.infer("affine", [infer_input], outputs=outputs).as_numpy("y")
        assert y[-1] == expected(x[-1:])[0]
    return run


def shm_utils_row(protocol, triton, x: np.ndarray):
    import tritonclient.utils.shared_memory as shm

    def run() -> None:
        tag = uuid.uuid4().hex[:8]
        handles = [shm.create_shared_memory_region(f"in{tag}", f"/tfin{tag}", x.nbytes),
                   shm.create_shared_memory_region(f"out{tag}", f"/tfout{tag}", x.nbytes)]
        try:
            shm.set_shared_memory_region(handles[0], [x])
            triton.register_system_shared_memory(f"in{tag}", f"/tfin{tag}", x.nbytes)
            triton.register_system_shared_memory(f"out{tag}", f"/tfout{tag}", x.nbytes)
            infer_input = protocol.InferInput("x", list(x.shape), "FP32")
            infer_input.set_shared_memory(f"in{tag}", x.nbytes)
            y_out = protocol.InferRequestedOutput("y")
            y_out.set_shared_memory(f"out{tag}", x.nbytes)
            triton.infer("affine", [infer_input],
                         outputs=[y_out, protocol.InferRequestedOutput("s")])
            y = np.array(shm.get_contents_as_numpy(handles[1], np.float32, list(x.shape)))
            assert y[-1] == expected(x[-1:])[0]
        finally:
            for name in (f"in{tag}", f"out{tag}"):
                triton.unregister_system_shared_memory(name)
            for handle in handles:
                shm.destroy_shared_memory_region(handle)
    return run


def tensorshm_row(protocol, client, feed: TritonFeeder, x: np.ndarray, put: bool):
    client.put("bench/x", x, replace=True)

    def run() -> None:
        if put:
            client.put("bench/x", x, replace=True)
        with client.get("bench/x") as tx:
            y = client.create(tx.shape, tx.dtype)
            feed.infer("affine", [feed.input("x", tx)],
                       [feed.output("y", y), protocol.InferRequestedOutput("s")])
            y.publish("bench/y", replace=True)
        with client.get("bench/y") as ty:
            assert np.from_dlpack(ty)[-1] == expected(x[-1:])[0]
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,16,64", help="input sizes in MiB")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--triton-venv", default=os.environ.get("TSM_TRITON_VENV",
                                                                 str(ROOT / ".venv-triton")))
    parser.add_argument("--tensorshmd", default=os.environ.get("TENSORSHMD",
                                                                str(ROOT / "build" / "tensorshmd")))
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.protocol == "http":
        import tritonclient.http as protocol
    else:
        import tritonclient.grpc as protocol  # type: ignore[no-redef]

    work = pathlib.Path(tempfile.mkdtemp(prefix="tsm-triton-bench-"))
    pool = max(sizes) * MIB * 8
    daemon = tensorshm.Daemon(f"{pool // MIB}Mi", tensorshmd=args.tensorshmd, log_level="warning")
    socket = daemon.socket
    # The Python backend's own region, sized for the largest request at once (default: grows
    # 1 MiB at a time), the same for every row.
    backend_shm = f"--backend-config=python,shm-default-byte-size={4 * max(sizes) * MIB}"
    try:
        with TritonServer(pathlib.Path(args.triton_venv), write_models(work / "models"), work,
                          backend_shm) as server:
            url = server.http_url if args.protocol == "http" else server.grpc_url
            triton = protocol.InferenceServerClient(url)
            client = tensorshm.connect(socket)
            feed = TritonFeeder(triton, client)
            print(f"Triton {args.protocol}, model affine (y = 2x + 1, s = sum(x)), FP32; median "
                  f"of {args.runs} requests after 3 warm-ups, ms")
            print(f"{'size':>7} {'inline':>9} {'shm-utils':>10} {'tensorshm':>10} "
                  f"{'+put':>8} {'vs inline':>10} {'vs shm-utils':>13}")
            for size in sizes:
                x = np.random.default_rng(size).random(size * MIB // 4, dtype=np.float32)
                rows = {
                    "inline": inline_row(protocol, triton, x),
                    "shm-utils": shm_utils_row(protocol, triton, x),
                    "tensorshm": tensorshm_row(protocol, client, feed, x, put=False),
                    "+put": tensorshm_row(protocol, client, feed, x, put=True),
                }
                ms = {name: median_ms(run, args.runs, 3) for name, run in rows.items()}
                print(f"{size:>4} MiB {ms['inline']:>9.1f} {ms['shm-utils']:>10.1f} "
                      f"{ms['tensorshm']:>10.1f} {ms['+put']:>8.1f} "
                      f"{ms['inline'] / ms['tensorshm']:>9.2f}x "
                      f"{ms['shm-utils'] / ms['tensorshm']:>12.2f}x", flush=True)
            feed.close()
            client.close()
            triton.close()
    finally:
        daemon.stop()


if __name__ == "__main__":
    main()
