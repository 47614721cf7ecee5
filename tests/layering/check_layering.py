#!/usr/bin/env python3
"""Fails when a source file includes a header of a room it may not depend on.

The rooms, and what each may include besides itself (the house's floors; docs/development.md, "Layout"):

    server (main.cc, daemon.cc): every server room
    server/rpc      gRPC service, session reactor, memory-channel service, listener
    server/core     sessions and access rules
    server/catalog  tensor table, records, recovery, index, lease board, eviction
    server/memory   pools, allocator, segments
    server/ops      options, config file, log, metrics
    common/shm      the shared-memory formats
    common/tensor   dtype, layout, names, wire conversions
    common/cuda     the CUDA driver loader
    common/base     mutex, checks, system errors, sockets, locks

Each server room may include the rooms below it (rpc -> core -> catalog -> memory -> ops ->
common). client/ may include common/ and include/tensorshm/, never server/; the daemon never
includes client/. Public headers (include/tensorshm/) include only each other. tools/ctl uses
the public API and common/, and of the client library only client/admin.h.

The daemon's state and rules (server/rpc, server/core, server/catalog, server/memory) read no
environment variable: what they need, test hooks included, comes through their constructors
from the daemon (server/daemon.cc, server/ops' options).

The Store and what it stands on (server/core, server/catalog, server/memory, server/ops) know no
wire format: they include no generated message header and no conversion to messages
(common/tensor/wire.h, grpc_status.h). server/rpc's adapters translate (docs/design.md).

    python3 tests/layering/check_layering.py [ROOT]
    python3 tests/layering/check_layering.py --self-test   (it must catch a planted violation)
"""
from __future__ import annotations

import pathlib
import re
import sys

COMMON = ["common/shm", "common/tensor", "common/cuda", "common/base"]
COMMON_BELOW = {
    "common/shm": ["common/tensor", "common/base"],
    "common/tensor": ["common/base"],
    "common/cuda": ["common/base"],
    "common/base": [],
}
SERVER = ["server/rpc", "server/core", "server/catalog", "server/memory", "server/ops"]
PUBLIC = "include/tensorshm"
# The one client header tensorshmctl may include besides the public API.
ADMIN = "client/admin.h"
# Rooms that may not call getenv (see the docstring).
NO_ENVIRONMENT = ("server/rpc", "server/core", "server/catalog", "server/memory")
GETENV = re.compile(r"\b(?:secure_)?getenv\s*\(")
# Rooms that may not see the wire's messages (see the docstring), and the headers that bring them.
NO_WIRE = ("server/core", "server/catalog", "server/memory", "server/ops")
WIRE_HEADERS = ("common/tensor/wire.h", "common/tensor/grpc_status.h")
# Generated protobuf headers are a dependency of common/tensor (wire) and up, like a library.
GENERATED = ("tensorshm/v1/",)


def allowed(room: str) -> list[str]:
    """The rooms `room` may include from, itself included."""
    if room in COMMON_BELOW:
        return [room, *COMMON_BELOW[room]]
    if room in SERVER:
        return SERVER[SERVER.index(room):] + COMMON + [PUBLIC]
    if room == "server":
        return ["server", *SERVER, *COMMON, PUBLIC]
    if room == PUBLIC:
        return [PUBLIC]
    if room in ("client", "python/src", "bench"):
        return list(dict.fromkeys([room, "client", ADMIN, *COMMON, PUBLIC]))
    if room == "tools/ctl":
        return [room, *COMMON, PUBLIC, ADMIN]
    raise KeyError(room)


def room_of(path: str) -> str | None:
    for room in [*SERVER, *COMMON, PUBLIC, "python/src", "tools/ctl"]:
        if path.startswith(room + "/"):
            return room
    for room in ("server", "client", "bench"):
        if path.startswith(room + "/"):
            return room
    return None


def header_room(include: str) -> str | None:
    if include.startswith(GENERATED):
        return "generated"
    if include == ADMIN:
        return ADMIN
    if include.startswith("tensorshm/"):
        return PUBLIC
    return room_of(include)


def check(root: pathlib.Path) -> int:
    include_line = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
    problems, checked = [], 0
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".h", ".cc", ".c") or not path.is_file():
            continue
        relative = path.relative_to(root).as_posix()
        if relative.startswith(("build", "tests/", ".venv", "third_party/")):
            continue
        room = room_of(relative)
        if room is None:
            continue
        checked += 1
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if room in NO_ENVIRONMENT and GETENV.search(line.split("//")[0]):
                problems.append(f"{relative}:{number}: {room} reads the environment (getenv): "
                                f"pass the value through a constructor from server/daemon.cc")
            match = include_line.match(line)
            if not match:
                continue
            target = header_room(match.group(1))
            if room in NO_WIRE and (target == "generated" or match.group(1) in WIRE_HEADERS):
                problems.append(f"{relative}:{number}: {room} includes {match.group(1)}, a wire "
                                f"format: take and return the Store's own types; server/rpc "
                                f"translates")
                continue
            if target is None or target == "generated":
                continue
            if target not in allowed(room):
                problems.append(f"{relative}:{number}: {room} includes {match.group(1)} "
                                f"({target}), which it may not: {room} may include "
                                f"{', '.join(allowed(room))}")
    for problem in problems:
        print(problem)
    if checked == 0:
        print(f"no source files under {root}: nothing was checked")
        return 1
    print(f"layering: {checked} files checked, {len(problems)} problems (includes against the "
          f"rooms' order, environment reads, wire formats below server/rpc)")
    return 1 if problems else 0


def self_test() -> int:
    """A tree with one include of each kind the rules forbid, and one they allow."""
    import tempfile

    planted = {
        "server/memory/pool.cc": '#include "server/catalog/catalog.h"\n',  # upward
        "client/client.cc": '#include "server/ops/log.h"\n',                # client -> server
        "include/tensorshm/client.h": '#include "client/fork.h"\n',          # public -> private
        "common/base/check.h": '#include "common/shm/layout.h"\n',           # base -> shm
        "tools/ctl/health.cc": '#include "client/daemon_connection.h"\n',  # ctl -> private
        "server/core/store.cc": 'const char* v = std::getenv("X");\n',      # environment
        "server/core/grants.cc": '#include "tensorshm/v1/tensorshm.pb.h"\n',  # wire in core
        "server/catalog/list.cc": '#include "common/tensor/wire.h"\n',  # wire below core
        "server/rpc/service.cc": '#include "server/memory/pool.h"\n',       # allowed
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in planted.items():
            path = pathlib.Path(tmp, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = check(pathlib.Path(tmp))
    report = out.getvalue()
    print(report, end="")
    caught = [name for name in planted if report.count(name + ":") == 1]
    expected = [name for name in planted if name != "server/rpc/service.cc"]
    if code != 1 or caught != expected:
        print(f"self-test FAILED: exit {code}, caught {caught}, expected {expected}")
        return 1
    print("self-test passed: every planted violation was caught, the allowed include was not")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    sys.exit(check(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()))
