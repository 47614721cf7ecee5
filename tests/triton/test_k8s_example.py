"""deploy/kubernetes/triton.yaml's model repository, Triton flags and client scripts, run as the
manifest has them against the real tritonserver and a real tensorshmd (no cluster here:
tests/deploy checks the manifest itself): the producer publishes x, the feeder has Triton compute
y = 2x + 1 in tensorshm's segments and publishes y, and this test sees several rounds of correct
y. Triton runs with the manifest's own flags (its shared-memory endpoints behind the token, gRPC
and metrics on loopback), so tritonserver 2.51 is seen to take them; and the manifest keeps
Triton's ports in the Pod."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

import tensorshm
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import ROOT, TritonServer, triton_venv

MANIFEST = ROOT / "deploy" / "kubernetes" / "triton.yaml"
TOKEN_ENV = "TRITON_SHM_TOKEN"


def documents() -> list[dict]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def config_map(name: str) -> dict[str, str]:
    for document in documents():
        if document["kind"] == "ConfigMap" and document["metadata"]["name"] == name:
            return dict(document["data"])
    raise AssertionError(f"{MANIFEST}: no ConfigMap {name}")


def pod() -> dict:
    (found,) = [d for d in documents() if d["kind"] == "Pod"]
    return found


def container(name: str) -> dict:
    (found,) = [c for c in pod()["spec"]["containers"] if c["name"] == name]
    return found


def triton_args(token: str) -> list[str]:
    """The manifest's Triton flags as the kubelet gives them ($(VAR) expanded), less the model
    repository (the test's own)."""
    args = container("triton")["args"]
    return [a.replace(f"$({TOKEN_ENV})", token) for a in args
            if not a.startswith("--model-repository=")]


def secret_env(c: dict, name: str) -> tuple[str, str] | None:
    """(Secret, key) an env var of a container comes from, or None."""
    for e in c.get("env", []):
        if e["name"] == name and "secretKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["secretKeyRef"]
            return ref["name"], ref["key"]
    return None


def test_triton_ports_stay_in_the_pod_and_its_shared_memory_api_wants_the_token():
    docs = documents()
    assert not [d for d in docs if d["kind"] in ("Service", "Ingress")], "a Service exposes Triton"
    args = container("triton")["args"]
    flags = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if "=" in a}
    # HTTP stays on the Pod's address for the kubelet's probes; the rest on loopback only.
    assert flags.get("--grpc-address") == "127.0.0.1", args
    assert flags.get("--metrics-address") == "127.0.0.1" or flags.get("--allow-metrics") == "false"
    assert [p["containerPort"] for p in container("triton")["ports"]] == [8000]
    assert not any("hostPort" in p for c in pod()["spec"]["containers"] for p in c.get("ports", []))
    # A NetworkPolicy selects the Pod and admits no ingress.
    labels = pod()["metadata"]["labels"]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"
                and d["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
                and "Ingress" in d["spec"]["policyTypes"]]
    assert policies and all(not p["spec"].get("ingress") for p in policies), policies
    # The shared-memory endpoints of both protocols want the token, from a Secret the feeder
    # gets too (and the feeder passes it: its script names the variable).
    value = f"shared-memory:triton-access-token=$({TOKEN_ENV})"
    assert flags.get("--http-restricted-api") == value, args
    assert flags.get("--grpc-restricted-protocol") == value, args
    secret = secret_env(container("triton"), TOKEN_ENV)
    assert secret is not None and secret_env(container("feeder"), TOKEN_ENV) == secret
    assert not [d for d in docs if d["kind"] == "Secret"], "a token in the manifest is no secret"
    feeder = config_map("tensorshm-triton-clients")["feeder.py"]
    assert re.search(rf'"triton-access-token": os\.environ\["{TOKEN_ENV}"\]', feeder)
    assert "headers=TOKEN" in feeder and "feed.infer(" in feeder


def test_manifest_scripts_feed_real_triton(daemon, tmp_path):
    models = config_map("tensorshm-triton-models")
    model = tmp_path / "models" / "affine"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(models["config.pbtxt"])
    (model / "1" / "model.py").write_text(models["model.py"])
    scripts = config_map("tensorshm-triton-clients")
    token = "k8s-example-token"
    with TritonServer(triton_venv(), tmp_path / "models", tmp_path,
                      *triton_args(token)) as server:
        env = {**os.environ, "TENSORSHM_SOCKET": daemon.socket, TOKEN_ENV: token}
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
            # A client without the token can neither list the regions (their names) nor
            # register one of its own.
            with httpclient.InferenceServerClient(server.http_url) as stranger:
                with pytest.raises(InferenceServerException, match="restricted"):
                    stranger.get_system_shared_memory_status()
                with pytest.raises(InferenceServerException, match="restricted"):
                    stranger.register_system_shared_memory("mine", "/anything", 64)
        finally:
            for process in processes:
                process.kill()
                process.wait()
