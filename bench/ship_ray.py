"""The Ray row of bench/ship.py, in a process of its own: a two-node Ray cluster on this machine
(ray.cluster_utils.Cluster on 127.0.0.1: a head node with resource node_a, a second node with
node_b, each its own raylet and object store), an actor on each node, each a tensorshm client of
its node's daemon.

    python bench/ship_ray.py SOCKET_A SOCKET_B OBJECT_STORE_BYTES

prints `ready -`, then answers `{"op": "ship", "name": NAME}` lines on stdin as
bench/ship_node.py does: the actor on A acquires NAME from A's daemon and ray.put()s it (a numpy
view of the shared memory), the actor on B ray.get()s the ref and client.put()s the array into
B's daemon as NAME; S runs from the ray.put until B's publish is known on A. The answer carries
the nodes holding the object after B's get (`object_nodes`) and both actors' node ids.

Run with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in the environment: node IP lookups answer
127.0.0.1 then, keeping every Ray process on loopback (bench/ship.py sets it).
"""

from __future__ import annotations

import json
import logging
import sys
import time

import numpy as np
import ray
from ray.cluster_utils import Cluster


@ray.remote(num_cpus=0, resources={"node_a": 1})
class Source:
    def __init__(self, socket: str) -> None:
        import tensorshm

        self.client = tensorshm.connect(socket)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def ship(self, sink, name: str) -> tuple[float, list[str]]:
        with self.client.get(name) as tensor:
            array = np.from_dlpack(tensor)
            start = time.perf_counter()
            ref = ray.put(array)  # copies the bytes into A's object store
            ray.get(sink.store.remote([ref], name))  # in a list: B gets the ref, not the value
            seconds = time.perf_counter() - start
            del array
        located = ray.experimental.get_object_locations([ref])[ref]["node_ids"]
        del ref
        return seconds, located


@ray.remote(num_cpus=0, resources={"node_b": 1})
class Sink:
    def __init__(self, socket: str) -> None:
        import tensorshm

        self.client = tensorshm.connect(socket)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def store(self, refs: list, name: str) -> None:
        array = ray.get(refs[0])  # B's raylet pulls the object into B's store; a view of it
        self.client.put(name, array).release()  # the copy into B's daemon, published
        del array


def main() -> int:
    socket_a, socket_b, store_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    common = {"num_cpus": 1, "object_store_memory": store_bytes, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={
        **common, "resources": {"node_a": 1}, "include_dashboard": False})
    cluster.add_node(**common, resources={"node_b": 1})
    ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        source, sink = Source.remote(socket_a), Sink.remote(socket_b)
        nodes = {"source_node": ray.get(source.node.remote()),
                 "sink_node": ray.get(sink.node.remote())}
        print("ready -", flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            try:
                seconds, located = ray.get(source.ship.remote(sink, command["name"]))
                answer = {"ok": True, "seconds": seconds, "object_nodes": located, **nodes}
            except Exception as e:  # every failure goes back to the driver, named
                answer = {"ok": False, "error": type(e).__name__, "message": str(e)}
            print("answer", json.dumps(answer), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
