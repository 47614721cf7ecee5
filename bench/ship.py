#!/usr/bin/env python3
"""Shipping a named tensor from node A's tensorshmd to node B's: tensorshm.transfer (NIXL) next to
Ray's object store and a plain gRPC byte stream. Two real daemons on this machine stand for the
two nodes (each its own socket, shm prefix and pool); each side's code runs in its own process.

    python bench/ship.py [--sizes 64Mi,1Gi] [--runs N[,N]]
                         [--methods nixl,nixl-tcp,mover-grpc,ray,grpc]

A float32 tensor of random bytes is published in A's daemon; each ship ends with the same name
published in B's daemon, and the driver checks its SHA-1 against A's after every ship (untimed),
having deleted it from B before the next. Times are medians of the ships after one warm-up:

  nixl       tensorshm.transfer: B's Mover.pull from A's Mover (bench/ship_node.py), both proving
             a fleet token on every call: Offer over gRPC (A registers the tensor's span), a
             buffer created in B's daemon, one NIXL READ of A's shared memory straight into it,
             Finish, publish. The movers' own UCX transports (all but TCP): on one machine that
             is CMA (process_vm_readv), not a network
  nixl-tcp   the same with UCX_TLS=tcp,self and allow_tcp_rma (unsafe: see docs/scale-out.md):
             the READ's bytes cross a TCP socket on loopback, as they would cross a network
             between nodes. UCX's TCP transport has no GET: UCX emulates it (UCX_PROTO_INFO=y
             says "software emulation"), A's UCX answering with the bytes packed into its
             active messages and B's copying them into place
  mover-grpc tensorshm.transfer with transport="grpc", what movers that share no safe UCX
             transport do: B reads A's span in 4 MiB Read calls over the authenticated gRPC
             channel (each call and answer proved with the token: HMAC-SHA256 over the bytes)
  ray        a two-node ray.cluster_utils.Cluster on 127.0.0.1 (bench/ship_ray.py): an actor on A
             ray.put()s a numpy view of A's tensor, an actor on B ray.get()s the ref and
             client.put()s it into B's daemon, as a user moving tensors with Ray would. B's raylet
             pulls the object from A's: A's object manager reads it out of A's store in chunks
             (object_manager_default_chunk_size, 5 MiB in Ray's defaults), one gRPC Push call
             each over TCP on loopback, and B's writes them into B's store
  grpc       a server-streaming gRPC call on TCP loopback (grpcio's generic handlers, bytes in and
             out): A streams the tensor in 4 MiB messages, B writes them into a tensor it created
             in B's daemon and publishes it

ms is the median, min ms the fastest ship; GB/s is decimal (1e9 bytes per second), of the
median; "vs ray" and "vs grpc" are that row's median over this row's (above 1: this row is
faster). Run `make bench-ship` (flags in SHIP_ARGS).
"""

from __future__ import annotations

import os

# UCX on loopback; NIXL's INFO lines off stdout (ship_node.py answers there); one BLAS thread
# (numpy's OpenBLAS starts one per core otherwise, on a 2-core machine). Children inherit these.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402 - after the environment
import hashlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import secrets  # noqa: E402
import tempfile  # noqa: E402

import numpy as np  # noqa: E402

import tensorshm  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
POOL = 3 << 30  # each daemon's --host-pool

