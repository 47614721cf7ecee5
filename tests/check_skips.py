#!/usr/bin/env python3
"""Lists the tests a run skipped, with their reasons, and fails on a skip this machine does not
excuse.

Reads JUnit XML: ctest's (--output-junit; a GTEST_SKIP shows as a skipped test whose output holds
the reason) and pytest's (--junitxml). A skip passes only when its reason is one of ALLOWED and
the machine really lacks what the reason says: "needs root..." when not root, "no CUDA device"
when the machine has no NVIDIA GPU, "<package> is not installed" when the package does not
import, "built with a sanitizer" in a sanitizer build (--sanitizer). Anything else (a missing
tool CI installs, a stale "not implemented yet", root's skip under root) fails the run: a skip
where the test could have run hides what it would have found.

  usage: check_skips.py [--sanitizer] [--label NAME] RESULTS.xml...
Exits 0 when every skip is excused (or none happened), 1 when one is not, 2 on a missing file.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from typing import Callable, NamedTuple


def _not_root() -> bool:
    return os.geteuid() != 0


def _no_gpu() -> bool:
    if glob.glob("/dev/nvidia[0-9]*"):
        return False
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return True
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return True
    return listed.returncode != 0 or "GPU" not in listed.stdout


def _not_importable(match: re.Match[str]) -> bool:
    return importlib.util.find_spec(match.group("package")) is None


def _lacks(module: str, path: str) -> bool:
    """True when `module` does not import, or has no attribute `path` ("a.b": a, then its b)."""
    try:
        found: object = importlib.import_module(module)
    except ImportError:
        return True
    for part in path.split("."):
        if getattr(found, part, None) is None:
            return True
        found = getattr(found, part)
    return False


class Rule(NamedTuple):
    pattern: str  # matched (re.search) against the reason
    excuse: str  # what the machine must lack, for the summary
    holds: Callable[[re.Match[str], argparse.Namespace], bool]  # true when it does lack it

ALLOWED = [
    Rule(r"^needs root\b", "not root", lambda m, a: _not_root()),
    Rule(r"no CUDA device|no GPU", "no GPU on this machine", lambda m, a: _no_gpu()),
    Rule(r"^(?P<package>[A-Za-z_][\w.]*) is not installed", "the package does not import",
         lambda m, a: _not_importable(m)),
    Rule(r"sanitizer", "a sanitizer build", lambda m, a: a.sanitizer),
    Rule(r"^this ml_dtypes has no bcomplex32$", "this ml_dtypes has no bcomplex32",
         lambda m, a: _lacks("ml_dtypes", "bcomplex32")),
    Rule(r"^torch \S+ has no __dlpack_c_exchange_api__$", "this torch lacks it",
         lambda m, a: _lacks("torch", "Tensor.__dlpack_c_exchange_api__")),
]


class Skip(NamedTuple):
    test: str
    reason: str


def _gtest_reason(output: str) -> str:
    """The message of a GTEST_SKIP: the lines after "<file>:<line>: Skipped" up to the
    "[  SKIPPED ]" line (or a blank line)."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if re.search(r":\d+: Skipped$", line) or line == "Skipped":
            message = []
            for follow in lines[i + 1:]:
                if not follow.strip() or follow.startswith("[  SKIPPED ]"):
                    break
                message.append(follow.strip())
            return " ".join(message) or "(no message)"
    return "(no reason found in its output)"


def read_skips(path: str) -> list[Skip]:
    skips = []
    for case in ET.parse(path).getroot().iter("testcase"):
        skipped = case.find("skipped")
        if skipped is None:
            continue
        name = case.get("name", "?")
        classname = case.get("classname", "")
        test = f"{classname}::{name}" if classname and classname != name else name
        message = skipped.get("message", "")
        if message == "SKIP_REGULAR_EXPRESSION_MATCHED" or case.get("status") == "notrun":
            # ctest: the reason is in the test's output.
            reason = _gtest_reason(case.findtext("system-out") or "")
        elif message == "collection skipped":
            # pytest, a module skipped at import: "('file', line, 'Skipped: reason')".
            found = re.search(r"Skipped: (.*)['\"]\)\s*$", skipped.text or "", re.DOTALL)
            reason = found.group(1).strip() if found else (skipped.text or "").strip()
        else:
            # pytest: "reason" or "file:line: reason".
            reason = re.sub(r"^.*?:\d+: ", "", message).strip() or (skipped.text or "").strip()
        skips.append(Skip(test, reason))
    return skips


def excuse(reason: str, args: argparse.Namespace) -> str | None:
    """Why this machine excuses the skip, or None."""
    for rule in ALLOWED:
        match = re.search(rule.pattern, reason)
        if match is not None and rule.holds(match, args):
            return rule.excuse
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sanitizer", action="store_true",
                        help="a sanitizer build: skips that say so are excused")
    parser.add_argument("--label", default="tests", help="what ran, for the summary")
    parser.add_argument("results", nargs="+", help="JUnit XML files")
    args = parser.parse_args()
    skips: list[Skip] = []
    for path in args.results:
        if not os.path.exists(path):
            print(f"check_skips: {path}: no such file (did the run write its results?)",
                  file=sys.stderr)
            return 2
        skips += read_skips(path)
    if not skips:
        print(f"check_skips: {args.label}: no test skipped")
        return 0
    refused = 0
    print(f"check_skips: {args.label}: {len(skips)} skipped:")
    for skip in sorted(skips):
        why = excuse(skip.reason, args)
        if why is None:
            refused += 1
        verdict = f"excused ({why})" if why is not None else "NOT EXCUSED on this machine"
        print(f"  {skip.test}: {skip.reason} -- {verdict}")
    if refused:
        print(f"check_skips: {args.label}: {refused} skip(s) not excused: this machine has what "
              "they need, so they must run (fix the test or the setup)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
