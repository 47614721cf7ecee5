"""examples/ run as users run them: a separate process against a real daemon's socket, checked by
exit code and the validation line each prints; what they consumed is gone from the daemon."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import ROOT

torch = pytest.importorskip("torch", reason="torch is not installed (make test-ecosystem "
                            "installs it into .venv)")
pytestmark = pytest.mark.ecosystem

EXAMPLES = ROOT / "examples"


def run_example(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{script} exited {result.returncode}:\n" \
        f"{result.stdout}\n{result.stderr}"
    return result


def checksum_line(stdout: str) -> re.Match[str]:
    match = re.search(r"checksum=(\d+) expected=(\d+) (OK|MISMATCH)", stdout)
    assert match is not None, stdout
    return match


def test_feed_model(daemon, client):
    result = run_example("feed_model.py", "--socket", daemon.socket, "--batches", "24",
                         "--batch-size", "64", "--prefix", "feed")
    match = checksum_line(result.stdout)
    assert match.group(1) == match.group(2) and match.group(3) == "OK"
    assert re.search(r"consumer: 24 batches, [\d.]+ batches/s", result.stdout), result.stdout
    # The producer put 24 batches and exited; the consumer deleted every one it consumed.
    assert client.list("feed/") == []


def test_dataloader(daemon, client):
    result = run_example("dataloader.py", "--socket", daemon.socket, "--batches", "20",
                         "--batch-size", "32", "--prefix", "loader")
    match = checksum_line(result.stdout)
    assert match.group(1) == match.group(2) and match.group(3) == "OK"
    assert "validated 20 batches from 2 workers" in result.stdout, result.stdout
    assert client.list("loader/") == []
