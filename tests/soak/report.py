"""The soak's results: client records and the driver's samples read back, summed up and
checked (summary.json, summary.txt), and plotted (soak.png). Used by soak.py."""

from __future__ import annotations

import glob
import json
import pathlib

NOBODY = 65534

# A client call failing within this many seconds after a daemon restart finished (or while it
# was down) is put down to the restart: the client library reconnects on its own, with backoff.
RESTART_GRACE_S = 10.0
# The failures a daemon restart explains: the session is gone or the socket does not answer.
RESTART_ERRORS = {"ConnectionError", "FailedPreconditionError", "DataLossError",
                  "CancelledError", "ctl", "metrics"}


def percentile(values: list[int], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, int(round(q * (len(values) - 1)))))
    return values[k]


def read_records(out: pathlib.Path) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(str(out / "records" / "*.jsonl"))):
        cid, inc = pathlib.Path(path).name.split(".")[:2]
        for line in open(path):
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by a SIGKILL mid-write (one write() makes this rare)
            row["client"], row["client_incarnation"] = cid, int(inc)
            rows.append(row)
    return rows


def in_restart(t: float, restarts: list[dict]) -> bool:
    return any(r["down"] - 0.5 <= t <= r["up"] + RESTART_GRACE_S for r in restarts)


def summarize(args, t0: float, t_end: float, rows, events, restarts, monitor, final,
              daemon_exit_codes, final_rss) -> dict:
    counters: dict[str, int] = {}
    lat_by_minute: dict[str, dict[int, list[int]]] = {}
    lat_by_10s: dict[str, dict[int, list[int]]] = {}
    restart_failures: dict[str, int] = {}
    unexpected: list[dict] = []
    wrong: list[dict] = []
    lost: list[dict] = []
    leases_lost: dict[str, int] = {}
    by_client: dict[str, dict[str, int]] = {}
    for row in rows:
        kind = row.get("k")
        if kind == "win":
            mine = by_client.setdefault(row["client"], {})
            for key, value in row["n"].items():
                counters[key] = counters.get(key, 0) + value
                mine[key] = mine.get(key, 0) + value
            for op, values in row["lat"].items():
                lat_by_minute.setdefault(op, {}).setdefault(int((row["t"] - t0) // 60), []) \
                    .extend(values)
                lat_by_10s.setdefault(op, {}).setdefault(int((row["t"] - t0) // 10) * 10, []) \
                    .extend(values)
        elif kind == "err":
            if row["type"] in RESTART_ERRORS and in_restart(row["t"], restarts):
                key = f"{row['op']}:{row['type']}"
                restart_failures[key] = restart_failures.get(key, 0) + 1
            else:
                unexpected.append({"what": "client call failed outside a daemon restart",
                                   **{k: row[k] for k in ("t", "client", "client_incarnation",
                                                          "op", "type", "msg")}})
        elif kind == "wrong":
            wrong.append(row)
        elif kind == "lost":
            lost.append(row)
        elif kind == "lease_lost":
            who = "other_uid" if row["name"].startswith("u0/") else "own_uid"
            before = [r for r in restarts if r["down"] <= row["t"]]
            after = before[-1]["signal"] if before else "no_restart"
            key = f"{who}_after_{after}"
            leases_lost[key] = leases_lost.get(key, 0) + 1
    for probe in monitor.probes:
        if probe["ok"]:
            continue
        if in_restart(probe["t"], restarts):
            key = f"{probe['what']}"
            restart_failures[key] = restart_failures.get(key, 0) + 1
        else:
            unexpected.append({"what": f"{probe['what']} failed outside a daemon restart",
                               "t": probe["t"], "msg": probe["msg"]})
    for event in events:
        if event["kind"] in ("client_crash", "client_bad_stop", "daemon_bad_exit",
                             "daemon_crash", "published_tensor_lost"):
            unexpected.append({"what": event["kind"], **event})

    def pct(table, unit):
        out = {}
        for op, buckets in sorted(table.items()):
            out[op] = [{unit: m, "count": len(v), "p50_ms": percentile(v, 0.5) / 1e3,
                        "p99_ms": percentile(v, 0.99) / 1e3} for m, v in sorted(buckets.items())]
        return out

    # The daemon's memory and descriptors, per incarnation: at start (first sample), at one
    # minute of age (the first sample at or after it, when the incarnation lived that long),
    # and at its end (the last sample before it was stopped).
    # ("One minute" is 90% of the restart interval when that is shorter, so that incarnations
    # restarted every 60 s still have it.)
    minute_age = min(60.0, 0.9 * args.restart_every)
    incarnations = []
    for inc in sorted({s["incarnation"] for s in monitor.samples}):
        ss = [s for s in monitor.samples if s["incarnation"] == inc]
        minute = next((s for s in ss if s["age"] >= minute_age), None)
        incarnations.append({
            "incarnation": inc, "lived_s": round(ss[-1]["age"], 1),
            "start": {"rss_kib": ss[0]["rss_kib"], "fds": ss[0]["fds"]},
            "first_minute": None if minute is None else
            {"rss_kib": minute["rss_kib"], "fds": minute["fds"]},
            "end": {"rss_kib": ss[-1]["rss_kib"], "fds": ss[-1]["fds"]},
            "max_rss_kib": max(s["rss_kib"] for s in ss), "max_fds": max(s["fds"] for s in ss),
        })
    # Across incarnations, at the same age: what a leak that outlives restarts (shared memory,
    # the catalog, segments a recovered daemon inherits) would show.
    age = min(50.0, args.restart_every * 0.8)
    at_age = []
    for inc in incarnations:
        ss = [s for s in monitor.samples if s["incarnation"] == inc["incarnation"]]
        s = next((s for s in ss if s["age"] >= age), None)
        if s is not None:
            at_age.append({"incarnation": inc["incarnation"], "rss_kib": s["rss_kib"],
                           "fds": s["fds"]})

    # Drift: the last incarnation against the first one that started after the first minute
    # (the first incarnation starts on an empty pool and maps less), at the same age.
    drift = None
    if at_age:
        base = at_age[1] if len(at_age) > 1 else at_age[0]
        last = at_age[-1]
        drift = {"baseline_incarnation": base["incarnation"],
                 "last_incarnation": last["incarnation"],
                 "rss_pct": round(100.0 * (last["rss_kib"] - base["rss_kib"]) / base["rss_kib"], 1),
                 "fds_pct": round(100.0 * (last["fds"] - base["fds"]) / base["fds"], 1),
                 "max_rss_pct": round(max(100.0 * (a["rss_kib"] - base["rss_kib"]) /
                                          base["rss_kib"] for a in at_age), 1),
                 "max_fds_pct": round(max(100.0 * (a["fds"] - base["fds"]) / base["fds"]
                                          for a in at_age), 1)}

    # A soak that checked nothing passes nothing.
    for what in ("checked", "put", "create_publish"):
        if counters.get(what, 0) == 0:
            unexpected.append({"what": f"no {what} in the whole run", "t": t_end})
    if args.other_uid and by_client.get("u0", {}).get("put", 0) == 0:
        unexpected.append({"what": f"uid {NOBODY}'s producer put nothing", "t": t_end})
    # From the records written at once (a window's counters die with a SIGKILLed client).
    wrong_bytes = sum(w.get("wrong", w.get("nbytes", 0)) for w in wrong)
    leaks = (final["leaked_leases"] != 0 or final["leaked_bytes"] != 0 or
             final["leaked_tensors"] != 0 or final["leaked_bytes_after_delete"] != 0)
    summary = {
        "seconds": args.seconds, "wall_s": round(t_end - t0, 1), "seed": args.seed,
        "host_pool": args.host_pool, "segment_size": args.segment_size,
        "other_uid": NOBODY if args.other_uid else None,
        "pass": wrong_bytes == 0 and not wrong and not leaks and not unexpected,
        "wrong_bytes": wrong_bytes, "wrong_tensors": len(wrong), "wrong": wrong[:20],
        "checked_tensors": counters.get("checked", 0),
        "checked_bytes": counters.get("bytes_checked", 0),
        "leaks": final,
        "unexpected": unexpected[:50], "unexpected_count": len(unexpected),
        "restart_failures": restart_failures,
        "restart_failures_total": sum(restart_failures.values()),
        "leases_lost_in_restarts": sum(leases_lost.values()),
        "leases_lost_by_owner": leases_lost,
        "changed_after_lease_lost": len(lost),
        "counters": counters,
        "counters_by_client": by_client,
        "client_kills": sum(1 for e in events if e["kind"] == "client_kill"),
        "daemon_restarts": [{"at_s": round(r["down"] - t0, 1), "signal": r["signal"],
                             "exit_code": r["exit_code"], "down_s": round(r["up"] - r["down"], 2)}
                            for r in restarts],
        "daemon_final_exit_code": daemon_exit_codes[-1] if daemon_exit_codes else None,
        "pool_max_used_bytes": max((p["used_bytes"] for p in monitor.pool), default=None),
        "pool_max_segments": max((p["segments"] for p in monitor.pool), default=None),
        "daemon_minute_age_s": minute_age,
        "daemon_incarnations": incarnations,
        "daemon_at_same_age": {"age_s": age, "samples": at_age, "drift": drift},
        "daemon_final_idle": final_rss,
        "latency_per_minute": pct(lat_by_minute, "minute"),
        "latency_per_10s": pct(lat_by_10s, "from_s"),
    }
    return summary


def text_summary(s: dict) -> str:
    lines = [f"tensorshm soak: {s['seconds']} s (wall {s['wall_s']} s), seed {s['seed']}: "
             + ("PASS" if s["pass"] else "FAIL")]
    lines.append(f"  checked {s['checked_tensors']} tensors, {s['checked_bytes'] / 2**30:.2f} GiB"
                 f"; wrong bytes {s['wrong_bytes']} in {s['wrong_tensors']} tensors")
    c = s["counters"]
    lines.append(f"  puts {c.get('put', 0)}, create+publish {c.get('create_publish', 0)}, "
                 f"deletes {c.get('deleted', 0)}, {c.get('bytes_put', 0) / 2**30:.2f} GiB put; "
                 f"gets {c.get('get', 0)} (misses {c.get('miss', 0)}), waiting gets "
                 f"{c.get('get_wait', 0)} (timed out {c.get('wait_timeout', 0)}), get_many "
                 f"{c.get('get_many', 0)}, held {c.get('get_hold', 0)}")
    lk = s["leaks"]
    lines.append(f"  after the end: leases {lk['leases']}, sessions {lk['sessions']} (ctl's own), "
                 f"tensors {lk['tensors']} for {lk['names']} names, used {lk['used_bytes']} B "
                 f"vs published {lk['published_bytes']} B (stock {lk['stock_bytes']} B): leaked "
                 f"leases {lk['leaked_leases']}, bytes {lk['leaked_bytes']}, tensors "
                 f"{lk['leaked_tensors']}; after deleting every name: "
                 f"{lk['after_deleting_all']}")
    if s["pool_max_used_bytes"] is not None:
        lines.append(f"  pool: at most {s['pool_max_used_bytes'] / 2**20:.1f} MiB used, "
                     f"{s['pool_max_segments']} segments ({s['host_pool']} pool, "
                     f"{s['segment_size']} segments)")
    lines.append(f"  client SIGKILLs {s['client_kills']}; daemon restarts "
                 + ", ".join(f"{r['signal']}@{r['at_s']}s (down {r['down_s']} s)"
                             for r in s["daemon_restarts"])
                 + f"; final daemon exit {s['daemon_final_exit_code']}")
    lines.append(f"  failed calls during daemon restarts (retried): "
                 f"{s['restart_failures_total']} {s['restart_failures']}")
    lines.append(f"  held leases the restarted daemon did not take back: "
                 f"{s['leases_lost_in_restarts']} {s['leases_lost_by_owner']} (another uid's "
                 f"tensors live in memfd segments and end with a daemon); bytes changed under a "
                 f"lost lease: {s['changed_after_lease_lost']}")
    lines.append(f"  unexpected: {s['unexpected_count']}")
    for u in s["unexpected"][:10]:
        lines.append(f"    {json.dumps(u)[:300]}")
    for w in s["wrong"][:10]:
        lines.append(f"    wrong: {json.dumps(w)[:300]}")
    lines.append(f"  daemon per incarnation (RSS MiB / fds): start, at {s['daemon_minute_age_s']:.0f} s,"
                 " end")
    for inc in s["daemon_incarnations"]:
        fm = inc["first_minute"]
        lines.append(f"    #{inc['incarnation']} lived {inc['lived_s']} s: "
                     f"{inc['start']['rss_kib'] / 1024:.1f}/{inc['start']['fds']}, "
                     + (f"{fm['rss_kib'] / 1024:.1f}/{fm['fds']}" if fm else "-") +
                     f", {inc['end']['rss_kib'] / 1024:.1f}/{inc['end']['fds']}")
    if s["daemon_final_idle"]:
        f = s["daemon_final_idle"]
        lines.append(f"    final daemon, idle after the end: {f['rss_kib'] / 1024:.1f} MiB, "
                     f"{f['fds']} fds")
    same = s["daemon_at_same_age"]["samples"]
    if same:
        lines.append(f"  at age {s['daemon_at_same_age']['age_s']:.0f} s, each incarnation "
                     "(RSS MiB/fds): " + ", ".join(f"#{a['incarnation']} "
                                                   f"{a['rss_kib'] / 1024:.1f}/{a['fds']}"
                                                   for a in same[:30])
                     + (" ..." if len(same) > 30 else ""))
        d = s["daemon_at_same_age"]["drift"]
        lines.append(f"  drift, #{d['last_incarnation']} vs #{d['baseline_incarnation']} at that "
                     f"age: RSS {d['rss_pct']:+.1f}% (max {d['max_rss_pct']:+.1f}%), fds "
                     f"{d['fds_pct']:+.1f}% (max {d['max_fds_pct']:+.1f}%)")
    lines.append("  latency per minute (ms, p50/p99):")
    for op, rows in s["latency_per_minute"].items():
        lines.append(f"    {op:15s} " + "  ".join(
            f"m{r['minute']}: {r['p50_ms']:.2f}/{r['p99_ms']:.2f} (n={r['count']})" for r in rows))
    return "\n".join(lines) + "\n"


def plot(s: dict, t0: float, monitor, events: list, restarts: list,
         path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lat, ax_rss, ax_fd) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    for op, rows in s["latency_per_10s"].items():
        if op not in ("put", "get", "create_publish"):
            continue
        xs = [r["from_s"] + 5 for r in rows]
        ax_lat.plot(xs, [r["p50_ms"] for r in rows], label=f"{op} p50")
        ax_lat.plot(xs, [r["p99_ms"] for r in rows], linestyle="--", label=f"{op} p99")
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("latency (ms, 10 s buckets)")
    ax_lat.legend(fontsize=7, ncol=3, loc="upper left")
    for inc in sorted({x["incarnation"] for x in monitor.samples}):
        ss = [x for x in monitor.samples if x["incarnation"] == inc]
        ax_rss.plot([x["t"] - t0 for x in ss], [x["rss_kib"] / 1024 for x in ss], color="C0")
        ax_fd.plot([x["t"] - t0 for x in ss], [x["fds"] for x in ss], color="C1")
    ax_rss.set_ylabel("daemon RSS (MiB)")
    pool = getattr(monitor, "pool", [])
    if pool:
        ax_pool = ax_rss.twinx()
        ax_pool.plot([p["t"] - t0 for p in pool], [p["used_bytes"] / 2**20 for p in pool],
                     color="gray", alpha=0.5, linewidth=1)
        ax_pool.set_ylabel("pool used (MiB, gray)")
    ax_fd.set_ylabel("daemon open fds")
    ax_fd.set_xlabel("seconds since start")
    for r in restarts:
        for ax in (ax_lat, ax_rss, ax_fd):
            ax.axvline(r["down"] - t0, color="red" if r["signal"] == "SIGKILL" else "green",
                       linewidth=1, alpha=0.7)
    kills = [e["t"] - t0 for e in events if e["kind"] == "client_kill"]
    ax_fd.plot(kills, [0] * len(kills), "|", color="gray", markersize=8)
    fig.suptitle(f"tensorshm soak, {s['seconds']} s: "
                 f"{'PASS' if s['pass'] else 'FAIL'}; red: daemon SIGKILL, green: SIGTERM, "
                 "ticks: client SIGKILLs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
