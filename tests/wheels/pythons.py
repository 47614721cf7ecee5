"""Finds a Python by version as scripts/build-wheels.sh does, for tests/wheels and
bench/py_wheels.py."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess


def find_python(version: str) -> str | None:
    """python<version> on PATH, else pyenv's newest <version>.Y, that runs as <version>."""
    candidates = []
    for d in os.environ.get("PATH", "").split(os.pathsep):
        candidates.append(pathlib.Path(d) / f"python{version}")
    pyenv_root = pathlib.Path(os.environ.get("PYENV_ROOT", pathlib.Path.home() / ".pyenv"))
    versions = sorted(pyenv_root.glob(f"versions/{version}.*/bin/python{version}"),
                      key=lambda p: [int(x) for x in re.findall(r"\d+", p.parts[-3])],
                      reverse=True)
    for candidate in candidates + versions:
        if not os.access(candidate, os.X_OK):
            continue
        said = subprocess.run([str(candidate), "-c",
                               "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True)
        if said.returncode == 0 and said.stdout.strip() == version:
            return str(candidate)
    return None
