"""One node's side of a bench/ship.py method, in a process of its own, on its node's tensorshmd:

    python bench/ship_node.py nixl|nixl-tcp|mover-grpc|grpc SOCKET

serves the method (a tensorshm.transfer.Mover proving the fleet token in $TSM_MOVER_TOKEN, or a
gRPC server streaming a tensor's bytes),
prints `ready ADDRESS`, then runs JSON commands read from stdin, one a line, answering each with
one line `answer JSON` (UCX writes its own lines to stdout too):

    {"op": "ship", "peer": ADDRESS, "name": NAME}
    -> {"ok": true, "seconds": S} or {"ok": false, "error": "...", "message": "..."}

A ship brings NAME from the node serving at ADDRESS into this node's daemon, published as NAME;
S runs from the first request to the peer until it is published (and, for nixl, the peer told).
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent import futures

import numpy as np

import tensorshm

CHUNK = 4 << 20  # bytes per message of the gRPC stream
STREAM = "/tensorshm.bench.Bytes/Stream"  # one server-streaming method, bytes in and out
GRPC_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


class StreamNode:
    """The gRPC row: serves Stream (request: a name; replies: a JSON header with the dtype and
    shape, then the tensor's bytes in CHUNK-sized messages) and ships by calling a peer's."""

    def __init__(self, socket: str) -> None:
        import grpc

        self.client = tensorshm.connect(socket)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                                   options=GRPC_OPTIONS)
        handler = grpc.unary_stream_rpc_method_handler(self._stream)  # no (de)serializers: bytes
        service, method = STREAM[1:].split("/")
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {method: handler}),))
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()
        self._channels: dict[str, grpc.Channel] = {}
        self._grpc = grpc

    def _stream(self, request: bytes, context: object):
        with self.client.get(request.decode()) as tensor:
            yield json.dumps({"dtype": tensor.dtype, "shape": list(tensor.shape)}).encode()
            data = np.from_dlpack(tensor).reshape(-1).view(np.uint8)
            for start in range(0, data.nbytes, CHUNK):
                yield data[start:start + CHUNK].tobytes()  # the copy a bytes message needs

    def ship(self, peer: str, name: str) -> str:
        channel = self._channels.get(peer)
        if channel is None:
            channel = self._channels[peer] = self._grpc.insecure_channel(peer,
                                                                          options=GRPC_OPTIONS)
        replies = channel.unary_stream(STREAM)(name.encode(), timeout=120)
        header = json.loads(next(replies))
        tensor = self.client.create(header["shape"], header["dtype"])
        try:
            data = np.from_dlpack(tensor).reshape(-1).view(np.uint8)
            filled = 0
            for chunk in replies:
                data[filled:filled + len(chunk)] = np.frombuffer(chunk, np.uint8)
                filled += len(chunk)
            if filled != data.nbytes:
                raise RuntimeError(f"{name}: {filled} bytes came, {data.nbytes} expected")
            tensor.publish(name)
        finally:
            tensor.release()
        return name

    def close(self) -> None:
        self._server.stop(grace=None)
        for channel in self._channels.values():
            channel.close()
        self.client.close()


def main() -> int:
    method, socket = sys.argv[1], sys.argv[2]
    if method in ("nixl", "nixl-tcp", "mover-grpc"):
        from tensorshm.transfer import Mover

        # The fleet token ship.py wrote (mode 0600) for this run.
        node = Mover(socket, token_file=os.environ["TSM_MOVER_TOKEN"],
                     allow_tcp_rma=method == "nixl-tcp",
                     transport="grpc" if method == "mover-grpc" else "auto")
        ship = node.pull
    else:
        node = StreamNode(socket)
        ship = node.ship
    try:
        print(f"ready {node.address}", flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            try:
                start = time.perf_counter()
                ship(command["peer"], command["name"])
                answer = {"ok": True, "seconds": time.perf_counter() - start}
            except Exception as e:  # every failure goes back to the driver, named
                answer = {"ok": False, "error": type(e).__name__, "message": str(e)}
            print("answer", json.dumps(answer), flush=True)
    finally:
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
