#!/usr/bin/env python3
"""Generates python/tensorshm/_tensorshm.pyi with nanobind's stubgen from the installed extension
(`make python` first), so that the stub says what the bindings say (signatures, docstrings).

    python python/generate_stub.py           rewrites the checked-in stub (`make stubs`)
    python python/generate_stub.py --check   exits 1, printing a diff, if the checked-in stub
                                             differs from what stubgen makes now (a test runs it)

stubgen_patterns.txt adds what stubgen cannot see: the buffer protocol, which the extension
implements through type slots, not methods.
"""

from __future__ import annotations

import argparse
import difflib
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
STUB = HERE / "tensorshm" / "_tensorshm.pyi"
PATTERNS = HERE / "stubgen_patterns.txt"


def generate() -> str:
    """The stub stubgen makes of the installed tensorshm._tensorshm."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "_tensorshm.pyi"
        # Run from an empty directory: the source tree's tensorshm/ (no extension) must not
        # shadow the installed package.
        subprocess.run(
            [sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "tensorshm._tensorshm",
             "--include-private", "-p", str(PATTERNS), "-o", str(out)],
            cwd=tmp, check=True)
        return out.read_text()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with the checked-in stub instead of writing it")
    args = parser.parse_args()
    made = generate()
    if not args.check:
        STUB.write_text(made)
        return 0
    have = STUB.read_text()
    if have == made:
        return 0
    sys.stdout.writelines(difflib.unified_diff(
        have.splitlines(keepends=True), made.splitlines(keepends=True),
        "python/tensorshm/_tensorshm.pyi (checked in)", "nanobind.stubgen (now)"))
    print("\nthe checked-in stub drifted from the bindings: run `make stubs` and commit it",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
