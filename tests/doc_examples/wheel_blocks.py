"""The README's quick start and docs/install.md's wheel install, run as a newcomer runs them (see
blocks.py): make test-docs-wheel runs this file by name (it is not a test_ file: make test-docs
leaves it out, as it builds and installs the wheel and needs PyPI for numpy)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from blocks import ROOT, Block, all_blocks

WHEEL_BLOCKS = [b for b in all_blocks() if "wheel" in b.options]


def test_there_are_wheel_blocks():
    assert {b.page for b in WHEEL_BLOCKS} == {"README.md", "docs/install.md"}, WHEEL_BLOCKS


def test_wheel_blocks():
    """From the repository root, with a HOME and runtime directory of their own (each block
    installs the wheel into ~/tsm; the README's starts its own daemon in the background)."""
    for block in WHEEL_BLOCKS:
        run_wheel_block(block)


def run_wheel_block(block: Block) -> None:
    home = tempfile.mkdtemp(prefix="tsm-doc-home-")
    runtime = tempfile.mkdtemp(prefix="tsm-doc-run-")
    os.chmod(runtime, 0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORSHM", "VIRTUAL_ENV"))}
    env.update(HOME=home, XDG_RUNTIME_DIR=runtime)
    try:
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=ROOT,
                                env=env, capture_output=True, text=True, timeout=1800)
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(runtime, ignore_errors=True)
    assert result.returncode == 0, f"{block.label}\n{result.stdout}\n{result.stderr}"
    if "demo/x" in block.code:
        assert "[[0. 1. 2.]\n [3. 4. 5.]]" in result.stdout, result.stdout
