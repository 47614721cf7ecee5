"""deploy/kubernetes/triton.yaml's model repository and client scripts, run as the manifest has
them against the real tritonserver and a real tensorshmd (no cluster here: tests/deploy checks
the manifest itself): the producer publishes x, the feeder has Triton compute y = 2x + 1 in
tensorshm's segments and publishes y, and this test sees several rounds of correct y."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import yaml

import tensorshm

from conftest import ROOT, TritonServer, triton_venv

MANIFEST = ROOT / "deploy" / "kubernetes" / "triton.yaml"


def config_map(name: str) -> dict[str, str]:
    for document in yaml.safe_load_all(MANIFEST.read_text()):
        if document and document["kind"] == "ConfigMap" and document["metadata"]["name"] == name:
            return dict(document["data"])
    raise AssertionError(f"{MANIFEST}: no ConfigMap {name}")


def test_manifest_scripts_feed_real_triton(daemon, tmp_path):
    models = config_map("tensorshm-triton-models")
    model = tmp_path / "models" / "affine"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(models["config.pbtxt"])
    (model / "1" / "model.py").write_text(models["model.py"])
    scripts = config_map("tensorshm-triton-clients")
    with TritonServer(triton_venv(), tmp_path / "models", tmp_path) as server:
        env = {**os.environ, "TENSORSHM_SOCKET": daemon.socket}
        feeder_code = scripts["feeder.py"].replace("localhost:8000", server.http_url)
        assert feeder_code != scripts["feeder.py"], "the feeder no longer names localhost:8000"
        processes = [subprocess.Popen([sys.executable, "-c", code], env=env,
                                      stderr=subprocess.PIPE, text=True)
                     for code in (scripts["producer.py"], feeder_code)]
        try:
            steps = set()
            base = np.arange(1024, dtype=np.float32)
            deadline = time.monotonic() + 60
            with tensorshm.connect(daemon.socket) as client:
                while len(steps) < 5 and time.monotonic() < deadline:
                    for process in processes:
                        assert process.poll() is None, process.stderr.read() if process.stderr else ""
                    try:
                        with client.get("y") as y:
                            values = np.from_dlpack(y).copy()
                    except tensorshm.NotFoundError:
                        time.sleep(0.01)
                        continue
                    step = (values[0] - 1) / 2
                    np.testing.assert_array_equal(values, (base + np.float32(step)) * 2 + 1)
                    steps.add(float(step))
            assert len(steps) >= 5, f"saw y for steps {sorted(steps)} in 60 s"
        finally:
            for process in processes:
                process.kill()
                process.wait()
