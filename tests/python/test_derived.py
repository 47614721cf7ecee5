"""The checked-in stub (python/tensorshm/_tensorshm.pyi) is what nanobind's stubgen makes of the
installed extension now, and the version is CMake's."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys

import tensorshm

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_checked_in_stub_is_what_stubgen_makes_now():
    run = subprocess.run([sys.executable, str(ROOT / "python" / "generate_stub.py"), "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_version_is_the_one_cmake_sets():
    cmake = (ROOT / "CMakeLists.txt").read_text()
    version = re.search(r"project\(tensorshm VERSION ([0-9.]+)", cmake).group(1)
    assert tensorshm.__version__ == version
    assert importlib.metadata.version("tensorshm") == version
    # The programs say the same: the wheel carries them under this metadata version.
    for program in ("tensorshmd", "tensorshmctl"):
        path = pathlib.Path(os.environ["TENSORSHMD"]).with_name(program)
        said = subprocess.run([str(path), "--version"], capture_output=True, text=True, check=True)
        assert said.stdout == f"{program} {version}\n"
