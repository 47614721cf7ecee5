#!/usr/bin/env python3
"""Fails when libtensorshm.so exports anything but its API, or ties its users to another
library's ABI.

Allowed in the dynamic symbol table (`nm -D --defined-only`):
  - the C API: the tsm_* functions include/tensorshm/tensorshm.h marks TENSORSHM_EXPORT;
  - the C++ API: members of the classes and the functions include/tensorshm/client.h marks
    TENSORSHM_EXPORT, with the typeinfo and vtables of those classes.
Anything else (protobuf, gRPC stubs, ClientCore and the rest of the client's internals, template
instances of std:: or absl:: types) fails the check, and so do more than MAX_SYMBOLS symbols.
The library's own ABI: it NEEDS no libabsl (abseil is linked in, hidden), no public header
includes or names abseil, and the pkg-config file (PC, when given) requires nothing.

    python3 tests/exports/check_exports.py ROOT LIBTENSORSHM [NM [PC]]
    python3 tests/exports/check_exports.py --self-test ROOT
"""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

MAX_SYMBOLS = 150


def public_api(root: pathlib.Path) -> tuple[set[str], set[str]]:
    """The exported C functions, and the exported C++ classes and functions (unqualified)."""
    include = root / "include" / "tensorshm"
    c_header = (include / "tensorshm.h").read_text()
    c_functions = set(re.findall(r"TENSORSHM_EXPORT[^;(]*?\b(tsm_\w+)\s*\(", c_header))
    cpp_header = "\n".join(header.read_text() for header in sorted(include.glob("*.h"))
                           if header.name != "tensorshm.h")
    classes = set(re.findall(
        r"\b(?:class|struct)\s+(?:\[\[\w+\]\]\s+)?TENSORSHM_EXPORT\s+(\w+)", cpp_header))
    functions = set(re.findall(r"^TENSORSHM_EXPORT\s+[^;(]*?\b(operator\W+?|\w+)\s*\(",
                               cpp_header, re.M))
    return c_functions, classes | functions


def abi_problems(root: pathlib.Path, library: str, pc: str | None) -> list[str]:
    """What ties a user of the library to abseil's ABI: a NEEDED libabsl, a public header that
    includes or names abseil, a pkg-config Requires."""
    problems = []
    dynamic = subprocess.run(["readelf", "-d", library], check=True, capture_output=True,
                             text=True).stdout
    for needed in re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic):
        if needed.startswith("libabsl"):
            problems.append(f"NEEDED {needed}")
    for header in sorted((root / "include" / "tensorshm").glob("*.h")):
        for number, line in enumerate(header.read_text().splitlines(), 1):
            if re.search(r"\babsl\b", line):
                problems.append(f"{header.name}:{number} names abseil: {line.strip()}")
    if pc is not None:
        for line in pathlib.Path(pc).read_text().splitlines():
            if re.match(r"Requires(\.private)?\s*:\s*\S", line):
                problems.append(f"{pc}: {line}")
    return problems


def problems_in(symbols: list[str], c_functions: set[str], cpp_names: set[str]) -> list[str]:
    """The demangled `symbols` that are not part of the API."""
    names = "|".join(sorted(re.escape(name) for name in cpp_names)) or "(?!)"
    cpp = re.compile(
        rf"^(?:(?:typeinfo|typeinfo name|vtable) for )?tensorshm::(?:{names})(?:::|\(|$)")
    problems = []
    for symbol in symbols:
        if symbol in c_functions or cpp.match(symbol):
            continue
        problems.append(symbol)
    return problems


def exported(library: str, nm: str) -> list[str]:
    out = subprocess.run([nm, "-D", "--defined-only", "-C", library], check=True,
                         capture_output=True, text=True).stdout
    symbols = []
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3:
            symbols.append(parts[2])
    return symbols


def check(root: pathlib.Path, library: str, nm: str, pc: str | None) -> int:
    c_functions, cpp_names = public_api(root)
    if not c_functions or not cpp_names:
        print(f"no TENSORSHM_EXPORT declarations found under {root}/include/tensorshm")
        return 1
    symbols = exported(library, nm)
    problems = problems_in(symbols, c_functions, cpp_names)
    for symbol in problems[:50]:
        print(f"exported but not API: {symbol}")
    if len(problems) > 50:
        print(f"... and {len(problems) - 50} more")
    missing = sorted(f for f in c_functions if f not in symbols)
    for name in missing:
        print(f"C API function not exported: {name}")
    abi = abi_problems(root, library, pc)
    for problem in abi:
        print(f"not the library's own ABI: {problem}")
    print(f"{library}: {len(symbols)} dynamic symbols (at most {MAX_SYMBOLS}), "
          f"{len(problems)} not API, {len(missing)} C API functions missing, "
          f"{len(abi)} ties to abseil")
    return 1 if problems or missing or abi or len(symbols) > MAX_SYMBOLS else 0


def self_test(root: pathlib.Path) -> int:
    """The classifier must refuse planted internal symbols and accept API ones."""
    c_functions, cpp_names = public_api(root)
    api = ["tsm_connect", "tensorshm::Client::Flush()", "typeinfo for tensorshm::WritableTensor",
           "tensorshm::WaitReady(DLManagedTensorVersioned const*, tensorshm::ReadySync)",
           "tensorshm::Status::ToString[abi:cxx11]() const",
           "tensorshm::operator<<(std::ostream&, tensorshm::Status const&)"]
    planted = ["google::protobuf::Message::~Message()", "tensorshm::ClientCore::Flush()",
               "tensorshm::v1::AcquireRequest::Clear()", "typeinfo for tensorshm::v1::Location",
               "tensorshm::ClientFoo()", "tsm_internal_helper",
               "std::vector<long, std::allocator<long> >::_M_realloc_insert()"]
    refused = problems_in(api + planted, c_functions, cpp_names)
    if refused != planted:
        print(f"self-test FAILED: refused {refused}, expected {planted}")
        return 1
    print(f"self-test passed: {len(planted)} planted symbols refused, {len(api)} API symbols "
          f"accepted (API: {len(c_functions)} C functions, {sorted(cpp_names)})")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--self-test":
        sys.exit(self_test(pathlib.Path(sys.argv[2])))
    if len(sys.argv) not in (3, 4, 5):
        print(__doc__)
        sys.exit(2)
    sys.exit(check(pathlib.Path(sys.argv[1]), sys.argv[2],
                   sys.argv[3] if len(sys.argv) >= 4 else "nm",
                   sys.argv[4] if len(sys.argv) == 5 else None))
