"""make soak SECONDS=N: one tensorshmd, mixed load, crashes, restarts; then count what was lost.

For N seconds: two producers put and replace soak tensors (64 B to 16 MiB, every byte derived
from the name and a seed the tensor carries, see pattern.py), a producer running as another uid
(65534, through setpriv, admitted with --allow-uid) does the same under its own names, three
consumers acquire them (at once, waiting with a timeout, several at once, and holding some for
seconds across whatever happens) and check every byte; tensorshmctl status/ls and a /metrics
scrape run every few seconds; one client is SIGKILLed every ~2 s (rotating) and restarted; the
daemon is SIGKILLed and restarted every ~60 s (the second time stopped cleanly with SIGTERM).

Then every client is stopped (SIGTERM: they release and close), and the daemon is checked: no
lease held, no session but the checker's, every tensor it holds is a published name, and the
pool's used bytes are exactly the page-rounded bytes of the published tensors; after deleting
every name, used bytes and tensors are 0. Results go to build/soak/: summary.json, summary.txt
and soak.png (made by report.py), the daemon logs and every client's record. Exit status 1 if
any byte was wrong, any lease or byte leaked, or anything unexpected happened (a client exiting
on its own, a failure outside a daemon restart, a daemon exiting by itself or non-zero on
SIGTERM, a published tensor not served after a restart).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from report import plot, read_records, summarize, text_summary  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NOBODY = 65534
PAGE = 4096
# Tensors the driver publishes once at the start and nobody replaces or deletes: each daemon
# restart (SIGKILL or SIGTERM with --keep-segments) must serve them again, the same tensor, and
# consumers check their bytes with the rest.
SENTINELS = [("s/0", 64), ("s/1", 4097), ("s/2", 1 << 20), ("s/3", 16 << 20)]


def publish_sentinels(socket: str) -> None:
    sys.path.insert(0, str(HERE))
    import pattern
    import tensorshm

    with tensorshm.connect(socket, client_name="soak-driver") as client:
        for name, length in SENTINELS:
            client.put(name, pattern.expected(name, random.getrandbits(64), length)).release()
        client.flush()


def sentinel_ids(args, socket: str) -> dict[str, int]:
    listed = ctl_json(args, socket, "ls")["tensors"]
    names = {name for name, _ in SENTINELS}
    return {t["name"]: t["tensor_id"] for t in listed if t["name"] in names}


def now() -> float:
    return time.time()


class Daemon:
    """The tensorshmd under soak: one socket and shm prefix, restarted as the same daemon."""

    def __init__(self, args, out: pathlib.Path, socket: str, prefix: str) -> None:
        self.args, self.out, self.socket, self.prefix = args, out, socket, prefix
        self.process: subprocess.Popen | None = None
        self.incarnation = 0
        self.metrics_url: str | None = None
        self.started_at = 0.0
        self.lock = threading.Lock()

    def start(self) -> None:
        self.incarnation += 1
        log_path = self.out / "logs" / f"daemon.{self.incarnation}.log"
        log = open(log_path, "w")
        cmd = [self.args.tensorshmd, "--socket", self.socket, "--shm-prefix", self.prefix,
               "--host-pool", self.args.host_pool, "--segment-size", self.args.segment_size,
               "--metrics", "127.0.0.1:0", "--keep-segments", "--log-level", "info"]
        if self.args.other_uid:
            cmd += ["--allow-uid", str(NOBODY)]
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 30
        while True:
            text = log_path.read_text(errors="replace")
            if "serving on" in text:
                break
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"tensorshmd (incarnation {self.incarnation}) did not start:"
                                   f" {text}")
            time.sleep(0.02)
        found = re.search(r"metrics: serving (http://\S+/metrics)", text)
        with self.lock:
            self.process = process
            self.metrics_url = found.group(1) if found else None
            self.started_at = now()

    @property
    def pid(self) -> int | None:
        with self.lock:
            return None if self.process is None else self.process.pid

    def stop(self, sig: int) -> int:
        with self.lock:
            process, self.process = self.process, None
        assert process is not None
        process.send_signal(sig)
        return process.wait(timeout=30)


class Clients:
    """The soak's client processes, each restarted after its SIGKILL."""

    def __init__(self, args, out: pathlib.Path, socket: str, events: list) -> None:
        self.args, self.out, self.socket, self.events = args, out, socket, events
        self.specs: dict[str, list[str]] = {}
        self.as_nobody: set[str] = set()
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = {}
        self.rng = random.Random(args.seed)
        universe = [f"p{i}/t{j}" for i in range(2) for j in range(args.names)]
        if args.other_uid:
            universe += [f"u0/t{j}" for j in range(args.names // 2)]
        universe += [name for name, _ in SENTINELS]
        for i in range(2):
            self.specs[f"p{i}"] = ["producer", "--prefix", f"p{i}", "--names", str(args.names),
                                   "--corrupt-every", str(args.corrupt_every)]
        if args.other_uid:
            self.specs["u0"] = ["producer", "--prefix", "u0", "--names", str(args.names // 2),
                                "--max-bytes", str(args.other_uid_max_bytes)]
            self.as_nobody.add("u0")
        for i in range(3):
            self.specs[f"c{i}"] = ["consumer", "--universe", ",".join(universe)]

    def start(self, cid: str) -> None:
        n = self.starts[cid] = self.starts.get(cid, 0) + 1
        record = self.out / "records" / f"{cid}.{n}.jsonl"
        record.touch()
        cmd = [self.args.python, str(HERE / "soak_client.py"), *self.specs[cid],
               "--socket", self.socket, "--record", str(record), "--id", cid,
               "--seed", str(self.rng.getrandbits(32))]
        env = dict(os.environ)
        if cid in self.as_nobody:
            os.chown(record, NOBODY, NOBODY)
            cmd = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
                   *cmd]
            env["HOME"] = "/tmp"
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        err = open(self.out / "logs" / f"{cid}.{n}.stderr", "w")
        self.procs[cid] = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, env=env)
        err.close()

    def start_all(self) -> None:
        for cid in self.specs:
            self.start(cid)

    def kill(self, cid: str) -> None:
        proc = self.procs[cid]
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        self.events.append({"t": now(), "kind": "client_kill", "client": cid,
                            "incarnation": self.starts[cid]})

    def check_exits(self) -> None:
        """A client that exited without our SIGKILL crashed: record it and start it again."""
        for cid, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                self.events.append({"t": now(), "kind": "client_crash", "client": cid,
                                    "incarnation": self.starts[cid], "code": code,
                                    "stderr": self.stderr_tail(cid)})
                self.start(cid)

    def stderr_tail(self, cid: str) -> str:
        path = self.out / "logs" / f"{cid}.{self.starts[cid]}.stderr"
        return path.read_text(errors="replace")[-600:]

    def _started(self, cid: str) -> bool:
        record = self.out / "records" / f"{cid}.{self.starts[cid]}.jsonl"
        return '"k":"start"' in record.read_text()

    def stop_all(self, timeout: float = 30) -> list[dict]:
        problems = []
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for cid, proc in self.procs.items():
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                code = "hung"
            if code == -signal.SIGTERM and not self._started(cid):
                code = 0  # stopped before its handler was installed: it held nothing yet
            if code != 0:
                problems.append({"t": now(), "kind": "client_bad_stop", "client": cid,
                                 "incarnation": self.starts[cid], "code": code,
                                 "stderr": self.stderr_tail(cid)})
        return problems


class Monitor(threading.Thread):
    """Every `every` seconds: tensorshmctl status and ls, a /metrics scrape; every second: the
    daemon's RSS and open descriptors from /proc."""

    def __init__(self, args, daemon: Daemon, every: float) -> None:
        super().__init__(daemon=True)
        self.args, self.d, self.every = args, daemon, every
        self.samples: list[dict] = []   # /proc
        self.probes: list[dict] = []    # ctl and metrics
        self.pool: list[dict] = []      # ctl status: the pool's used bytes and segments
        self.done = threading.Event()

    def proc_sample(self) -> None:
        pid, inc, started = self.d.pid, self.d.incarnation, self.d.started_at
        if pid is None:
            return
        try:
            status = pathlib.Path(f"/proc/{pid}/status").read_text()
            rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, AttributeError):
            return
        t = now()
        self.samples.append({"t": t, "incarnation": inc, "age": t - started, "rss_kib": rss,
                             "fds": fds})

    def probe(self) -> None:
        for what in ("status", "ls"):
            t = now()
            r = subprocess.run([self.args.ctl, "--socket", self.d.socket, "--timeout", "3",
                                what, "-o", "json"], capture_output=True, text=True, timeout=20)
            ok = r.returncode == 0
            if ok:
                try:
                    json.loads(r.stdout)
                except ValueError:
                    ok = False
            self.probes.append({"t": t, "what": f"ctl {what}", "ok": ok,
                                "msg": "" if ok else (r.stderr or r.stdout)[-300:]})
            if ok and what == "status":
                pool = json.loads(r.stdout)["pools"][0]
                self.pool.append({"t": t, "used_bytes": pool["used_bytes"],
                                  "segments": pool.get("segments", 0)})
        url = self.d.metrics_url
        t = now()
        try:
            if url is None:
                raise OSError("no metrics address in the daemon's log")
            with urllib.request.urlopen(url, timeout=3) as response:
                body = response.read().decode()
            ok = "tensorshm_leases" in body
            msg = "" if ok else "no tensorshm_leases in the scrape"
        except OSError as e:
            ok, msg = False, str(e)
        self.probes.append({"t": t, "what": "metrics", "ok": ok, "msg": msg[-300:]})

    def run(self) -> None:
        next_probe = time.monotonic()
        while not self.done.is_set():
            self.proc_sample()
            if time.monotonic() >= next_probe:
                self.probe()
                next_probe = time.monotonic() + self.every
            self.done.wait(1.0)


