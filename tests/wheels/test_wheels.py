"""dist/'s wheels (make wheels), each installed into a fresh venv of every Python it is for, and
used there as a user would: the wheel's own tensorshmd and tensorshmctl, a producer and a consumer
process, tensorshm.Daemon, numpy's from_dlpack, the package's imports with warnings as errors,
the checked-in stub against what nanobind's stubgen makes of this interpreter's extension, and
mypy --strict with this interpreter. Then tests/python against the abi3 wheel on the newest
Python.

The Pythons are found as scripts/build-wheels.sh finds them (python3.X on PATH, else pyenv's);
TSM_WHEEL_TEST_PYTHONS lists them (default 3.10 3.11 3.12 3.13). A missing one fails its test.
Each venv gets the wheel with its numpy extra, mypy and the nanobind that wrote the stub, from
PyPI."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile

import pytest
from pythons import find_python

ROOT = pathlib.Path(__file__).resolve().parents[2]
DIST = ROOT / "dist"
PYTHONS = os.environ.get("TSM_WHEEL_TEST_PYTHONS", "3.10 3.11 3.12 3.13").split()
# The wheel each Python installs: its own ABI's up to 3.11, the stable ABI's from 3.12 on.
ABI3_FROM = (3, 12)
# One step of a scenario (a pip install included) may take this long; the whole test is bounded
# by the steps it runs.
STEP_SECONDS = 300
# auditwheel's manylinux tag: glibc 2.35 or older (Debian bookworm has 2.36; the programs and the
# extension must not need more than what `auditwheel repair` says).
MANYLINUX = re.compile(r"manylinux_2_(\d+)_x86_64")


def wheel_for(version: str) -> pathlib.Path:
    major, minor = (int(x) for x in version.split("."))
    tags = "cp312-abi3" if (major, minor) >= ABI3_FROM else f"cp{major}{minor}-cp{major}{minor}"
    found = sorted(DIST.glob(f"tensorshm-*-{tags}-*.whl"))
    assert len(found) == 1, f"want one dist/tensorshm-*-{tags}-*.whl, found {found}: make wheels"
    return found[0]


def run(args: list[str], cwd: pathlib.Path, env: dict[str, str] | None = None,
        timeout: float = STEP_SECONDS) -> str:
    """Runs one step; fails the test with its output when it fails."""
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{out}"
    return out


def test_build_names_a_python_it_cannot_find(tmp_path):
    # Before it builds anything: the message names the version and where it looked.
    done = subprocess.run(["bash", str(ROOT / "scripts" / "build-wheels.sh"), "3.10", "3.99"],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, WHEEL_DIST=str(tmp_path)))
    assert done.returncode != 0
    assert "wheels: Python 3.10." in done.stdout, done.stdout
    assert "no Python 3.99: no python3.99 on PATH" in done.stderr, done.stderr
    assert "leave it out of WHEEL_PYTHONS" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["cp310-cp310", "cp311-cp311", "cp312-abi3"])
def test_wheel_carries_the_programs_and_an_old_enough_glibc_tag(name):
    found = sorted(DIST.glob(f"tensorshm-*-{name}-*.whl"))
    assert len(found) == 1, f"want one dist/tensorshm-*-{name}-*.whl, found {found}: make wheels"
    wheel = found[0]
    platform = wheel.name.removesuffix(".whl").split("-")[-1]
    glibc = [int(m.group(1)) for m in map(MANYLINUX.fullmatch, platform.split(".")) if m]
    assert glibc and min(glibc) <= 35, f"{wheel.name}: platform {platform}"
    names = zipfile.ZipFile(wheel).namelist()
    for program in ("tensorshmd", "tensorshmctl"):
        assert f"tensorshm/_bin/{program}" in names, f"{wheel.name} has no tensorshm/_bin/{program}"
    suffix = ".abi3.so" if name.endswith("abi3") else f".cpython-{name[2:5]}-x86_64-linux-gnu.so"
    extensions = [n for n in names if n.startswith("tensorshm/_tensorshm") and n.endswith(".so")]
    assert extensions == [f"tensorshm/_tensorshm{suffix}"], extensions
    # The wheel's metadata says which Pythons it is for, as the wheels built say.
    metadata = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Requires-Python: >=3.10" in metadata


@pytest.mark.parametrize("version", PYTHONS)
def test_wheel_installs_and_serves(version, tmp_path):
    python = find_python(version)
    assert python, (f"no Python {version} (python{version} on PATH or pyenv's versions): install "
                    f"it, or leave it out of TSM_WHEEL_TEST_PYTHONS")
    wheel = wheel_for(version)
    print(f"\nPython {version}: {python}; {wheel.name}")

    # A fresh venv, the wheel with its numpy extra (numpy, ml_dtypes), mypy and the stub's
    # nanobind, nothing else.
    venv = tmp_path / "venv"
    run([python, "-m", "venv", str(venv)], cwd=tmp_path)
    bin_dir = venv / "bin"
    run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         f"{wheel}[numpy]", "mypy>=1.10", "-r",
         str(ROOT / "scripts" / "requirements-build.txt")], cwd=tmp_path)
    py = str(bin_dir / "python")
    # A user's environment: the venv's commands first, no $TENSORSHMD, the emulated CUDA driver
    # of tests/python not loaded, a working directory outside the source tree.
    env = {k: v for k, v in os.environ.items()
           if k not in ("TENSORSHMD", "TSM_FAKE_CUDA_LIB", "PYTHONPATH")}
    env["PATH"] = f"{bin_dir}:/usr/bin:/bin"
    work = tmp_path / "work"
    work.mkdir()

    # Import: every module of the package that needs no optional package, warnings as errors;
    # the extension is the wheel's, for this ABI; the version is the metadata's.
    abi3 = tuple(int(x) for x in version.split(".")) >= ABI3_FROM
    said = run([py, "-W", "error", "-X", "dev", "-c", """