# method -> (its processes' environment (None: unset), the copies of the bytes between the pools)
METHODS = {
    "nixl": ({"UCX_TLS": None},
             "none besides the READ (here CMA: one kernel copy, A's shm -> B's)"),
    "nixl-tcp": ({"UCX_TLS": "tcp,self"},
                 "READ emulated by UCX: A's UCX packs into its sends, TCP, B's UCX copies out"),
    "mover-grpc": ({}, "into 4 MiB Read answers on A, hashed both sides, gRPC over TCP, out"),
    "ray": ({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"},
            "into A's object store, gRPC chunks over TCP into B's store, out into B's daemon"),
    "grpc": ({}, "into 4 MiB messages on A, gRPC over TCP, out of them into B's daemon"),
}
BASELINES = ("ray", "grpc")
NEEDS = {"nixl": ("nixl_cu12", "grpc"), "nixl-tcp": ("nixl_cu12", "grpc"),
         "mover-grpc": ("grpc",), "ray": ("ray",), "grpc": ("grpc",)}


def parse_size(text: str) -> int:
    for suffix, factor in (("Ki", 1 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30)):
        if text.endswith(suffix):
            return int(text[:-2]) * factor
    return int(text)


def fmt_size(size: int) -> str:
    for suffix, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size % factor == 0:
            return f"{size // factor} {suffix}"
    return f"{size} B"


def start_daemon(binary: str) -> tensorshm.Daemon:
    """A private tensorshmd standing for one node (its own socket and shm prefix), with a
    POOL-sized host pool."""
    return tensorshm.Daemon(f"{POOL >> 20}Mi", tensorshmd=binary, timeout=20.0,
                            log_level="warning")


class Node:
    """A process answering ship commands (ship_node.py or ship_ray.py): `ready ADDRESS`, then
    one `answer JSON` line per command."""

    def __init__(self, argv: list[str], env: dict[str, str | None]) -> None:
        env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
        self.process = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env)
        self.address = self._line("ready ")

    def _line(self, prefix: str) -> str:
        """The rest of the process's next line starting with `prefix` (UCX and Ray log there)."""
        while True:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.process.args[1]} ended (status {self.process.wait()})")
            if line.startswith(prefix):
                return line[len(prefix):].strip()
            print(f"  {pathlib.Path(self.process.args[1]).name}: {line}", end="", file=sys.stderr)

    def ship(self, **command) -> dict:
        self.process.stdin.write(json.dumps({"op": "ship", **command}) + "\n")
        self.process.stdin.flush()
        answer = json.loads(self._line("answer "))
        if not answer["ok"]:
            raise RuntimeError(f"ship {command}: {answer['error']}: {answer['message']}")
        return answer

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def digest(client: tensorshm.Client, name: str) -> tuple[str, str, tuple[int, ...]]:
    """(SHA-1 of the bytes, dtype, shape) of the tensor published as `name`."""
    with client.get(name) as tensor:
        return (hashlib.sha1(np.from_dlpack(tensor).reshape(-1).view(np.uint8)).hexdigest(),
                tensor.dtype, tuple(tensor.shape))


def start(method: str, daemons: tuple[tensorshm.Daemon, tensorshm.Daemon],
          store_bytes: int) -> tuple[list, Node, str]:
    """The method's processes, the one that ships into B, and the address it ships from."""
    env = METHODS[method][0]
    if method == "ray":
        sink = Node([str(HERE / "ship_ray.py"), daemons[0].socket, daemons[1].socket,
                     str(store_bytes)], env)
        return [sink], sink, ""
    kind = method
    source = Node([str(HERE / "ship_node.py"), kind, daemons[0].socket], env)
    try:
        sink = Node([str(HERE / "ship_node.py"), kind, daemons[1].socket], env)
    except BaseException:
        source.stop()
        raise
    return [source, sink], sink, source.address


