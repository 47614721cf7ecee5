# Sphinx configuration of the documentation site: `make docs` (scripts/build-docs.sh) builds it
# into build/docs/html, with warnings as errors and every cross-reference and internal link
# checked. Pages are Markdown (MyST); the Python API comes from the installed package's
# docstrings (autodoc), the C and C++ API from the public headers' comments (Doxygen XML, read
# by Breathe).
from __future__ import annotations

import os
import pathlib
import re
import xml.etree.ElementTree as ET

import tensorshm
from sphinx.util import logging

logger = logging.getLogger(__name__)

ROOT = pathlib.Path(__file__).resolve().parent.parent

project = "tensorshm"
author = "the tensorshm authors"
copyright = "the tensorshm authors"
release = tensorshm.__version__
version = release

extensions = ["myst_parser", "sphinx.ext.autodoc", "breathe"]

root_doc = "index"
source_suffix = {".md": "markdown"}
# What in docs/ is not a page. Every .md file that is one must be in a toctree (Sphinx warns of
# one that is not, and a warning fails the build).
exclude_patterns = ["Doxyfile", "conf.py", "_build", "build", "**/.*"]

html_theme = "alabaster"
html_title = f"tensorshm {release}"
html_static_path: list[str] = []
html_show_sourcelink = False
# Curly quotes, nothing else: `--flag` in prose stays two hyphens (as the daemon spells it), and
# `tuple[int, ...]` in a type keeps its three dots.
smartquotes_action = "q"

# Every warning fails the build (sphinx-build -W), and -n (nitpicky) makes every reference that
# does not resolve one. Markdown links to .md pages and to their headings' anchors are checked
# as cross-references: [x](daemon.md#some-heading) must name a page and one of its headings.
nitpicky = True
myst_heading_anchors = 6

# The Python API (docs/api/python.md): the package as installed in .venv (`make python`), so
# that the extension module is there.
autodoc_member_order = "groupwise"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": True}

# The C and C++ API (docs/api/cpp.md, docs/api/c.md): Doxygen's XML of include/tensorshm/*.h,
# made by scripts/build-docs.sh (docs/Doxyfile).
breathe_projects = {
    "tensorshm": os.environ.get("TSM_DOXYGEN_XML", str(ROOT / "build/docs/doxygen/xml")),
}
breathe_default_project = "tensorshm"
# tensorshm.h is the C API (Sphinx's C domain), client.h and status.h the C++ API.
breathe_domain_by_file_pattern = {"*/tensorshm.h": "c", "*/client.h": "cpp", "*/status.h": "cpp"}
breathe_show_include = False

# Types from outside this project in the C and C++ declarations: abseil's, the standard
# library's, DLPack's (dlpack/dlpack.h) and the fixed-width integers. Their documentation is not
# part of this site (intersphinx would need the network): references to them stay unresolved on
# purpose, and are named here so that -n does not flag them. (Python's builtins and typing's names
# in annotations Sphinx knows without help.)
nitpick_ignore_regex = [
    (r"cpp:identifier", r"(absl|std)(::.*)?"),
    # std::chrono's, through the tensorshm::Duration alias (Duration::zero(), Duration::max()).
    (r"cpp:identifier", r"Duration::(zero|max)"),
    (r"c(pp)?:identifier", r"u?int(8|16|32|64)_t|k?DL[A-Za-z]*"),
]


def _public_name(target: str) -> str | None:
    """tensorshm.Name for a name that a private module defines and the package exports
    (``tensorshm._tensorshm.Tensor``, ``_client.Client``), else None."""
    m = re.fullmatch(r"(?:tensorshm\.)?_[a-z_]+\.([A-Za-z_][A-Za-z0-9_]*)", target)
    if m and m.group(1) in vars(tensorshm) and not m.group(1).startswith("_"):
        return "tensorshm." + m.group(1)
    return None


def _resolve_private_module(app, env, node, contnode):
    """Annotations name the classes by where they are defined (tensorshm._tensorshm.Tensor);
    they are documented under the package, where users reach them (tensorshm.Tensor)."""
    if node.get("refdomain") != "py":
        return None
    public = _public_name(node.get("reftarget", ""))
    if public is None:
        return None
    domain = env.get_domain("py")
    return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], public, node,
                               contnode)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _examples_as_code(app, what, name, obj, options, lines):
    """The docstrings set examples off as an indented block after a blank line (as the package
    docstring does), which reST reads as a block quote and runs together: make each a literal
    block (a lone "::" paragraph before it, which reST drops)."""
    i = 1
    while i < len(lines):
        prev = next((p for p in reversed(lines[:i - 1]) if p.strip()), None)
        if (not lines[i - 1].strip() and lines[i].strip() and prev is not None
                and _indent(lines[i]) > _indent(prev) and not prev.rstrip().endswith("::")):
            lines[i:i] = [" " * _indent(prev) + "::", ""]
            i += 2
        i += 1


