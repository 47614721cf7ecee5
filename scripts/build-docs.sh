#!/usr/bin/env bash
# Builds the documentation site into OUT/html (default OUT: build/docs), as `make docs` does:
# Doxygen XML of the public headers (include/tensorshm/*.h, docs/Doxyfile), then Sphinx over
# docs/ (Markdown through MyST, the Python API through autodoc of the installed package, the C and
# C++ API through Breathe) with every warning an error, every cross-reference checked (-n) and
# every internal link (page, #anchor) resolved; docs/conf.py also fails it when an API page leaves
# out part of the public API. Then a self-test: a throwaway site with broken internal links, built
# with docs/conf.py, must fail, naming each link (and the same site with the links mended must
# build), so that a broken link in docs/ cannot pass unnoticed.
#
# Needs tensorshm importable from .venv (`make python`) and Sphinx, MyST and Breathe there
# (scripts/requirements-docs.txt), and Doxygen (Debian's package, which scripts/setup.sh installs).
#
# `build-docs.sh --doxygen-filter FILE` is Doxygen's INPUT_FILTER (docs/Doxyfile): see below.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV_PY=${VENV_PY:-.venv/bin/python}

# Doxygen reads only `///`, `//!`, `/** */` and `/*! */` comments as documentation; the public
# headers are written with plain `//` and `/* */` comments, each above (or beside) what it
# documents. The filter hands Doxygen each header with those comments made doc comments, line for
# line (so Doxygen's line numbers are the header's):
#   `// text` on a line of its own    -> `/// text`    (documents the declaration below)
#   `decl;  // text`, `enumerator,  // text` -> `///< text`  (documents the one beside)
#   `/* text */` on lines of their own -> `/** text */`; `decl; /* text */` -> `/**< text */`
#   the comment opening the file (line 1) documents the file (`\file` at the end of its line)
#   `//` lines indented 3+ spaces are an example: a C++ code block (\code{.cpp} at the end of
#   the line before, \endcode at the end of its last line)
#   the text is plain text: outside backticks, what Doxygen reads as markup (\cmd, @cmd, #name,
#   %name, <tag>, and -- as an en dash) is escaped (\\cmd, \@cmd, \#name, \%name, \<tag\>, \--).
# Preprocessor lines (`#endif  // X_H_`) and closing braces are left alone.
if [ "${1:-}" = --doxygen-filter ]; then
  exec "$VENV_PY" - "$2" <<'PY'
import re
import sys

path = sys.argv[1]
with open(path, encoding="utf-8") as f:
    lines = f.read().split("\n")


def text(s):
    """Comment text as plain text, outside `code spans`: what Doxygen would take for a command
    (backslash, @), a link request (#name), an autolink suppressor (%name), HTML (<b>) or a dash
    (--, ---) escaped."""
    parts = s.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"[\\@#%<>]|(?<!-)-{2,3}(?!-)", lambda m: "\\" + m.group(0), parts[i])
    return "`".join(parts)


# A declaration or enumerator that a trailing comment may document: not a preprocessor line, not
# a closing brace, ending in ';' or ','.
DECL = r"\s*[^\s#/}][^/]*?[;,]"
out = []
in_c = False  # inside a /* */ comment that began on an earlier line
in_code = False  # inside an example (`//` lines indented 3+ spaces)
for n, line in enumerate(lines):
    file_doc = " \\file" if n == 0 else ""
    code = re.fullmatch(r"\s*//   .*", line) and out and re.match(r"\s*///", out[-1])
    if code and not in_code:
        out[-1] += " \\code{.cpp}"
    elif in_code and not code:
        out[-1] += " \\endcode"
    in_code = bool(code)
    if in_c:
        body, end, rest = line.partition("*/")
        in_c = not end
        out.append(text(body) + (file_doc + end + rest if end else ""))
        continue
    m = re.fullmatch(r"(\s*)//(?![/!])(.*)", line)
    if m:
        body = m.group(2) if code else text(m.group(2))
        out.append(m.group(1) + "///" + body + file_doc)
        continue
    m = re.fullmatch(r"(\s*)/\*(?![*!])(.*)", line) or re.fullmatch(
        r"(" + DECL + r"\s+)/\*(?![*!<])(.*)", line)
    if m:
        opener = "/**" if not m.group(1).strip() else "/**<"
        body, end, rest = m.group(2).partition("*/")
        in_c = not end
        out.append(m.group(1) + opener + text(body) + file_doc + end + rest)
        continue
    m = re.fullmatch(r"(" + DECL + r"\s+)//(?![/!<])(.*)", line)
    if m:
        out.append(m.group(1) + "///<" + text(m.group(2)))
        continue
    out.append(line)
