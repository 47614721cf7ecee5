"""Runs the tritonserver that PyPI's nvidia-pytriton bundles, on CPU, for tests and bench/.

The server lives in its own virtualenv (`make test-triton` makes .venv-triton: nvidia-pytriton
pins numpy < 2, which .venv does not take). Started directly, not through PyTriton's Python API:
    <venv>/site-packages/pytriton/tritonserver/bin/tritonserver
with a backend directory holding the Python backend and the stub built for the venv's Python,
LD_LIBRARY_PATH = the interpreter's libpython directory, then the bundled libraries (else the stub
finds no libcudart, or Debian's libpython of another patch release), and the venv's bin first on
PATH (the stub's embedded Python finds its environment, numpy included, through `python3` there).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

# Models written by write_models(): Python-backend models, FP32 [-1] in and out.
AFFINE_MODEL = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            y = (x * np.float32(2) + np.float32(1)).astype(np.float32)
            s = np.array([x.sum(dtype=np.float64)], dtype=np.float64)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", y), pb_utils.Tensor("s", s)]))
        return out
'''
AFFINE_CONFIG = '''\
name: "affine"
backend: "python"
max_batch_size: 0
input [ { name: "x", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [
  { name: "y", data_type: TYPE_FP32, dims: [ -1 ] },
  { name: "s", data_type: TYPE_FP64, dims: [ 1 ] }
]
instance_group [ { kind: KIND_CPU, count: 1 } ]
'''
ADD_MODEL = '''\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "a").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "b").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("c", a + b)]))
        return out
'''
ADD_CONFIG = '''\
name: "add"
backend: "python"
max_batch_size: 0
input [
  { name: "a", data_type: TYPE_FP32, dims: [ -1 ] },
  { name: "b", data_type: TYPE_FP32, dims: [ -1 ] }
]
output [ { name: "c", data_type: TYPE_FP32, dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
'''


def write_models(repository: Path) -> Path:
    """Writes the "affine" (y = 2x + 1, s = sum(x)) and "add" (c = a + b) models."""
    for name, model, config in (("affine", AFFINE_MODEL, AFFINE_CONFIG), ("add", ADD_MODEL, ADD_CONFIG)):
        (repository / name / "1").mkdir(parents=True, exist_ok=True)
        (repository / name / "1" / "model.py").write_text(model)
        (repository / name / "config.pbtxt").write_text(config)
    return repository


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def venv_facts(venv: Path) -> tuple[Path, str, Path]:
    """(site-packages, "3.11", libpython directory) of the virtualenv's interpreter."""
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import sys, sysconfig, site; print(site.getsitepackages()[0]); "
         "print('%d.%d' % sys.version_info[:2]); print(sysconfig.get_config_var('LIBDIR'))"],
        check=True, capture_output=True, text=True).stdout.split("\n")
    return Path(out[0]), out[1], Path(out[2])


class TritonServer:
    """A tritonserver process on free ports, serving `repository`. Use as a context manager.

    `user`: (uid, supplementary gids) to run it as another user (the caller is root); its backend
    directory is then that uid's, and `workdir` and `repository` must be readable by it."""

    def __init__(self, venv: Path, repository: Path, workdir: Path, *args: str,
                 user: tuple[int, list[int]] | None = None) -> None:
        self.venv = Path(venv)
        self.repository = repository
        self.workdir = workdir
        self.args = list(args)
        self.user = user
        self.http_port = free_port()
        self.grpc_port = free_port()
        self.log_path = workdir / "tritonserver.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def _backends(self, site: Path, version: str) -> Path:
        bundled = site / "pytriton" / "tritonserver"
        python = self.workdir / "backends" / "python"
        python.mkdir(parents=True, exist_ok=True)
        for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
            shutil.copy2(bundled / "backends" / "python" / name, python / name)
        # The backend chmods its stub on start: it must be a copy this uid owns.
        shutil.copy2(bundled / "python_backend_stubs" / version / "triton_python_backend_stub",
                     python / "triton_python_backend_stub")
        if self.user is not None:
            for path in (python.parent, python, *python.iterdir()):
                os.chown(path, self.user[0], -1)
        return python.parent

    def start(self, timeout: float = 90.0) -> TritonServer:
        site, version, libdir = venv_facts(self.venv)
        binary = site / "pytriton" / "tritonserver" / "bin" / "tritonserver"
        if not binary.exists():
            raise RuntimeError(f"{binary}: missing; `make test-triton` installs nvidia-pytriton")
        if not list(libdir.glob(f"libpython{version}.so*")):
            raise RuntimeError(f"{libdir}: no libpython{version}.so; the Python backend's stub "
                               "needs a Python built with --enable-shared")
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = f"{libdir}:{site / 'nvidia_pytriton.libs'}"
        env["PATH"] = f"{self.venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
        command = [str(binary), f"--model-repository={self.repository}",
                   f"--backend-directory={self._backends(site, version)}",
                   f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
                   "--allow-metrics=false", "--exit-timeout-secs=5", *self.args]
        with open(self.log_path, "wb") as log:
            # A session of its own: stop() signals the Python backend's stubs too.
            as_user = {} if self.user is None else {
                "user": self.user[0], "group": self.user[0], "extra_groups": self.user[1]}
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, **as_user)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited {self.process.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"tritonserver not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return textwrap.indent(text[-4000:], "  | ")

    def stop(self) -> None:
        if self.process is None:
            return
        process, self.process = self.process, None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                print(f"tritonserver did not exit 30 s after SIGTERM:\n{self.log()}", file=sys.stderr)
        # The stubs of a server that crashed live on and ignore SIGTERM.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
