"""Fixtures of `make test-multinode`: two real tensorshmd daemons stand for two nodes (each its
own socket and shm prefix), each with a mover (tensorshm.transfer.Mover) in a process of its own
(tests/multinode/node.py) talking to the other over gRPC on TCP loopback, proving the fleet token
of TOKEN_FILE on every call, and moving bytes with NIXL (UCX, shared memory and CMA here). NIXL
and grpcio must import (make test-multinode installs them); the tests never skip for want of
them."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import secrets
import subprocess
import sys
import tempfile

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# tests/python's Daemon and helpers, loaded under another module name (both files are conftests).
_spec = importlib.util.spec_from_file_location("tsm_python_conftest", ROOT / "tests/python/conftest.py")
assert _spec is not None and _spec.loader is not None
python_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(python_conftest)
Daemon = python_conftest.Daemon
run_python = python_conftest.run_python
wait_for = python_conftest.wait_for

# UCX on loopback, NIXL's INFO lines off stdout (node.py answers there).
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

# The fleet token of the tests' movers: a file of this uid, mode 0600, in a 0700 directory.
_SECRETS = tempfile.mkdtemp(prefix="tsm-multinode-")
TOKEN_FILE = os.path.join(_SECRETS, "mover.token")


def write_secret(path: str, text: str, mode: int = 0o600) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    return path


write_secret(TOKEN_FILE, secrets.token_urlsafe(32))


def pytest_configure(config) -> None:
    for module in ("nixl_cu12", "grpc", "google.protobuf", "ray"):
        if importlib.util.find_spec(module) is None:
            pytest.exit(f"{module} does not import from {sys.executable}: make test-multinode "
                        "installs NIXL, grpcio and Ray into .venv", 2)


class Node:
    """A node: a mover process on a daemon's socket, driven by JSON commands."""

    def __init__(self, socket: str, env: dict | None = None, **options) -> None:
        """`options`: Mover's keyword arguments (default: the tests' fleet token)."""
        if not {"token_file", "tls_cert", "insecure"} & options.keys():
            options["token_file"] = TOKEN_FILE
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / "node.py"), socket, json.dumps(options)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=None if env is None else {**os.environ, **env})
        self.address = self._line("ready ")

    def send(self, **command) -> None:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def _line(self, prefix: str) -> str:
        """The rest of the next line of node.py's that starts with `prefix` (UCX logs there too)."""
        while True:
            line = self.process.stdout.readline()
            assert line, f"node.py ended (status {self.process.poll()})"
            if line.startswith(prefix):
                return line[len(prefix):].strip()
            print(f"node.py: {line}", end="")

    def answer(self) -> dict:
        return json.loads(self._line("answer "))

    def run(self, **command) -> dict:
        self.send(**command)
        return self.answer()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)

    def state(self) -> dict:
        answer = self.run(op="state")
        assert answer["ok"], answer
        return answer["result"]


@pytest.fixture
def daemons():
    a, b = Daemon("node-a", host_pool="1Gi"), Daemon("node-b", host_pool="1Gi")
    yield a, b
    for d in (a, b):
        if d.process.poll() is None:
            d.stop()


@pytest.fixture
def nodes(daemons):
    a, b = daemons
    node_a, node_b = Node(a.socket), Node(b.socket)
    yield node_a, node_b
    for n in (node_a, node_b):
        n.stop()


def pytest_sessionfinish(session, exitstatus) -> None:
    """As tests/python's: what this run's daemons left in /dev/shm fails it."""
    python_conftest.pytest_sessionfinish(session, exitstatus)


def pytest_unconfigure(config) -> None:
    import shutil

    shutil.rmtree(_SECRETS, ignore_errors=True)