# A nanobind property with no docstring of its own has its getter's signature for one:
# "(self) -> str", or "shape(self, /) -> tuple[int, ...]", which autodoc takes for the property's
# signature (and, a property having none, would print whole as its name).
_NANOBIND_GETTER = re.compile(r"(?:\w+)?\(self(?:, /)?\) -> (.+)")
_getter_types: dict[str, str] = {}


def _signature(app, what, name, obj, options, signature, return_annotation):
    """A property's type found in its docstring (see above) goes to the docstring hook below.
    A class whose constructor takes one of the package's private types (Client, made by
    connect() around the extension's handle) is not constructed by users: no signature."""
    if what == "property" and return_annotation:
        _getter_types[name] = return_annotation
        return "", ""
    if what == "class" and signature and re.search(r"(?<!\w)_[A-Za-z]\w*", signature):
        return "", return_annotation
    return None


def _nanobind_property_type(app, what, name, obj, options, lines):
    """Shows a nanobind property's getter signature as the type the property returns."""
    if what != "property":
        return
    m = _NANOBIND_GETTER.fullmatch(lines[0].strip()) if lines else None
    if m:
        del lines[0]
    rtype = m.group(1) if m else _getter_types.pop(name, None)
    if rtype:
        lines[:] = lines + ["", f":rtype: {rtype}"]


def _public_api() -> dict[str, set[str]]:
    """What the API pages must document, by Sphinx domain: the Python package's exports, and
    each class, struct, namespace member and C declaration that Doxygen found in the public
    headers (include/tensorshm/export.h's macro aside: it is how the library is built)."""
    python = {f"tensorshm.{name}" for name in tensorshm.__all__}
    # Left out of __all__ (they would shadow builtins on `import *`), public all the same.
    python |= {"tensorshm.ConnectionError", "tensorshm.PermissionError", "tensorshm.TimeoutError"}
    native: set[str] = set()
    index = ET.parse(pathlib.Path(breathe_projects["tensorshm"]) / "index.xml").getroot()
    for compound in index.iter("compound"):
        kind, name = compound.get("kind"), compound.findtext("name")
        if kind in ("class", "struct"):
            native.add(name)
        elif kind == "namespace" and name == "tensorshm" or kind == "file" and name != "export.h":
            prefix = "tensorshm::" if kind == "namespace" else ""
            enum = ""  # a namespace's enumerators follow their enum, and go by its name
            for member in compound.iter("member"):
                if member.get("kind") == "enum" and kind == "namespace":
                    enum = member.findtext("name") + "::"
                if member.get("kind") == "enumvalue":
                    native.add(prefix + enum + member.findtext("name"))
                elif member.get("kind") in ("function", "typedef", "variable", "define"):
                    native.add(prefix + member.findtext("name"))
    return {"py": python, "native": native}


def _check_api_pages_complete(app, env):
    """Fails the build (a warning, under -W) when an API page leaves out part of the public API,
    e.g. a function added to a header or a class added to __all__. Only for the site itself
    (scripts/build-docs.sh also builds throwaway sites with this configuration)."""
    if pathlib.Path(app.srcdir).resolve() != pathlib.Path(app.confdir).resolve():
        return
    documented = {"py": {o[0] for o in env.get_domain("py").get_objects()}, "native": set()}
    for domain in ("c", "cpp"):
        for obj in env.get_domain(domain).get_objects():
            documented["native"].add(re.sub(r"^@\w+\.", "", obj[0]))  # anonymous enum: @0.X
    for domain, expected in _public_api().items():
        for name in sorted(expected - documented[domain]):
            logger.warning("API reference: %s is public but on no page of docs/api/", name)


def setup(app):
    app.connect("env-check-consistency", _check_api_pages_complete)
    app.connect("missing-reference", _resolve_private_module)
    app.connect("autodoc-process-docstring", _examples_as_code)
    app.connect("autodoc-process-docstring", _nanobind_property_type)
    app.connect("autodoc-process-signature", _signature)