sys.stdout.write("\n".join(out))
PY
fi

OUT=${1:-build/docs}
JOBS=${JOBS:-2}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if ! command -v doxygen >/dev/null; then
  echo "docs: doxygen is missing: make docs installs it (scripts/setup.sh)" >&2
  exit 1
fi

# Doxygen's XML is read by Breathe (docs/conf.py finds it through TSM_DOXYGEN_XML). Made anew
# each time: a header's removed declaration must not live on in a stale XML file.
rm -rf "$OUT/doxygen"
mkdir -p "$OUT/doxygen"
echo "docs: doxygen (include/tensorshm/*.h) -> $OUT/doxygen/xml"
TSM_DOXYGEN_OUT="$OUT/doxygen" VENV_PY="$VENV_PY" doxygen docs/Doxyfile
export TSM_DOXYGEN_XML="$OUT/doxygen/xml"

# -W --keep-going: every warning is reported, and any fails the build. -n: every cross-reference
# (a Python type in a signature, a C++ type in a declaration, a MyST link) must resolve. -E: every
# page read anew, so that each run reports every page's warnings (not only a changed page's), and
# the API pages follow the new XML (Breathe does not track it). A few seconds in all.
SPHINX=("$VENV_PY" -m sphinx -E -W --keep-going -n -q -j "$JOBS")
echo "docs: sphinx-build docs -> $OUT/html"
rm -rf "$OUT/html"  # no page of a guide since removed lives on
"${SPHINX[@]}" -b html -d "$OUT/doctrees" docs "$OUT/html"

# The self-test: docs/conf.py over a throwaway site (an index and two pages), first with links
# that resolve (it must build), then with three broken ones (it must fail, naming each).
selftest="$OUT/link-selftest"
rm -rf "$selftest"
mkdir -p "$selftest/src"
cat >"$selftest/src/index.md" <<'EOF'
# Link self-test

```{toctree}
target
links
```
EOF
cat >"$selftest/src/target.md" <<'EOF'
# Target

## A heading with `code`

Text.
EOF
page_of_links() {  # $1 a heading on another page, $2 a page, $3 a heading on this page
  cat >"$selftest/src/links.md" <<EOF
# Links

## Here

[a heading on another page]($1), [a page]($2), [a heading on this page]($3).
EOF
}
page_of_links target.md#a-heading-with-code target.md '#here'
"${SPHINX[@]}" -b html -c docs -d "$selftest/doctrees" "$selftest/src" "$selftest/html" \
  >"$selftest/good.log" 2>&1 || {
  cat "$selftest/good.log" >&2
  echo "docs: link self-test: a site whose links all resolve failed to build" >&2
  exit 1
}
broken=(target.md#no-such-heading no-such-page.md '#no-such-anchor')
page_of_links "${broken[@]}"
if "${SPHINX[@]}" -b html -c docs -d "$selftest/doctrees" "$selftest/src" "$selftest/html" \
    >"$selftest/broken.log" 2>&1; then
  echo "docs: link self-test: a site with broken internal links built without an error" >&2
  exit 1
fi
# Each broken link is reported by MyST as a missing cross-reference, naming what it lacks.
for missing in no-such-heading no-such-page.md no-such-anchor; do
  grep -F "myst.xref_missing" "$selftest/broken.log" | grep -qF -- "'$missing'" || {
    cat "$selftest/broken.log" >&2
    echo "docs: link self-test: the failed build did not name the broken link to $missing" >&2
    exit 1
  }
done
rm -rf "$selftest"
echo "docs: link self-test passed (broken page, anchor and local links fail the build)"
echo "docs: built $OUT/html/index.html"