def measure(method: str, daemons, clients, sources: dict, runs: dict, store_bytes: int,
            notes: list[str]) -> dict[int, list[float]]:
    """{size: seconds of each ship after the warm-up}, every ship's bytes checked."""
    processes, sink, peer = start(method, daemons, store_bytes)
    times: dict[int, list[float]] = {}
    try:
        for size, expected in sources.items():
            name = f"ship/{size}"
            times[size] = []
            for run in range(1 + runs[size]):
                if name in clients[1]:
                    clients[1].delete(name)
                answer = sink.ship(peer=peer, name=name)
                if digest(clients[1], name) != expected:
                    raise RuntimeError(f"{method}: {name} in B's daemon differs from A's")
                if run > 0:
                    times[size].append(answer["seconds"])
                if method == "ray" and run == 0 and not notes:
                    notes.append(
                        f"ray: actors on nodes {answer['source_node'][:8]} (A) and "
                        f"{answer['sink_node'][:8]} (B); after B's get the object was in "
                        f"{len(answer['object_nodes'])} object store(s): "
                        + ", ".join(n[:8] for n in answer["object_nodes"]))
            clients[1].delete(name)
    finally:
        for process in reversed(processes):  # the sink first: its channel closes before the server
            process.stop()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64Mi,1Gi")
    parser.add_argument("--runs", help="timed ships per size after one warm-up: one count for "
                        "every size, or one per size (default: 10 under 512 MiB, 3 from there)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--tensorshmd", default=os.environ.get(
        "TENSORSHMD", str(ROOT / "build" / "tensorshmd")))
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    runs_list = ([int(r) for r in args.runs.split(",")] if args.runs else
                 [10 if size < 512 << 20 else 3 for size in sizes])
    if len(runs_list) not in (1, len(sizes)) or min(runs_list) < 1:
        parser.error(f"--runs {args.runs}: one count >= 1, or one per size ({len(sizes)})")
    runs = dict(zip(sizes, runs_list * len(sizes) if len(runs_list) == 1 else runs_list))
    methods = args.methods.split(",")
    for method in methods:
        if method not in METHODS:
            parser.error(f"--methods: {method}: not one of {', '.join(METHODS)}")
        missing = [m for m in NEEDS[method] if importlib.util.find_spec(m) is None]
        if missing:
            parser.error(f"--methods: {method} needs {', '.join(missing)}, which does not "
                         f"import in {sys.executable} (make bench-ship installs it; or leave "
                         f"{method} out)")
    if sum(sizes) + (64 << 20) > POOL:
        parser.error(f"--sizes: {args.sizes}: A's {fmt_size(POOL)} pool holds every size at once")
    # Ray's object stores: the object (and one more while the last is freed) per node.
    store_bytes = 2 * max(sizes) + (256 << 20)
    need = 2 * POOL + (2 * store_bytes if "ray" in methods else 0)
    free = shutil.disk_usage("/dev/shm").free
    if free < need:
        print(f"/dev/shm has {free / 2**30:.1f} GiB free; the daemons' pools"
              f"{' and the Ray object stores' if 'ray' in methods else ''} may take "
              f"{need / 2**30:.1f} GiB", file=sys.stderr)
        return 1

    load_before = os.getloadavg()
    work = pathlib.Path(tempfile.mkdtemp(prefix="tsm-ship-bench-"))
    # The movers' fleet token: a file of this uid, mode 0600, in the 0700 work directory.
    token = work / "mover.token"
    token.touch(mode=0o600)
    token.write_text(secrets.token_urlsafe(32))
    os.environ["TSM_MOVER_TOKEN"] = str(token)
    started: list[tensorshm.Daemon] = []
    clients: list[tensorshm.Client] = []
    results: dict[str, dict[int, list[float]]] = {}
    notes: list[str] = []
    try:
        for node in ("node-a", "node-b"):
            started.append(start_daemon(args.tensorshmd))
            clients.append(tensorshm.connect(started[-1].socket))
        daemons = (started[0], started[1])
        sources = {}
        for size in sizes:
            data = np.frombuffer(np.random.default_rng(size).bytes(size), np.float32)
            clients[0].put(f"ship/{size}", data.reshape(-1, 1024)).release()
            sources[size] = digest(clients[0], f"ship/{size}")
        for method in methods:
            results[method] = measure(method, daemons, clients, sources, runs, store_bytes, notes)
        load_after = os.getloadavg()
    finally:
        for client in clients:
            client.close()
        for daemon in started:
            daemon.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(__doc__.split("\n\n")[0])
    print(f"float32 tensors of random bytes, A's tensorshmd -> B's; median ms of "
          f"{'/'.join(str(runs[s]) for s in sizes)} ships ({', '.join(map(fmt_size, sizes))}) "
          f"after 1 warm-up; SHA-1 of B's tensor checked after every ship")
    baselines = [b for b in BASELINES if b in results]
    header = (f"{'method':<9} {'size':>8} {'ms':>9} {'min ms':>9} {'GB/s':>7}"
              + "".join(f" {'vs ' + b:>8}" for b in baselines) + "   copies between the pools")
    print(header)
    print("-" * len(header))
    for size in sizes:
        medians = {m: statistics.median(results[m][size]) for m in methods}
        for method in methods:
            line = (f"{method:<9} {fmt_size(size):>8} {medians[method] * 1e3:>9.1f} "
                    f"{min(results[method][size]) * 1e3:>9.1f} "
                    f"{size / medians[method] / 1e9:>7.2f}")
            line += "".join(f" {medians[b] / medians[method]:>7.2f}x" for b in baselines)
            print(f"{line}   {METHODS[method][1]}")
    for note in notes:
        print(note)
    if {"nixl-tcp", "ray"} <= set(results) and max(sizes) >= 1 << 30:
        big = max(sizes)
        ratio = statistics.median(results["ray"][big]) / statistics.median(results["nixl-tcp"][big])
        print(f"goal (issue 26): nixl-tcp at least matches ray at {fmt_size(big)}: "
              f"{ratio:.2f}x ray's throughput: {'met' if ratio >= 1 else 'NOT met'}")
    print(f"load average (1, 5, 15 min) on {os.cpu_count()} cores: "
          + ", ".join(f"{x:.2f}" for x in load_before) + " before, "
          + ", ".join(f"{x:.2f}" for x in load_after) + " after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
