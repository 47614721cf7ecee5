#!/usr/bin/env python3
"""The wheels against each other: bench/py_handoff.py's 4 KiB producer -> consumer handoff through
tensorshm and its warm get + np.from_dlpack + release, run with each wheel installed in a venv of
its Python, in turns, on the same machine; prints the medians and each wheel's ratio to the
first (cp311).

    python bench/py_wheels.py [--rounds 9] [--instructions] [WHEEL=PYTHON ...]

Default: dist/'s cp311-cp311 wheel with Python 3.11 and its cp312-abi3 wheel with Python 3.12
(make wheels), plus build-wheel/full-api/'s cp312-cp312 wheel with Python 3.12 when there is one
(WHEEL_PY_API= WHEEL_DIST=build-wheel/full-api bash scripts/build-wheels.sh 3.12): the same
interpreter with and without the limited API, which is what the stable ABI costs. Each venv
(build-wheel/bench/<wheel>) is made once, with the wheel and numpy; each wheel's own tensorshmd
serves its rounds. A round runs every wheel once, in turn; the figures are medians over rounds.

--instructions adds what timings on a noisy machine cannot settle: the instructions one warm
get + np.from_dlpack + release executes with each wheel, counted by valgrind's callgrind (the
difference between 2,000 and 12,000 gets, over 10,000), the same on every run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import re
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
HANDOFFS = 200
GETS = 20000


def child() -> int:
    """In a wheel's venv: one round, printed as JSON."""
    import py_handoff as h

    import tensorshm

    ctx = mp.get_context("spawn")
    daemon = h.start_daemon(256 << 20)
    socket = daemon.socket
    try:
        times, _, _ = h.handoff(ctx, h.tsm_producer, h.tsm_consumer, (socket,), None, 4096,
                                HANDOFFS + 1)
        with tensorshm.connect(socket) as client:
            get_ns = h.warm_get_ns(client, GETS)
    finally:
        daemon.stop()
    print(json.dumps({"handoff_ns": h.median_after_first(times), "get_ns": get_ns,
                      "python": "%d.%d.%d" % sys.version_info[:3],
                      "extension": pathlib.Path(tensorshm._tensorshm.__file__).name}))
    return 0


def child_gets(socket: str, gets: int) -> int:
    """In a wheel's venv, under callgrind: `gets` warm gets of a published 4 KiB tensor."""
    import numpy as np

    import tensorshm

    with tensorshm.connect(socket) as client:
        client.put("instructions/warm", np.arange(1024, dtype=np.float32), replace=True).release()
        for _ in range(gets):
            t = client.get("instructions/warm")
            view = np.from_dlpack(t)
            del view, t
    return 0


def instructions_per_get(venv: pathlib.Path, env: dict[str, str]) -> float:
    """Instructions per warm get with this venv's wheel, by callgrind, against its own daemon."""
    sys.path.insert(0, str(HERE))
    import py_handoff as h

    os.environ["TENSORSHMD"] = env["TENSORSHMD"]
    daemon = h.start_daemon(64 << 20)
    socket = daemon.socket
    counts = []
    try:
        for gets in (2000, 12000):
            run = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                                  str(venv / "bin" / "python"), str(HERE / "py_wheels.py"),
                                  "--child-gets", socket, str(gets)],
                                 env=env, capture_output=True, text=True, check=True, cwd=HERE)
            counts.append(int(re.search(r"Collected : (\d+)", run.stderr).group(1)))
    finally:
        daemon.stop()
    return (counts[1] - counts[0]) / 10000


def venv_for(wheel: pathlib.Path, python: str) -> pathlib.Path:
    """build-wheel/bench/<wheel stem>: a venv of `python` with the wheel and numpy, made again
    when the wheel is newer than it."""
    venv = ROOT / "build-wheel" / "bench" / wheel.stem
    stamp = venv / "installed"
    if stamp.exists() and stamp.stat().st_mtime >= wheel.stat().st_mtime:
        return venv
    subprocess.run([python, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                    "--disable-pip-version-check", str(wheel), "numpy"], check=True)
    stamp.touch()
    return venv


def find_python(version: str) -> str:
    sys.path.insert(0, str(ROOT / "tests" / "wheels"))
    from pythons import find_python as find

    found = find(version)
    if found is None:
        sys.exit(f"py_wheels: no Python {version} (python{version} on PATH or pyenv's)")
    return found


def defaults() -> list[tuple[pathlib.Path, str]]:
    chosen = []
    for folder, tags, version in (("dist", "cp311-cp311", "3.11"),
                                  ("dist", "cp312-abi3", "3.12"),
                                  ("build-wheel/full-api", "cp312-cp312", "3.12")):
        found = sorted((ROOT / folder).glob(f"tensorshm-*-{tags}-*.whl"))
        if found:
            chosen.append((found[-1], find_python(version)))
        elif folder == "dist":
            sys.exit(f"py_wheels: no dist/tensorshm-*-{tags}-*.whl: make wheels")
    return chosen


def wheel_env(venv: pathlib.Path) -> dict[str, str]:
    """The environment a wheel's runs get: its own daemon (tensorshm/_bin), not build/'s."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1",
               TENSORSHMD=str(next(venv.glob("lib/python*/site-packages/tensorshm/_bin"))
                              / "tensorshmd"))
    env.pop("TSM_FAKE_CUDA_LIB", None)
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--instructions", action="store_true",
                        help="also count the instructions of a warm get (valgrind)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-gets", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("wheels", nargs="*", metavar="WHEEL=PYTHON")
    args = parser.parse_args()
    if args.child:
        return child()
    if args.child_gets:
        return child_gets(args.child_gets[0], int(args.child_gets[1]))
    chosen = [(pathlib.Path(w), p) for w, p in (a.split("=", 1) for a in args.wheels)] \
        if args.wheels else defaults()
    venvs = [(wheel, venv_for(wheel, python)) for wheel, python in chosen]

    rounds: dict[str, list[dict]] = {wheel.name: [] for wheel, _ in venvs}
    for r in range(args.rounds):
        for wheel, venv in venvs:
            out = subprocess.run([str(venv / "bin" / "python"), str(HERE / "py_wheels.py"),
                                  "--child"], env=wheel_env(venv), capture_output=True, text=True,
                                 check=True, cwd=HERE)
            rounds[wheel.name].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)

    print(__doc__.split("\n\n")[0])
    print(f"medians over {args.rounds} rounds (each: {HANDOFFS} handoffs, {GETS} gets); "
          f"x/first = this wheel's time over the first wheel's")
    instructions = {wheel.name: instructions_per_get(venv, wheel_env(venv))
                    for wheel, venv in venvs} if args.instructions else {}
    print(f"{'wheel':<58} {'python':>7} {'4 KiB handoff':>14} {'get+release':>12} "
          f"{'handoff x/first':>16} {'get x/first':>12}"
          + (f" {'instr/get':>10} {'x/first':>8}" if instructions else ""))
    first = None
    for wheel, _ in venvs:
        got = rounds[wheel.name]
        handoff = statistics.median(g["handoff_ns"] for g in got)
        get = statistics.median(g["get_ns"] for g in got)
        counted = instructions.get(wheel.name, 0.0)
        first = first or (handoff, get, counted)
        line = (f"{wheel.name:<58} {got[0]['python']:>7} {handoff / 1e3:>11.1f} us "
                f"{get / 1e3:>9.2f} us {handoff / first[0]:>15.2f}x {get / first[1]:>11.2f}x")
        if instructions:
            line += f" {counted:>10,.0f} {counted / first[2]:>7.2f}x"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
