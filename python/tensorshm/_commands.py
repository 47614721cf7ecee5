"""The console commands `tensorshmd` and `tensorshmctl` of a wheel install: each replaces itself
(exec) with the program of that name the wheel carries in tensorshm/_bin, so signals, exit codes
and the process id are the program's own."""

from __future__ import annotations

import os
import pathlib
import sys
from typing import NoReturn


def installed_program(name: str) -> pathlib.Path:
    """Where this package keeps its copy of `name` (present in the wheel, absent in a build of the
    Python package alone, such as `make python`'s)."""
    return pathlib.Path(__file__).resolve().parent / "_bin" / name


def _exec(name: str) -> NoReturn:
    program = installed_program(name)
    if not os.access(program, os.X_OK):
        sys.exit(f"{name}: this installation of tensorshm has no {name} ({program} is missing): "
                 f"it was built without the programs (as `make python` builds it); install "
                 f"tensorshm's wheel (make wheel) or Debian package, or run the one a source "
                 f"build makes (make build: build/{name})")
    os.execv(program, [sys.argv[0], *sys.argv[1:]])


def tensorshmd() -> NoReturn:
    _exec("tensorshmd")


def tensorshmctl() -> NoReturn:
    _exec("tensorshmctl")