import importlib.metadata, sys
import tensorshm, tensorshm._numpy, tensorshm._aio, tensorshm.transfer, tensorshm.triton
ext = tensorshm._tensorshm.__file__
assert ext.startswith(sys.prefix), ext
assert tensorshm.__version__ == importlib.metadata.version("tensorshm"), tensorshm.__version__
print(ext.rsplit("/", 1)[1], tensorshm.__version__)
"""], cwd=work, env=env)
    extension, package_version = said.split()
    assert extension == ("_tensorshm.abi3.so" if abi3 else
                         f"_tensorshm.cpython-{version.replace('.', '')}-x86_64-linux-gnu.so")

    # The wheel's programs, on PATH from the venv, say the package's version.
    for program in ("tensorshmd", "tensorshmctl"):
        assert run([program, "--version"], cwd=work, env=env) == \
            f"{program} {package_version}\n"

    # The venv's tensorshmd on a socket of its own; tensorshmctl health; a producer process and
    # a consumer process (tests/packages/exchange.py); SIGTERM ends the daemon with status 0.
    sock = tmp_path / "tensorshm.sock"
    prefix = f"tsm-wheel-{os.getpid()}-{version.replace('.', '')}"
    log = open(tmp_path / "daemon.log", "w+")
    daemon = subprocess.Popen(["tensorshmd", "--socket", str(sock), "--host-pool", "64Mi",
                               "--shm-prefix", prefix], cwd=work, env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert daemon.poll() is None, f"tensorshmd exited: {log.seek(0) or log.read()}"
            assert time.monotonic() < deadline, "tensorshmd made no socket in 30 s"
            time.sleep(0.05)
        health = run(["tensorshmctl", "--socket", str(sock), "--timeout", "5s", "health"],
                     cwd=work, env=env)
        print(f"tensorshmctl health: {health.strip()}")
        exchange = str(ROOT / "tests" / "packages" / "exchange.py")
        print(run([py, exchange, "produce", str(sock), "wheel/x"], cwd=work, env=env).strip())
        consumed = run([py, exchange, "consume", str(sock), "wheel/x"], cwd=work, env=env)
        assert "0 wrong values" in consumed, consumed
        print(consumed.strip())
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0, log.seek(0) or log.read()
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        left = sorted(p.name for p in pathlib.Path("/dev/shm").glob(prefix + ".*"))
        for name in left:
            (pathlib.Path("/dev/shm") / name).unlink()
    assert not left, f"the daemon left {left} in /dev/shm"

    # tensorshm.Daemon finds the wheel's tensorshmd by itself: numpy's from_dlpack, read-only.
    print(run([py, str(ROOT / "tests" / "wheels" / "roundtrip.py")], cwd=work, env=env).strip())

    # The one stub is what stubgen makes of this interpreter's extension.
    run([py, str(ROOT / "python" / "generate_stub.py"), "--check"], cwd=work, env=env)

    # mypy --strict with this interpreter: the package (its .py files and the one .pyi) and a
    # user's program against it, with the project's mypy settings.
    checked = run([py, "-m", "mypy", "--strict", "--cache-dir=/dev/null", "--config-file",
                   str(ROOT / "pyproject.toml"), str(ROOT / "python" / "tensorshm"),
                   str(ROOT / "tests" / "wheels" / "roundtrip.py")], cwd=ROOT, env=env)
    assert "Success: no issues found" in checked, checked
    print(f"mypy --strict ({version}): {checked.strip()}")


def test_python_suite_passes_with_the_abi3_wheel():
    """tests/python against the stable-ABI wheel on the newest Python it serves: its extension,
    its tensorshmd and tensorshmctl; the emulated CUDA driver as `make test` loads it; the
    packages of scripts/requirements.txt, none of the optional ones (their tests skip, naming
    them). tests/check_skips.py, run with the venv's Python, then fails the run on a skip that
    venv does not excuse."""
    version = PYTHONS[-1]
    python = find_python(version)
    assert python, f"no Python {version}"
    wheel = wheel_for(version)
    assert "abi3" in wheel.name, f"the newest of {PYTHONS} does not take the abi3 wheel"
    fake_cuda = ROOT / "build" / "tests" / "libtsm_fake_cuda.so"
    assert fake_cuda.exists(), f"{fake_cuda}: make build first"
    # Readable by every uid: some tests run the wheel's tensorshmd as uid 65534, which loads its
    # vendored libraries from here (pytest's tmp_path is root's alone).
    top = pathlib.Path(tempfile.mkdtemp(prefix="tsm-wheel-suite-"))
    try:
        top.chmod(0o755)
        venv = top / "venv"
        run([python, "-m", "venv", str(venv)], cwd=top)
        py = str(venv / "bin" / "python")
        run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel), "-r",
             str(ROOT / "scripts" / "requirements.txt")], cwd=top)
        programs = next(venv.glob("lib/python*/site-packages/tensorshm/_bin"))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(TENSORSHMD=str(programs / "tensorshmd"), TSM_FAKE_CUDA_LIB=str(fake_cuda),
                   TSM_TEST_BINARIES=str(fake_cuda.parent))
        results = top / "python.xml"
        out = run([py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/python",
                   f"--junitxml={results}"], cwd=ROOT, env=env, timeout=1200)
        print(f"\nPython {version}, {wheel.name}: tests/python: {out.strip().splitlines()[-1]}")
        checked = run([py, str(ROOT / "tests" / "check_skips.py"), "--label",
                       f"tests/python with {wheel.name}", str(results)], cwd=ROOT, env=env)
        print(checked.strip().splitlines()[0])
    finally:
        shutil.rmtree(top, ignore_errors=True)
