"""One soak client process: a producer or a consumer of soak tensors (see pattern.py).

    soak_client.py producer --socket S --record FILE --id p0 --prefix p0 --names 8
    soak_client.py consumer --socket S --record FILE --id c0 --universe p0/t0,p0/t1,...

It runs until SIGTERM (then releases what it holds, closes its client and exits 0) or until the
soak driver SIGKILLs it. Everything it sees goes to its record file as JSON lines, written with
one write() each so that a SIGKILL loses at most the current second's latencies:
  {"k": "start", ...}                      once
  {"k": "win", "t", "lat": {op: [us]}, "n": {counter: delta}}   about every second
  {"k": "err", "t", "op", "type", "msg"}    a failed call (retried, unless it was a check)
  {"k": "wrong", "t", "name", "detail"}     a tensor whose bytes are not what its name says
  {"k": "end", "t"}                         a clean exit
Failed calls are retried: the driver decides afterwards which failures fell in a daemon restart
(expected: the client library reconnects by itself) and which are unexpected.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pattern  # noqa: E402

import tensorshm  # noqa: E402

# A call that keeps failing is given up (the client exits 1, which the driver counts as a crash)
# after failing for this long; each failure is recorded.
GIVE_UP_S = 30.0
RETRY_SLEEP = 0.05


class Record:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.lat: dict[str, list[int]] = {}
        self.n: dict[str, int] = {}
        self.last_flush = time.monotonic()

    def write(self, **fields) -> None:
        fields["t"] = time.time()
        os.write(self.fd, (json.dumps(fields, separators=(",", ":")) + "\n").encode())

    def count(self, what: str, by: int = 1) -> None:
        self.n[what] = self.n.get(what, 0) + by

    def latency(self, op: str, seconds: float) -> None:
        self.lat.setdefault(op, []).append(int(seconds * 1e6))

    def tick(self, force: bool = False) -> None:
        if force or time.monotonic() - self.last_flush >= 1.0:
            if self.lat or self.n:
                self.write(k="win", lat=self.lat, n=self.n)
            self.lat, self.n = {}, {}
            self.last_flush = time.monotonic()


stopping = False


def _on_term(signum, frame) -> None:  # noqa: ARG001
    global stopping
    stopping = True


def call(rec: Record, op: str, fn, *, quiet=()):
    """fn() retried while it raises a tensorshm.Error other than those in `quiet` (which are
    answers, not failures, and are raised to the caller). Each failure is recorded."""
    give_up = time.monotonic() + GIVE_UP_S
    while time.monotonic() < give_up:
        try:
            return fn()
        except quiet:
            raise
        except tensorshm.Error as e:
            rec.write(k="err", op=op, type=type(e).__name__, msg=str(e)[:400])
            rec.count(f"{op}_failed")
            if stopping:
                raise
            time.sleep(RETRY_SLEEP)
    rec.write(k="err", op=op, type="GaveUp", msg=f"{op}: failed for {GIVE_UP_S:.0f} s")
    raise RuntimeError(f"{op}: failed for {GIVE_UP_S:.0f} s")


def connect(rec: Record, args) -> tensorshm.Client:
    kwargs = {}
    if args.server_uid is not None:
        kwargs["server_uid"] = args.server_uid
    return call(rec, "connect",
                lambda: tensorshm.connect(args.socket, client_name=args.id, timeout=2, **kwargs))


def log_uniform_size(rng: random.Random, max_bytes: int) -> int:
    return int(math.exp(rng.uniform(math.log(pattern.MIN_BYTES), math.log(max_bytes))))


def producer(rec: Record, client: tensorshm.Client, args, rng: random.Random) -> None:
    names = [f"{args.prefix}/t{i}" for i in range(args.names)]
    puts = 0
    while not stopping:
        name = rng.choice(names)
        r = rng.random()
        if r < 0.04:
            try:
                call(rec, "delete", lambda: client.delete(name), quiet=(tensorshm.NotFoundError,))
                rec.count("deleted")
            except tensorshm.NotFoundError:
                rec.count("delete_absent")
            continue
        length = log_uniform_size(rng, args.max_bytes)
        data = pattern.expected(name, rng.getrandbits(64), length)
        puts += 1
        if args.corrupt_every and puts % args.corrupt_every == 0:
            data = data.copy()
            data[rng.randrange(pattern.HEADER_BYTES, length)] ^= 0x10  # the soak's self-test
        if r < 0.52:
            def put():
                start = time.perf_counter()
                t = client.put(name, data, replace=True, timeout=10)
                rec.latency("put", time.perf_counter() - start)
                t.release()
            call(rec, "put", put)
            rec.count("put")
        else:
            # In place: create, fill through the writable mapping, publish.
            def create_publish():
                start = time.perf_counter()
                w = client.create((length,), "uint8", timeout=10)
                np.copyto(tensorshm.to_numpy(w), data)
                w.publish(name, replace=True)
                rec.latency("create_publish", time.perf_counter() - start)
                w.release()
            call(rec, "create_publish", create_publish)
            rec.count("create_publish")
        rec.count("bytes_put", length)
        rec.tick()
        time.sleep(rng.uniform(0, args.pause))


def verify(rec: Record, t: tensorshm.Tensor, name: str, when: str) -> None:
    bad = pattern.check(name, np.from_dlpack(t))
    rec.count("checked")
    rec.count("bytes_checked", t.nbytes)
    if bad is None:
        return
    wrong, detail = bad
    if not t.alive:
        # The restarted daemon did not take this lease back and said so (DataLossError on
        # flush, alive False): its memory may have been reused. Not a wrong byte.
        rec.count("changed_after_lease_lost")
        rec.write(k="lost", name=name, when=when, detail=detail)
        return
    rec.count("wrong_tensors")
    rec.count("wrong_bytes", wrong)
    rec.write(k="wrong", name=name, when=when, nbytes=t.nbytes, wrong=wrong, detail=detail)


def consumer(rec: Record, client: tensorshm.Client, args, rng: random.Random) -> None:
    universe = args.universe.split(",")
    held: list[tuple[tensorshm.Tensor, str, float]] = []
    answers = (tensorshm.NotFoundError, tensorshm.TimeoutError)
    while not stopping:
        now = time.monotonic()
        for item in [h for h in held if h[2] <= now]:
            held.remove(item)
            t, name, _ = item
            if t.alive:
                verify(rec, t, name, "held")
            else:
                rec.count("held_lease_lost")
                rec.write(k="lease_lost", name=name)
            t.release()
        r = rng.random()
        name = rng.choice(universe)
        try:
            if r < 0.45:
                def get_now():
                    start = time.perf_counter()
                    t = client.get(name, timeout=0)
                    rec.latency("get", time.perf_counter() - start)
                    return t
                t = call(rec, "get", get_now, quiet=answers)
                with t:
                    verify(rec, t, name, "get")
                rec.count("get")
            elif r < 0.75:
                timeout = rng.uniform(0.05, 1.0)
                t = call(rec, "get_wait", lambda: client.get(name, timeout=timeout), quiet=answers)
                with t:
                    verify(rec, t, name, "get_wait")
                rec.count("get_wait")
            elif r < 0.87:
                names = rng.sample(universe, 3)
                got = call(rec, "get_many", lambda: client.get_many(names, timeout=0.5),
                           quiet=answers)
                for n, t in zip(names, got):
                    with t:
                        verify(rec, t, n, "get_many")
                rec.count("get_many")
            elif len(held) < 4:
                t = call(rec, "get_hold", lambda: client.get(name, timeout=0), quiet=answers)
                verify(rec, t, name, "get_hold")
                held.append((t, name, time.monotonic() + rng.uniform(1, 8)))
                rec.count("get_hold")
        except tensorshm.NotFoundError:
            rec.count("miss")
        except tensorshm.TimeoutError:
            rec.count("wait_timeout")
        rec.tick()
        time.sleep(rng.uniform(0, args.pause))
    for t, name, _ in held:
        if t.alive:
            verify(rec, t, name, "held")
        t.release()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("producer", "consumer"))
    parser.add_argument("--socket", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--id", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix", default="p")
    parser.add_argument("--names", type=int, default=8)
    parser.add_argument("--max-bytes", type=int, default=pattern.MAX_BYTES)
    parser.add_argument("--universe", default="")
    parser.add_argument("--pause", type=float, default=0.02, help="most seconds between ops")
    parser.add_argument("--server-uid", type=int, default=None)
    parser.add_argument("--corrupt-every", type=int, default=0,
                        help="self-test: flip one byte of every Nth tensor put (0: never)")
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, _on_term)
    rec = Record(args.record)
    rec.write(k="start", id=args.id, role=args.role, pid=os.getpid(), uid=os.getuid(),
              seed=args.seed)
    rng = random.Random(args.seed)
    client = connect(rec, args)
    try:
        (producer if args.role == "producer" else consumer)(rec, client, args, rng)
    except (tensorshm.Error, RuntimeError):
        if not stopping:
            raise  # a crash: the driver counts a non-zero exit it did not cause
    rec.tick(force=True)
    try:
        client.flush()
    except tensorshm.Error as e:
        rec.write(k="err", op="flush", type=type(e).__name__, msg=str(e)[:400])
    client.close()
    rec.write(k="end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
