"""tensorshm.transfer: named tensors shipped between nodes' daemons over NIXL.

One :class:`Mover` per node: a client of that node's tensorshmd, a NIXL agent, and a gRPC server
(the ``Mover`` service of proto/tensorshm/v1/mover.proto) that other nodes' movers call. Shipping
a name from node A to node B (``mover_b.pull(a_address, name)``):

1. B asks A for the name (Offer). A acquires it (the lease keeps the bytes while they move),
   registers the segment with NIXL once, and answers with the layout and the NIXL descriptor of
   the bytes.
2. B creates an unpublished tensor of the same dtype, shape and strides in its own daemon and
   posts a one-sided NIXL READ of A's bytes straight into it: no byte passes through Python or a
   buffer between the two shared memories.
3. B publishes it under the name (or another) and tells A (Finish), which drops its lease.

``push`` is the other way round (A WRITEs into a buffer B prepared), and ``pull_prefix`` ships
every name under a prefix. Every step has a deadline; whatever fails, neither side keeps a lease,
an unpublished buffer or a pending transfer (the source drops a lease the caller never finishes
once its hold time passes).

The control channel is gRPC, or any other when the peer is a :class:`Peer`: its calls then go
through ``Peer.call`` into the other mover's :meth:`Mover.serve` (tensorshm.ray's movers, Ray
actors, call each other that way). Only the small messages travel on it, never the bytes.

Needs NIXL (``pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1``: the ``nixl`` package pulls
torch only for type hints) and grpcio; ``make test-multinode`` installs them.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import secrets
import socket as _socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Protocol

from . import _errors
from ._client import Client, connect
from ._nixl import Agent as _Agent

_SERVICE = "tensorshm.v1.Mover"
_POLL_SECONDS = 0.0005


# The Mover service's methods: name -> (handler, request message, reply message).
_METHODS = {
    "Offer": ("_offer", "OfferRequest", "OfferReply"),
    "Prepare": ("_prepare", "PrepareRequest", "PrepareReply"),
    "Finish": ("_finish", "FinishRequest", "FinishReply"),
    "List": ("_list", "ListRequest", "ListReply"),
}


class Peer(Protocol):
    """Another node's mover reached over a channel other than gRPC (``str(peer)`` names it in
    errors). ``call`` sends one Mover service call, the request serialized, to that mover's
    :meth:`Mover.serve` and returns the serialized reply; it raises the tensorshm error the peer
    raised, TimeoutError when no answer comes within `timeout` seconds, and ConnectionError when
    the peer cannot be reached."""

    def call(self, method: str, request: bytes, timeout: float) -> bytes: ...


@functools.cache
def _messages() -> dict[str, Any]:
    """The Mover service's message classes, built from the descriptor set the package carries
    (mover.binpb, made from proto/tensorshm/v1/mover.proto at build time)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    data = importlib.resources.files(__package__).joinpath("mover.binpb").read_bytes()
    pool = descriptor_pool.DescriptorPool()
    for proto in descriptor_pb2.FileDescriptorSet.FromString(data).file:
        pool.Add(proto)
    names = ("TensorLayout", "Endpoint", "OfferRequest", "OfferReply", "PrepareRequest",
             "PrepareReply", "FinishRequest", "FinishReply", "ListRequest", "ListReply")
    return {n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"tensorshm.v1.{n}"))
            for n in names}


@dataclass
class _Hold:
    """What the Mover keeps for a peer's transfer until Finish or `deadline`: a source's lease
    (pull; its reader's notification that the READ is done drops it too) or a destination's
    unpublished buffer (push: `name` is what Finish publishes it as)."""

    tensor: Any
    deadline: float
    name: str = ""
    replace: bool = False


def _layout(messages: dict[str, Any], tensor: Any, nbytes: int) -> Any:
    return messages["TensorLayout"](dtype=tensor.dtype, shape=list(tensor.shape),
                                    strides=list(tensor.strides), device=tensor.device,
                                    nbytes=nbytes)


