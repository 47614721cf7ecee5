"""One node's mover in a process of its own, for tests/multinode: `node.py SOCKET [OPTIONS]`
(OPTIONS: a JSON object of tensorshm.transfer.Mover keyword arguments) prints `ready ADDRESS`
once its Mover serves, then runs JSON commands read from stdin, one a line, answering each with
one line `answer JSON` (UCX writes its own log lines to stdout too):

    {"op": "pull", "peer": ADDRESS, "name": NAME, "as": NAME|null, "timeout": SECONDS}
    {"op": "push", ...}  {"op": "pull_prefix", "peer": ADDRESS, "prefix": P, "timeout": S}
    {"op": "state"} -> {"holds": N, "registrations": N, "nixl": BOOL}
    -> {"ok": true, "result": ...} or {"ok": false, "error": "NotFoundError", "message": "..."}
"""

import json
import sys

from tensorshm.transfer import Mover


def main() -> int:
    socket = sys.argv[1]
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    with Mover(socket, **options) as mover:
        print(f"ready {mover.address}", flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            try:
                if command["op"] == "state":
                    result = {"holds": mover.holds, "registrations": mover.registrations,
                              "nixl": mover.nixl}
                elif command["op"] == "pull_prefix":
                    result = mover.pull_prefix(command["peer"], command["prefix"],
                                               timeout=command.get("timeout"))
                else:
                    ship = mover.pull if command["op"] == "pull" else mover.push
                    result = ship(command["peer"], command["name"], command.get("as"),
                                  timeout=command.get("timeout"))
                answer = {"ok": True, "result": result}
            except Exception as e:  # every failure goes back to the test, named
                answer = {"ok": False, "error": type(e).__name__, "message": str(e)}
            print("answer", json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
