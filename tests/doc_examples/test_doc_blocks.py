"""Every code block of README.md and the guides in docs/ runs as written (see blocks.py for the
conventions): Python blocks page by page against a daemon of their own, C and C++ blocks built
with what `tensorshm.pc` says and run against it, shell blocks in bash, TOML blocks as the
daemon's --config, YAML blocks parsed. A block that does not run here says where it runs."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest
import yaml

import tensorshm
from blocks import NOT_CODE, ROOT, Block, all_blocks

BLOCKS = [b for b in all_blocks() if b.language not in NOT_CODE and
          not b.language.startswith("{")]
RUN_HERE = [b for b in BLOCKS if "skip" not in b.options and "wheel" not in b.options]


def test_every_fence_names_its_language():
    unnamed = [b.label for b in all_blocks() if not b.language]
    assert not unnamed, f"fences without a language (use text for output): {unnamed}"


def test_the_blocks_not_run_here_say_where_they_run(capsys):
    elsewhere = [b for b in BLOCKS if "skip" in b.options or "wheel" in b.options]
    for b in elsewhere:
        reason = b.options.get("skip") or "make test-docs-wheel"
        assert re.search(r"make [a-z-]+|tests/\S+", reason), f"{b.label}: {reason}"
        print(f"{b.label} ({b.language}): {reason}")
    languages = {b.language for b in RUN_HERE}
    assert {"python", "cpp", "c", "toml"} <= languages, languages


def needs(block: Block) -> None:
    for package in filter(None, block.options.get("needs", "").split(",")):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (make test-ecosystem installs it into .venv)")


@pytest.fixture(scope="module")
def daemon():
    with tensorshm.Daemon(host_pool="1Gi") as d:
        yield d


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> pathlib.Path:
    """The build installed into a prefix, as `make install PREFIX=...` installs it."""
    where = tmp_path_factory.mktemp("prefix")
    subprocess.run(["cmake", "--install", str(ROOT / "build"), "--prefix", str(where)],
                   check=True, capture_output=True, timeout=300)
    return where


def env_for(daemon) -> dict[str, str]:
    return {**os.environ, "TENSORSHM_SOCKET": daemon.socket}


PYTHON_PAGES = sorted({b.page for b in RUN_HERE if b.language == "python"})

DRIVER = r"""
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
scope = {"__name__": "__main__"}
for label, code in blocks:
    print(f"--- {label}", flush=True)
    try:
        exec(compile(code, label, "exec"), scope)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: {label}", file=sys.stderr)
        sys.exit(1)
"""


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_python_blocks(page, daemon, tmp_path):
    import json

    blocks = [b for b in RUN_HERE if b.page == page and b.language == "python"]
    for b in blocks:
        needs(b)
    script = tmp_path / "blocks.json"
    script.write_text(json.dumps([(b.label, b.code) for b in blocks]))
    result = subprocess.run([sys.executable, "-c", DRIVER, str(script)], cwd=tmp_path,
                            env=env_for(daemon), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"


@pytest.mark.parametrize("block", [b for b in RUN_HERE if b.language in ("c", "cpp")],
                         ids=lambda b: b.label)
def test_c_and_cpp_blocks(block, daemon, prefix, tmp_path):
    source = tmp_path / ("program.c" if block.language == "c" else "program.cc")
    source.write_text(block.code)
    pc = {**os.environ, "PKG_CONFIG_PATH": str(next(prefix.rglob("pkgconfig")))}
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "tensorshm"], env=pc,
                           check=True, capture_output=True, text=True).stdout.split()
    libdir = subprocess.run(["pkg-config", "--variable=libdir", "tensorshm"], env=pc,
                            check=True, capture_output=True, text=True).stdout.strip()
    compiler = ["cc"] if block.language == "c" else ["c++", "-std=c++20"]
    program = tmp_path / "program"
    build = subprocess.run([*compiler, "-Wall", "-Wextra", "-Werror", "-o", str(program),
                            str(source), *flags, f"-Wl,-rpath,{libdir}"],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(program)], env=env_for(daemon), capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"


def test_shell_blocks(daemon):
    """Shell blocks with no mark run in bash from the repository root (none today: the README's
    and the guides' shell blocks install or serve, and say where they run)."""
    for block in [b for b in RUN_HERE if b.language in ("sh", "bash")]:
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=ROOT,
                                env=env_for(daemon), capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{block.label}\n{result.stdout}\n{result.stderr}"


@pytest.mark.parametrize("block", [b for b in RUN_HERE if b.language == "toml"],
                         ids=lambda b: b.label)
def test_toml_blocks_configure_a_daemon(block, tmp_path):
    """The daemon starts with the block as its --config (socket and prefix moved to this test's
    own, as command-line flags override the file's) and serves."""
    config = tmp_path / "tensorshmd.toml"
    config.write_text(block.code)
    socket = tmp_path / "tensorshm.sock"
    prefix = f"tsmdoc-{os.getpid()}"
    program = os.environ.get("TENSORSHMD", str(ROOT / "build" / "tensorshmd"))
    daemon = subprocess.Popen([program, "--config", str(config), "--socket",
                               str(socket), "--shm-prefix", prefix, "--log-level", "warning"],
                              stderr=subprocess.PIPE, text=True)
    try:
        client = tensorshm.connect(str(socket), timeout=10) if wait_for(socket, daemon) else None
        assert client is not None, daemon.stderr.read() if daemon.stderr else ""
        client.close()
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0
        for leftover in pathlib.Path("/dev/shm").glob(prefix + ".*"):
            leftover.unlink()


def wait_for(socket: pathlib.Path, process: subprocess.Popen) -> bool:
    import time

    deadline = time.monotonic() + 20
    while not socket.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("block", [b for b in RUN_HERE if b.language == "yaml"],
                         ids=lambda b: b.label)
def test_yaml_blocks_parse(block):
    assert isinstance(yaml.safe_load(block.code), dict)


def test_no_block_of_an_unknown_language():
    known = {"python", "c", "cpp", "sh", "bash", "toml", "yaml"}
    unknown = [f"{b.label} ({b.language})" for b in RUN_HERE if b.language not in known]
    assert not unknown, f"blocks this test cannot run (mark them text, or teach it): {unknown}"


def test_make_run_serves_on_its_defaults(tmp_path):
    """The README's `make run` (its other line, `make test`, is what CI runs): tensorshmd in the
    foreground on its defaults, here on this test's own default socket (a private
    $XDG_RUNTIME_DIR); Ctrl-C (SIGINT to the group, as a terminal sends it) stops it, and it
    removes its socket and says so."""
    import time

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORSHM", "MAKE"))}
    env["XDG_RUNTIME_DIR"] = str(runtime)
    socket = runtime / "tensorshm.sock"
    make = subprocess.Popen(["make", "--no-print-directory", "run"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # make run builds what is missing first
        while not socket.exists():
            assert make.poll() is None, make.stdout.read() if make.stdout else ""
            assert time.monotonic() < deadline, "make run did not serve"
            time.sleep(0.05)
        with tensorshm.connect(str(socket)) as client:
            assert client.stat()["pools"][0]["capacity_bytes"] == 1 << 30  # the default pool
    finally:
        os.killpg(make.pid, signal.SIGINT)
        output, _ = make.communicate(timeout=60)
    assert "serving on unix:" + str(socket) in output, output
    assert "stopped; socket removed, shm segments removed" in output, output
    assert not socket.exists()
