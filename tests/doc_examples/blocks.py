"""The fenced code blocks of README.md and the guides in docs/, with what each needs to run.

Every fence names its language. `text` (and `console` output, `{directive}` MyST directives) is
not code; every other block runs in tests/doc_examples/test_doc_blocks.py as written. An HTML
comment on the line before a fence says what a block needs:

    <!-- doc-test: skip="reason" -->   not run here, and why (where it runs instead)
    <!-- doc-test: needs=torch -->     run where the package imports (skipped, naming it, elsewhere)
    <!-- doc-test: wheel -->           runs from the repository root with a fresh HOME (it installs
                                       the wheel itself): make test-docs-wheel

Python blocks of one page run in order in one interpreter (a later block may use an earlier
one's names), with $TENSORSHM_SOCKET naming a daemon started for the page.
"""

from __future__ import annotations

import pathlib
import re
import shlex
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOT_CODE = {"text", "console"}


class Block(NamedTuple):
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    options: dict[str, str]

    @property
    def label(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[pathlib.Path]:
    docs = sorted(p for p in (ROOT / "docs").glob("*.md"))
    return [ROOT / "README.md", *docs]


def parse(path: pathlib.Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = re.match(r"^( *)(```+)(.*)$", lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, info = len(opening.group(1)), opening.group(2), opening.group(3).strip()
        start = i
        body = []
        i += 1
        while i < len(lines) and not re.match(rf"^ *{fence}\s*$", lines[i]):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1
        options: dict[str, str] = {}
        before = lines[start - 1].strip() if start > 0 else ""
        comment = re.match(r"^<!-- doc-test: (.*) -->$", before)
        if comment:
            for word in shlex.split(comment.group(1)):
                key, _, value = word.partition("=")
                options[key] = value
        language = info.split()[0] if info else ""
        blocks.append(Block(str(path.relative_to(ROOT)), start + 1, language,
                            "\n".join(body) + "\n", options))
    return blocks


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in parse(p)]