def ctl_json(args, socket: str, *what: str) -> dict:
    r = subprocess.run([args.ctl, "--socket", socket, "--timeout", "5", *what, "-o", "json"],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"tensorshmctl {' '.join(what)}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def final_check(args, socket: str) -> dict:
    """After every client is gone: the daemon holds exactly its published tensors.

    leases: 0; sessions: 1 (tensorshmctl's own); tensors == names (nothing unpublished, nothing
    unbound but leased, nothing stocked); used_bytes == the published tensors' bytes, each
    rounded up to a 4 KiB page (host buffers are page-rounded); stock_bytes 0. A restart's
    recovery grace (unbound but leased tensors kept for reconnecting clients, 10 s) may hold
    memory for a while, so this is polled for up to 30 s and the last reading is reported.
    Then every name is deleted and the pool must come back to 0 used bytes and 0 tensors."""
    deadline = time.monotonic() + 30
    while True:
        status = ctl_json(args, socket, "status")
        listed = ctl_json(args, socket, "ls")["tensors"]
        pool = status["pools"][0]
        published = sum((int(t["nbytes"]) + PAGE - 1) // PAGE * PAGE for t in listed)
        result = {
            "leases": status["leases"], "sessions": status["sessions"],
            "tensors": status["tensors"], "names": status["names"],
            "stocked_tensors": status.get("stocked_tensors", 0),
            "used_bytes": pool["used_bytes"], "stock_bytes": pool.get("stock_bytes", 0),
            "published_bytes": published, "published_tensors": len(listed),
            "segments": pool.get("segments"),
        }
        result["leaked_leases"] = result["leases"]
        result["leaked_bytes"] = result["used_bytes"] - published + result["stock_bytes"]
        result["leaked_tensors"] = result["tensors"] - result["names"]
        clean = (result["leaked_leases"] == 0 and result["leaked_bytes"] == 0
                 and result["leaked_tensors"] == 0 and result["sessions"] == 1)
        if clean or time.monotonic() > deadline:
            break
        time.sleep(1)
    result["settled"] = clean
    for t in listed:
        subprocess.run([args.ctl, "--socket", socket, "rm", t["name"]], capture_output=True,
                       timeout=30)
    deadline = time.monotonic() + 10
    while True:
        status = ctl_json(args, socket, "status")
        empty = {"used_bytes": status["pools"][0]["used_bytes"], "tensors": status["tensors"],
                 "leases": status["leases"], "names": status["names"]}
        if not any(empty.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    result["after_deleting_all"] = empty
    result["leaked_bytes_after_delete"] = empty["used_bytes"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=120, help="how long the load runs")
    parser.add_argument("--out", default=str(ROOT / "build" / "soak"),
                        help="results directory (emptied first)")
    parser.add_argument("--tensorshmd", default=str(ROOT / "build" / "tensorshmd"))
    parser.add_argument("--ctl", default=str(ROOT / "build" / "tensorshmctl"))
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--host-pool", default="512Mi")
    parser.add_argument("--segment-size", default="64Mi")
    parser.add_argument("--names", type=int, default=8, help="names per producer")
    parser.add_argument("--other-uid-max-bytes", type=int, default=1 << 20,
                        help="largest tensor of uid 65534's producer")
    parser.add_argument("--kill-every", type=float, default=2.0,
                        help="seconds between client SIGKILLs (jittered 25%%)")
    parser.add_argument("--restart-every", type=float, default=60.0,
                        help="seconds between daemon restarts (at most a third of --seconds)")
    parser.add_argument("--probe-every", type=float, default=3.0,
                        help="seconds between tensorshmctl status/ls and /metrics probes")
    parser.add_argument("--seed", type=int, default=None,
                        help="seeds the clients' choices (default: random, printed)")
    parser.add_argument("--corrupt-every", type=int, default=0,
                        help="self-test of the checks: the two producers flip one byte of every "
                        "Nth tensor they put, so the run must fail with wrong bytes")
    args = parser.parse_args()
    if args.seed is None:
        args.seed = random.SystemRandom().getrandbits(31)
    args.other_uid = os.geteuid() == 0 and shutil.which("setpriv") is not None
    # Short runs (CI's 120 s) still see both kinds of daemon restart.
    args.restart_every = min(args.restart_every, args.seconds / 3)

    out = pathlib.Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    (out / "records").mkdir(parents=True)
    (out / "logs").mkdir()
    os.chmod(out / "records", 0o755)
    # The socket's directory: short (sun_path), and reachable by uid 65534 (0755, root's).
    sock_dir = pathlib.Path(f"/tmp/tsm-soak-{os.getpid()}")
    shutil.rmtree(sock_dir, ignore_errors=True)
    sock_dir.mkdir(mode=0o755)
    os.chmod(sock_dir, 0o755)
    socket = str(sock_dir / "tensorshm.sock")
    prefix = f"tsmsoak-{os.getpid()}"
    for leftover in pathlib.Path("/dev/shm").glob(prefix + ".*"):
        leftover.unlink()
    print(f"soak: {args.seconds:.0f} s, seed {args.seed}, socket {socket}, prefix {prefix}, "
          f"other uid: {NOBODY if args.other_uid else 'skipped (needs root and setpriv)'}; "
          f"results in {out}", flush=True)

    events: list[dict] = []
    restarts: list[dict] = []
    daemon_exit_codes: list[int] = []
    daemon = Daemon(args, out, socket, prefix)
    clients = Clients(args, out, socket, events)
    monitor = Monitor(args, daemon, args.probe_every)
    t0 = now()
    daemon.start()
    publish_sentinels(socket)
    sentinels = sentinel_ids(args, socket)
    monitor.start()
    clients.start_all()
    order = list(clients.specs)
    next_kill = time.monotonic() + args.kill_every
    next_restart = time.monotonic() + args.restart_every
    deadline = time.monotonic() + args.seconds
    kill_index = 0
    try:
        while time.monotonic() < deadline:
            clients.check_exits()
            if time.monotonic() >= next_kill:
                cid = order[kill_index % len(order)]
                kill_index += 1
                clients.kill(cid)
                clients.start(cid)
                next_kill += args.kill_every * random.uniform(0.75, 1.25)
            if daemon.process is not None and daemon.process.poll() is not None:
                # Exited by itself: a crash. Counted, and restarted so the run goes on.
                down = now()
                code = daemon.stop(signal.SIGKILL)
                events.append({"t": down, "kind": "daemon_crash", "code": code,
                               "incarnation": daemon.incarnation})
                daemon.start()
                restarts.append({"down": down, "up": now(), "signal": "crash",
                                 "exit_code": code})
                print(f"soak: t={down - t0:.0f} s the daemon exited by itself ({code}); "
                      "restarted", flush=True)
            if time.monotonic() >= next_restart and deadline - time.monotonic() > 10:
                clean = len(restarts) == 1
                sig = signal.SIGTERM if clean else signal.SIGKILL
                down = now()
                code = daemon.stop(sig)
                daemon_exit_codes.append(code)
                if clean and code != 0:
                    events.append({"t": now(), "kind": "daemon_bad_exit", "code": code})
                daemon.start()
                restarts.append({"down": down, "up": now(), "signal": sig.name,
                                 "exit_code": code})
                try:
                    served = sentinel_ids(args, socket)
                except RuntimeError as e:
                    served = {"error": str(e)}
                if served != sentinels:
                    events.append({"t": now(), "kind": "published_tensor_lost",
                                   "before": sentinels, "after": served})
                print(f"soak: t={down - t0:.0f} s daemon {sig.name} -> exit {code}, restarted "
                      f"in {now() - down:.2f} s", flush=True)
                next_restart += args.restart_every
            time.sleep(0.1)
        print(f"soak: t={now() - t0:.0f} s stopping clients", flush=True)
        # Samples stop with the load: an idle daemon's fds are not its loaded ones.
        monitor.done.set()
        monitor.join()
        events.extend(clients.stop_all())
        served = sentinel_ids(args, socket)
        if served != sentinels:
            events.append({"t": now(), "kind": "published_tensor_lost", "before": sentinels,
                           "after": served})
        final = final_check(args, socket)
        pid = daemon.pid
        final_rss = None
        try:
            status = pathlib.Path(f"/proc/{pid}/status").read_text()
            final_rss = {"rss_kib": int(re.search(r"VmRSS:\s+(\d+)", status).group(1)),
                         "fds": len(os.listdir(f"/proc/{pid}/fd"))}
        except (OSError, AttributeError):
            pass
        code = daemon.stop(signal.SIGTERM)
        daemon_exit_codes.append(code)
        if code != 0:
            events.append({"t": now(), "kind": "daemon_bad_exit", "code": code})
    finally:
        for proc in clients.procs.values():
            if proc.poll() is None:
                proc.kill()
        if daemon.process is not None and daemon.process.poll() is None:
            daemon.process.kill()
        for leftover in pathlib.Path("/dev/shm").glob(prefix + ".*"):
            leftover.unlink()
        shutil.rmtree(sock_dir, ignore_errors=True)
    t_end = now()

    rows = read_records(out)
    summary = summarize(args, t0, t_end, rows, events, restarts, monitor, final,
                        daemon_exit_codes, final_rss)
    summary["client_starts"] = sum(clients.starts.values())
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = text_summary(summary)
    (out / "summary.txt").write_text(text)
    (out / "samples.json").write_text(json.dumps(
        {"t0": t0, "proc": monitor.samples, "probes": monitor.probes, "pool": monitor.pool,
         "events": events,
         "restarts": restarts}) + "\n")
    try:
        plot(summary, t0, monitor, events, restarts, out / "soak.png")
    except Exception as e:  # noqa: BLE001 - the plot is a report, not a verdict
        print(f"soak: no plot: {type(e).__name__}: {e}", file=sys.stderr)
    print(text, end="")
    print(f"soak: {out}/summary.txt, summary.json, soak.png")
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
