"""The Ray row of py_handoff.py, run in an interpreter of its own (--ray-python: Ray often lives
in a venv of its own), and the page helpers both sides use.

    python bench/py_handoff_ray.py '{"sizes": [...], "iterations": [...]}'

prints one JSON object per size (times and page faults), or {"skipped": reason}. Everything the
Ray actor runs is defined here, in the script Ray's workers receive by value.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import subprocess
import sys
import time

PAGE = 4096
ROOT = pathlib.Path(__file__).resolve().parents[1]


def minor_faults() -> int:
    """Minor page faults of this process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def touch(array) -> int:
    """Reads one byte per page of the array's memory."""
    import numpy as np

    flat = array.reshape(-1).view(np.uint8)
    return int(flat[::PAGE].sum()) + int(flat[-1])


def ray_child(spec: dict) -> int:
    """Runs the Ray handoffs for spec's sizes; prints one JSON object per size, or
    {"skipped": reason}."""
    try:
        import numpy as np
        import ray
    except ImportError as e:
        print(json.dumps({"skipped": f"{e} in {sys.executable}"}), flush=True)
        return 0
    largest = max(spec["sizes"])
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=max(2 * largest + (256 << 20), 100 << 20),
                 _node_ip_address="127.0.0.1")
    except Exception as e:  # noqa: BLE001 - any failure to start Ray is a reason to skip
        print(json.dumps({"skipped": f"ray.init failed: {type(e).__name__}: {e}"}), flush=True)
        return 0

    @ray.remote(num_cpus=1)
    class Consumer:
        def consume(self, refs):
            f0 = minor_faults()
            array = ray.get(refs[0])
            touch(array)
            end = time.monotonic_ns()
            del array
            return end, minor_faults() - f0

    consumer = Consumer.remote()
    ray.get(consumer.consume.remote([ray.put(np.zeros(1, np.uint8))]))  # the actor is up
    try:
        for size, iterations in zip(spec["sizes"], spec["iterations"]):
            array = np.full(size, 7, dtype=np.uint8)
            times, producer_faults, consumer_faults = [], [], []
            for _ in range(iterations):
                time.sleep(0.002)  # the same idle gap as the other methods
                f0 = minor_faults()
                start = time.monotonic_ns()
                ref = ray.put(array)
                faults = minor_faults() - f0
                end, actor_faults = ray.get(consumer.consume.remote([ref]))
                del ref
                times.append(end - start)
                producer_faults.append(faults)
                consumer_faults.append(actor_faults)
            print(json.dumps({"size": size, "times": times, "producer_faults": producer_faults,
                              "consumer_faults": consumer_faults}), flush=True)
    finally:
        ray.shutdown()
    return 0


def ray_python(flag: str | None) -> str | None:
    """The interpreter to run the Ray row with, or None."""
    if flag or os.environ.get("RAY_PYTHON"):
        return flag or os.environ["RAY_PYTHON"]
    try:
        import ray  # noqa: F401

        return sys.executable
    except ImportError:
        pass
    venv = ROOT / ".venv-ray" / "bin" / "python"
    return str(venv) if venv.exists() else None


def run_ray(python: str | None, sizes, iterations) -> dict:
    """{size: (times, producer faults, consumer faults)}, or {"skipped": reason}."""
    if python is None:
        return {"skipped": "ray does not import here and there is no .venv-ray "
                           "(make bench-ray, or --ray-python PATH)"}
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    spec = json.dumps({"sizes": sizes, "iterations": iterations})
    try:
        run = subprocess.run([python, __file__, spec], env=env,
                             capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"skipped": f"{python}: {e}"}
    results = {}
    for line in run.stdout.splitlines():
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if "skipped" in row:
            return row
        results[row["size"]] = (row["times"], row["producer_faults"], row["consumer_faults"])
    if run.returncode != 0 and len(results) < len(sizes):
        tail = (run.stderr.strip().splitlines() or ["no output"])[-1]
        return {"skipped": f"the Ray run failed (exit {run.returncode}): {tail}"}
    return results


if __name__ == "__main__":
    sys.exit(ray_child(json.loads(sys.argv[1])))