class Mover:
    """A node's mover: ``Mover(socket)`` serves other nodes' movers on ``listen`` (host:port; port
    0 picks one, see :attr:`address`) and ships tensors from and to them. ``listen=None`` starts
    no gRPC server (``address`` is None): peers then reach it through :meth:`serve` only.

    ``socket``: this node's tensorshmd (default: as ``tensorshm.connect()``), or pass ``client``.
    ``timeout``: the default bound of one ship, in seconds. ``hold_seconds``: how long this mover
    keeps a lease or buffer for a peer that neither finishes nor notifies (it died).
    """

    def __init__(self, socket: str | None = None, *, listen: str | None = "127.0.0.1:0",
                 client: Client | None = None, timeout: float = 60.0,
                 hold_seconds: float = 120.0, name: str | None = None) -> None:
        import grpc

        self._grpc = grpc
        self._m = _messages()
        self.timeout = timeout
        self.hold_seconds = hold_seconds
        self._own_client = client is None
        self.client = connect(socket) if client is None else client
        self.name = name or f"tsm-mover-{_socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self._agent = _Agent(self.name)
        self._holds: dict[str, _Hold] = {}
        self._holds_lock = threading.Lock()
        self._wake = threading.Condition(self._holds_lock)
        self._closed = False
        self._poller = threading.Thread(target=self._poll_holds, name="tensorshm-mover-poll",
                                        daemon=True)
        self._poller.start()
        self._channels: dict[str, Any] = {}
        self._server = None
        self.address: str | None = None
        if listen is not None:
            self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
            self._server.add_generic_rpc_handlers((self._handlers(),))
            host = listen.rsplit(":", 1)[0]
            port = self._server.add_insecure_port(listen)
            if port == 0:
                raise _errors.InvalidArgumentError(f"listen = \"{listen}\": cannot listen there")
            self.address = f"{host}:{port}"
            self._server.start()

    # ---- Serving peers ----

    def _handlers(self) -> Any:
        grpc = self._grpc
        m = self._m
        codes = {code.value[0]: code for code in grpc.StatusCode}  # tensorshm's Error.code

        def unary(fn: Any, request: str, reply: str) -> Any:
            def handle(req: Any, context: Any) -> Any:
                try:
                    return fn(req)
                except _errors.Error as e:
                    context.abort(codes.get(e.code, grpc.StatusCode.UNKNOWN), str(e))

            return grpc.unary_unary_rpc_method_handler(
                handle, request_deserializer=m[request].FromString,
                response_serializer=m[reply].SerializeToString)

        return grpc.method_handlers_generic_handler(_SERVICE, {
            method: unary(getattr(self, handler), request, reply)
            for method, (handler, request, reply) in _METHODS.items()})

    def serve(self, method: str, request: bytes) -> bytes:
        """One Mover service call from a peer that reaches this mover through a :class:`Peer`
        (not gRPC): `request` is the serialized request message of `method` ("Offer", "Prepare",
        "Finish" or "List"); returns the serialized reply, or raises the tensorshm error that the
        gRPC server would answer with. Thread-safe, as the gRPC handlers are."""
        if method not in _METHODS:
            raise _errors.UnimplementedError(
                f"method = \"{method}\": the Mover service has {', '.join(_METHODS)}")
        handler, request_type, _ = _METHODS[method]
        reply = getattr(self, handler)(self._m[request_type].FromString(request))
        return bytes(reply.SerializeToString())

    def _hold(self, tensor: Any, hold_seconds: float, name: str = "",
              replace: bool = False) -> str:
        """Keeps `tensor` for a peer's transfer for `hold_seconds` (the peer's ask, else this
        mover's default); its transfer id."""
        seconds = hold_seconds if hold_seconds > 0 else self.hold_seconds
        transfer_id = secrets.token_hex(8)
        with self._holds_lock:
            self._holds[transfer_id] = _Hold(tensor, time.monotonic() + seconds, name, replace)
            self._wake.notify()
        return transfer_id

    def _offer(self, req: Any) -> Any:
        tensor = self.client.get(req.name, timeout=0)
        try:
            place = tensor._segment_place()
            descriptors = self._agent.descriptors(place)
        except BaseException:
            tensor.release()
            raise
        transfer_id = self._hold(tensor, req.hold_seconds)
        return self._m["OfferReply"](
            transfer_id=transfer_id, layout=_layout(self._m, tensor, place["nbytes"]),
            source=self._endpoint(descriptors))

    def _prepare(self, req: Any) -> Any:
        layout = req.layout
        tensor = self.client.create(list(layout.shape), layout.dtype, layout.device or "cpu",
                                    strides=list(layout.strides) or None, timeout=0)
        try:
            place = tensor._segment_place()
            if place["nbytes"] != layout.nbytes:
                raise _errors.InvalidArgumentError(
                    f"layout.nbytes = {layout.nbytes}: {layout.dtype}{list(layout.shape)} with "
                    f"strides {list(layout.strides)} spans {place['nbytes']} bytes here")
            descriptors = self._agent.descriptors(place)
        except BaseException:
            tensor.release()
            raise
        transfer_id = self._hold(tensor, req.hold_seconds, req.name, req.replace)
        return self._m["PrepareReply"](transfer_id=transfer_id,
                                       destination=self._endpoint(descriptors))

    def _finish(self, req: Any) -> Any:
        with self._holds_lock:
            hold = self._holds.pop(req.transfer_id, None)
        if hold is None:
            raise _errors.NotFoundError(
                f"transfer_id = \"{req.transfer_id}\": no such transfer here (finished, or its "
                "hold time passed)")
        try:
            if req.commit and hold.name:
                hold.tensor.publish(hold.name, replace=hold.replace)
                return self._m["FinishReply"](published=hold.name)
            return self._m["FinishReply"]()
        finally:
            hold.tensor.release()

    def _list(self, req: Any) -> Any:
        return self._m["ListReply"](names=self.client.keys(req.prefix))

    def _endpoint(self, descriptors: Any) -> Any:
        return self._m["Endpoint"](agent_name=self.name, agent_metadata=self._agent.metadata,
                                   descriptors=self._agent.nixl.get_serialized_descs(descriptors))

    def _poll_holds(self) -> None:
        """While peers' transfers are held: progresses the agent (a peer's first READ or WRITE
        needs this side to answer the connection) and drops holds whose time has passed."""
        while True:
            with self._holds_lock:
                while not self._holds and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
            try:
                notes = self._agent.poll()
            except Exception:
                notes = []  # a peer that went away: its transfer fails on its side
            read = {note.decode(errors="replace") for note in notes}
            with self._holds_lock:
                now = time.monotonic()
                over = [t for t, h in self._holds.items()
                        if h.deadline < now or (t in read and not h.name)]
                dropped = [self._holds.pop(t) for t in over]
            for hold in dropped:
                hold.tensor.release()
            time.sleep(_POLL_SECONDS)

    # ---- Shipping ----

    def _call(self, peer: str | Peer, method: str, request: Any, reply: str,
              deadline: float) -> Any:
        if not isinstance(peer, str):
            return self._m[reply].FromString(peer.call(
                method, request.SerializeToString(), max(deadline - time.monotonic(), 0.001)))
        grpc = self._grpc
        channel = self._channels.get(peer)
        if channel is None:
            channel = self._channels[peer] = grpc.insecure_channel(peer)
        stub = channel.unary_unary(f"/{_SERVICE}/{method}",
                                   request_serializer=type(request).SerializeToString,
                                   response_deserializer=self._m[reply].FromString)
        try:
            return stub(request, timeout=max(deadline - time.monotonic(), 0.001))
        except grpc.RpcError as e:
            code = e.code().value[0]
            raise _errors._BY_CODE.get(code, _errors.Error)(
                f"{method} at mover {peer}: {e.details()}", code) from None

    def pull(self, peer: str | Peer, name: str, as_name: str | None = None, *,
             replace: bool = False, timeout: float | None = None,
             device: str | None = None) -> str:
        """Ships `name` from the mover at `peer` (host:port, or a :class:`Peer`) into this
        node's daemon, published as `as_name` (default: the same name); returns the name
        published. `device`: where it goes here ("cpu", "cuda:N"; default: the device it is on
        at the source, "cuda:N" by this node's numbering). Device memory moves where NIXL can
        register it (UCX with CUDA support); elsewhere UnimplementedError names the device."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        offer = self._call(peer, "Offer", self._m["OfferRequest"](
            name=name, hold_seconds=deadline - time.monotonic() + 5.0,
            requester_agent=self.name), "OfferReply", deadline)
        layout = offer.layout
        tensor = None
        try:
            tensor = self.client.create(list(layout.shape), layout.dtype,
                                        device or layout.device or "cpu",
                                        strides=list(layout.strides) or None,
                                        timeout=max(deadline - time.monotonic(), 0))
            place = tensor._segment_place()
            if place["nbytes"] != layout.nbytes:
                raise _errors.InternalError(
                    f"{name}: spans {layout.nbytes} bytes at {peer}, {place['nbytes']} here")
            local = self._agent.descriptors(place)
            source = self._agent.peer(offer.source.agent_name, offer.source.agent_metadata)
            remote = self._agent.nixl.deserialize_descs(offer.source.descriptors)
            self._agent.move("READ", local, remote, source, offer.transfer_id.encode(), deadline)
            published = as_name or name
            tensor.publish(published, replace=replace)
            return published
        finally:
            if tensor is not None:
                tensor.release()
            try:
                self._call(peer, "Finish", self._m["FinishRequest"](transfer_id=offer.transfer_id),
                           "FinishReply", time.monotonic() + 5.0)
            except _errors.Error:
                pass  # the source drops its lease when its hold time passes

    def push(self, peer: str | Peer, name: str, as_name: str | None = None, *,
             replace: bool = False, timeout: float | None = None) -> str:
        """Ships `name` from this node's daemon to the mover at `peer`, published there as
        `as_name` (default: the same name); returns the name published."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self.client.get(name, timeout=0) as tensor:
            place = tensor._segment_place()
            local = self._agent.descriptors(place)
            prepared = self._call(peer, "Prepare", self._m["PrepareRequest"](
                name=as_name or name, layout=_layout(self._m, tensor, place["nbytes"]),
                hold_seconds=deadline - time.monotonic() + 5.0, replace=replace,
                requester_agent=self.name), "PrepareReply", deadline)
            try:
                destination = self._agent.peer(prepared.destination.agent_name,
                                               prepared.destination.agent_metadata)
                remote = self._agent.nixl.deserialize_descs(prepared.destination.descriptors)
                self._agent.move("WRITE", local, remote, destination,
                                 prepared.transfer_id.encode(), deadline)
            except BaseException:
                try:  # the destination drops its buffer (or does when its hold time passes)
                    self._call(peer, "Finish", self._m["FinishRequest"](
                        transfer_id=prepared.transfer_id, commit=False), "FinishReply",
                        time.monotonic() + 5.0)
                except _errors.Error:
                    pass
                raise
            finished = self._call(peer, "Finish", self._m["FinishRequest"](
                transfer_id=prepared.transfer_id, commit=True), "FinishReply",
                max(deadline, time.monotonic() + 5.0))
        return str(finished.published)

    def pull_prefix(self, peer: str | Peer, prefix: str, *, replace: bool = False,
                    timeout: float | None = None) -> list[str]:
        """Ships every name under `prefix` at `peer`; returns the names, in order."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        names = self._call(peer, "List", self._m["ListRequest"](prefix=prefix), "ListReply",
                           deadline).names
        return [self.pull(peer, n, replace=replace, timeout=deadline - time.monotonic())
                for n in names]

    # ---- Lifetime ----

    def close(self) -> None:
        """Stops serving, drops every hold, and closes the agent and (if its own) the client."""
        if self._closed:
            return
        if self._server is not None:
            self._server.stop(grace=None)
        with self._holds_lock:
            self._closed = True
            holds = list(self._holds.values())
            self._holds.clear()
            self._wake.notify()
        self._poller.join()
        for hold in holds:
            hold.tensor.release()
        for channel in self._channels.values():
            channel.close()
        self._agent.close()
        if self._own_client:
            self.client.close()

    def __enter__(self) -> Mover:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m tensorshm.transfer --socket SOCKET --listen HOST:PORT``: a node's mover, serving
    until SIGTERM or SIGINT; prints its address once it serves."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(prog="python -m tensorshm.transfer", description=main.__doc__)
    parser.add_argument("--socket", help="this node's tensorshmd (default: as tensorshm.connect())")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to serve movers on")
    parser.add_argument("--hold-seconds", type=float, default=120.0)
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with Mover(args.socket, listen=args.listen, hold_seconds=args.hold_seconds) as mover:
        print(f"mover {mover.name} serving on {mover.address}", flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
