"""The architecture picture (docs/images/architecture.svg, shown by README.md and docs/index.md)
is made from its source, docs/images/architecture.dot, by `make architecture`: the checked-in
SVG must be what Graphviz makes of the source now."""

import pathlib
import shutil
import subprocess

import pytest

IMAGES = pathlib.Path(__file__).resolve().parents[2] / "docs" / "images"


def test_the_svg_is_made_from_the_dot_source():
    if shutil.which("dot") is None:
        pytest.fail("Graphviz's dot is missing: make test-docs installs it (apt graphviz)")
    made = subprocess.run(["dot", "-Tsvg", str(IMAGES / "architecture.dot")], check=True,
                          capture_output=True, text=True, timeout=60).stdout
    assert made == (IMAGES / "architecture.svg").read_text(), (
        "docs/images/architecture.svg differs from what docs/images/architecture.dot makes: "
        "run make architecture")


def test_the_readme_and_the_docs_show_it():
    root = IMAGES.parents[1]
    assert "](docs/images/architecture.svg)" in (root / "README.md").read_text()
    assert "](images/architecture.svg)" in (root / "docs" / "index.md").read_text()
