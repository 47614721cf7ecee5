"""Fixtures of `make test-triton`: a real tritonserver (the one nvidia-pytriton bundles, on CPU,
from the virtualenv in $TSM_TRITON_VENV), a real tensorshmd, and tritonclient HTTP and gRPC
clients. Without the server's virtualenv the tests fail (they are run by `make test-triton`,
which makes it); they never skip for want of it."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

# tests/python's Daemon and helpers, loaded under another module name (both files are conftests).
_spec = importlib.util.spec_from_file_location("tsm_python_conftest", ROOT / "tests/python/conftest.py")
assert _spec is not None and _spec.loader is not None
python_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(python_conftest)
Daemon = python_conftest.Daemon
run_python = python_conftest.run_python

from tritonserver import TritonServer, write_models  # noqa: E402 - after sys.path


def triton_venv() -> pathlib.Path:
    venv = os.environ.get("TSM_TRITON_VENV", str(ROOT / ".venv-triton"))
    if not os.access(os.path.join(venv, "bin", "python"), os.X_OK):
        pytest.fail(f"no tritonserver virtualenv at {venv}: run `make test-triton` (it makes one) "
                    "or set TSM_TRITON_VENV", pytrace=False)
    return pathlib.Path(venv)


@pytest.fixture(scope="session")
def triton(tmp_path_factory):
    """A tritonserver serving the "affine" and "add" models (tests/triton/tritonserver.py)."""
    work = tmp_path_factory.mktemp("triton")
    server = TritonServer(triton_venv(), write_models(work / "models"), work)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def daemon(request):
    d = Daemon(request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")[:20])
    yield d
    assert d.stop() == 0


@pytest.fixture(params=["http", "grpc"])
def triton_client(request, triton):
    """A tritonclient InferenceServerClient of each protocol, closed after the test (an open HTTP
    client holds the server's shutdown for its whole exit timeout)."""
    if request.param == "http":
        import tritonclient.http as protocol

        client = protocol.InferenceServerClient(triton.http_url)
    else:
        import tritonclient.grpc as protocol  # type: ignore[no-redef]

        client = protocol.InferenceServerClient(triton.grpc_url)
    yield client
    client.close()


def pytest_sessionfinish(session, exitstatus) -> None:
    """As tests/python's: the daemons' directories go, and what they left in /dev/shm fails the
    run."""
    python_conftest.pytest_sessionfinish(session, exitstatus)
