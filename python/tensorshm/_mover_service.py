"""tensorshm.transfer's serving side: what a Mover does for its peers (the Mover service of
proto/tensorshm/v1/mover.proto) and the limits a peer cannot lift.

A peer's call is checked (its proof of the fleet token, when the mover has one) before its
request is even parsed. Then: names only under the prefixes this mover offers (Offer, List) or
accepts (Prepare); holds no longer than this mover's own maximum; prepared bytes within a quota
per peer; devices this node's daemon has. A hold (tensorshm/_mover_holds.py) keeps a lease
(Offer) or an unpublished buffer (Prepare) until the peer's Finish or the hold's end; only the
span of its tensor is registered with NIXL, and only while the hold lasts.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.resources
import math
import time
from collections.abc import Iterator
from typing import Any

from . import _errors
from ._mover_auth import Credentials
from ._mover_holds import Hold, HoldTable, Limits
from ._nixl import Agent

SERVICE = "tensorshm.v1.Mover"
# The largest chunk one Read or Write message carries (gRPC's messages are bounded: see
# MESSAGE_LIMIT).
CHUNK_BYTES = 4 << 20
MESSAGE_LIMIT = CHUNK_BYTES + (1 << 20)

# The Mover service's methods: name -> (handler, request message, reply message).
METHODS = {
    "Offer": ("_offer", "OfferRequest", "OfferReply"),
    "Prepare": ("_prepare", "PrepareRequest", "PrepareReply"),
    "Finish": ("_finish", "FinishRequest", "FinishReply"),
    "List": ("_list", "ListRequest", "ListReply"),
    "Read": ("_read", "ReadRequest", "ReadReply"),
    "Write": ("_write", "WriteRequest", "WriteReply"),
}


@functools.cache
def messages() -> dict[str, Any]:
    """The Mover service's message classes, built from the descriptor set the package carries
    (mover.binpb, made from proto/tensorshm/v1/mover.proto at build time)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    data = importlib.resources.files(__package__).joinpath("mover.binpb").read_bytes()
    pool = descriptor_pool.DescriptorPool()
    for proto in descriptor_pb2.FileDescriptorSet.FromString(data).file:
        pool.Add(proto)
    names = ["TensorLayout", "Span", "Endpoint"] + [m for v in METHODS.values() for m in v[1:]]
    return {n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"tensorshm.v1.{n}"))
            for n in names}


def _least_span(layout: Any) -> int:
    """The fewest bytes a layout can span (a peer's nbytes below it would let the daemon make
    more than the peer's quota counted)."""
    from ._tensorshm import _dtype_fields

    try:
        _, bits, lanes = _dtype_fields(layout.dtype)
    except Exception as e:  # the binding's own ValueError names the dtype
        raise _errors.InvalidArgumentError(f"layout.dtype = \"{layout.dtype}\": {e}") from None
    shape: list[int] = [int(n) for n in layout.shape]
    strides: list[int] = [int(st) for st in layout.strides]
    if any(n <= 0 for n in shape):
        return 0
    if not strides:
        elements = math.prod(shape)
    else:
        elements = 1 + sum((n - 1) * abs(st) for n, st in zip(shape, strides))
    return -(-elements * bits * lanes // 8)


def device_name(place: dict[str, Any]) -> str:
    return "cpu" if place["device"] == "cpu" else f"cuda:{place['device_id']}"


class Service:
    """The Mover service over this node's client and agent (None: bytes by Read and Write only).
    Thread-safe: its handlers run on gRPC's or Ray's threads at once."""

    def __init__(self, client: Any, agent: Agent | None, credentials: Credentials,
                 limits: Limits, targets: tuple[str, ...]) -> None:
        self.client = client
        self.targets = targets  # the names a call's proof may name this mover by
        self.agent = agent
        self.credentials = credentials
        self.limits = limits
        self.m = messages()
        self.table = HoldTable(agent, limits)
        self._devices: set[str] | None = None

    # ---- One call ----

    def _check(self, method: str, request: bytes, proof: str | None) -> bytes:
        token = self.credentials.token
        return token.check_call(method, request, proof, self.targets) if token else b""

    def serve(self, method: str, request: bytes, proof: str | None,
              caller: str = "peer") -> tuple[bytes, str]:
        """One Mover service call that comes through a Peer (not gRPC): (the reply's bytes, its
        proof) or the tensorshm error the caller gets. The proof is checked before anything
        else; a mover that knows its peers by TLS alone takes no call this way (a Peer proves
        nothing), unless it is insecure. `caller`: who the call is from, for its quota."""
        if self.credentials.token is None and not self.credentials.insecure:
            raise _errors.UnauthenticatedError(
                f"{method}: this mover proves its peers by TLS, which a call through "
                "Mover.serve has not: give it a token_file")
        return self._serve(method, request, proof, caller)

    def _serve(self, method: str, request: bytes, proof: str | None,
               caller: str) -> tuple[bytes, str]:
        nonce = self._check(method, request, proof)
        if method not in METHODS:
            raise _errors.UnimplementedError(
                f"method = \"{method}\": the Mover service has {', '.join(METHODS)}")
        handler, request_type, _ = METHODS[method]
        message = self.m[request_type].FromString(request)
        named: str = getattr(message, "requester_agent", "")
        if caller == "peer" and named:
            # Through Mover.serve there is no transport identity: the name the (proved) peer
            # gives itself keeps one peer's holds from counting against all the others'.
            caller = f"peer:{named}"
        reply = getattr(self, handler)(message, caller)
        data = bytes(reply.SerializeToString())
        token = self.credentials.token
        return data, token.sign_reply(method, nonce, data) if token is not None else ""

    def grpc_handler(self, grpc: Any) -> Any:
        """The generic gRPC handler of the service: requests and replies as bytes (the proofs
        cover the bytes), proofs in metadata; Read and Write stream their chunks."""
        from ._mover_auth import PROOF_KEY

        def abort(context: Any, e: _errors.Error) -> None:
            context.abort(_errors.grpc_code(grpc, e), str(e))

        def caller(context: Any) -> str:
            """The caller's transport identity: its certificate's names under mTLS, else its
            address without the port (a peer's own name for itself is not evidence)."""
            auth = context.auth_context()
            names = auth.get("x509_subject_alternative_name") or auth.get("x509_common_name")
            if names:
                return "tls:" + ",".join(n.decode(errors="replace") for n in names)
            return "host:" + str(context.peer()).rsplit(":", 1)[0]

        def answer(context: Any, reply: bytes, reply_proof: str) -> bytes:
            if reply_proof:
                context.set_trailing_metadata(((PROOF_KEY, reply_proof),))
            return reply

        def unary(method: str) -> Any:
            def handle(request: bytes, context: Any) -> bytes:
                proof = dict(context.invocation_metadata()).get(PROOF_KEY)
                try:
                    return answer(context, *self._serve(method, request, proof, caller(context)))
                except _errors.Error as e:
                    abort(context, e)
                    raise  # not reached: abort raises

            return grpc.unary_unary_rpc_method_handler(handle)

        def read(request: bytes, context: Any) -> Iterator[bytes]:
            try:
                yield from self.read_stream(request,
                                            dict(context.invocation_metadata()).get(PROOF_KEY))
            except _errors.Error as e:
                abort(context, e)

        def write(requests: Iterator[bytes], context: Any) -> bytes:
            try:
                return answer(context, *self.write_stream(
                    requests, dict(context.invocation_metadata()).get(PROOF_KEY)))
            except _errors.Error as e:
                abort(context, e)
                raise

        handlers = {m: unary(m) for m in METHODS if m not in ("Read", "Write")}
        handlers["Read"] = grpc.unary_stream_rpc_method_handler(read)
        handlers["Write"] = grpc.stream_unary_rpc_method_handler(write)
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    # ---- Limits ----

    def hold_time(self, asked: float) -> float:
        """The hold a peer gets for `asked` seconds (0: this mover's maximum)."""
        if not math.isfinite(asked) or asked < 0:
            raise _errors.InvalidArgumentError(
                f"hold_seconds = {asked}: a finite number of seconds >= 0 (0: the mover's "
                f"maximum, {self.limits.hold_seconds:g})")
        return min(asked or self.limits.hold_seconds, self.limits.hold_seconds)

    @staticmethod
    def _under(name: str, prefixes: tuple[str, ...]) -> bool:
        return any(name.startswith(p) for p in prefixes)

    def _check_name(self, name: str, prefixes: tuple[str, ...], what: str) -> None:
        if not self._under(name, prefixes):
            raise _errors.PermissionError(
                f"name = \"{name}\": this mover {what} only names under "
                + ", ".join(f"\"{p}\"" for p in prefixes))

    def _check_device(self, device: str) -> str:
        device = device or "cpu"
        if self._devices is None:
            self._devices = {str(p["device"]) for p in self.client.stat()["pools"]}
        if device not in self._devices:
            raise _errors.InvalidArgumentError(
                f"layout.device = \"{device}\": this node's daemon has pools on "
                + ", ".join(sorted(self._devices)))
        return device

    # ---- Handlers ----

    def _endpoint(self, hold: Hold, nixl: bool) -> Any:
        """Where the hold's bytes lie for the peer: registered with NIXL (for this transfer
        alone) when both sides can, else for Read or Write calls."""
        place = hold.place
        span = self.m["Span"](length=place["nbytes"], device=device_name(place))
        if not (nixl and self.agent is not None):
            return self.m["Endpoint"](span=span)
        hold.registration = self.agent.register(place)
        span.address = place["address"]
        return self.m["Endpoint"](agent_name=self.agent.name,
                                  agent_metadata=self.agent.metadata(hold.registration),
                                  span=span)

    def _offer(self, req: Any, caller: str) -> Any:
        self._check_name(req.name, self.limits.offer_prefixes, "offers")
        seconds = self.hold_time(req.hold_seconds)
        self.table.reserve(caller, 0)
        try:
            tensor = self.client.get(req.name, timeout=0)
        except BaseException:
            self.table.unreserve(caller, 0)
            raise
        hold = Hold(tensor, {}, time.monotonic() + seconds, peer=caller)
        try:
            hold.place = tensor.segment_place()
            source = self._endpoint(hold, req.nixl)
            transfer_id = self.table.add(hold)
        except BaseException:
            self.table.drop(hold)
            raise
        layout = self.m["TensorLayout"](dtype=tensor.dtype, shape=list(tensor.shape),
                                        strides=list(tensor.strides), device=tensor.device,
                                        nbytes=hold.place["nbytes"])
        return self.m["OfferReply"](transfer_id=transfer_id, layout=layout, source=source)

    def _prepare(self, req: Any, caller: str) -> Any:
        self._check_name(req.name, self.limits.accept_prefixes, "accepts")
        seconds = self.hold_time(req.hold_seconds)
        layout = req.layout
        device = self._check_device(layout.device)
        least = _least_span(layout)
        if layout.nbytes < least:
            raise _errors.InvalidArgumentError(
                f"layout.nbytes = {layout.nbytes}: {layout.dtype}{list(layout.shape)} with "
                f"strides {list(layout.strides)} spans at least {least} bytes")
        self.table.reserve(caller, layout.nbytes)  # before anything is made
        hold = None
        try:
            tensor = self.client.create(list(layout.shape), layout.dtype, device,
                                        strides=list(layout.strides) or None, timeout=0)
            hold = Hold(tensor, {}, time.monotonic() + seconds, prepared=True, name=req.name,
                        replace=req.replace, peer=caller, nbytes=layout.nbytes)
            hold.place = tensor.segment_place()
            if hold.place["nbytes"] != layout.nbytes:
                raise _errors.InvalidArgumentError(
                    f"layout.nbytes = {layout.nbytes}: {layout.dtype}{list(layout.shape)} with "
                    f"strides {list(layout.strides)} spans {hold.place['nbytes']} bytes here")
            if hold.place["device"] == "cpu":
                # What the daemon hands out may hold a deleted tensor's bytes: a commit without
                # (all) the writes publishes zeros, never them.
                ctypes.memset(int(hold.place["address"]), 0, layout.nbytes)
            destination = self._endpoint(hold, req.nixl)
            transfer_id = self.table.add(hold)
        except BaseException:
            if hold is not None:
                self.table.drop(hold)
            else:
                self.table.unreserve(caller, layout.nbytes)
            raise
        return self.m["PrepareReply"](transfer_id=transfer_id, destination=destination)

    def _finish(self, req: Any, caller: str) -> Any:
        hold = self.table.take(req.transfer_id, pop=True)
        try:
            with hold.busy:  # a chunk being written lands first; none lands after
                hold.finished = True
            if req.commit and hold.prepared:
                # Bytes sent in Write calls must all have come, as the caller's (proved) count
                # says: a relay that drops chunks, or all of them, gets nothing published.
                every = set(range(0, hold.place["nbytes"], CHUNK_BYTES))
                by_grpc = req.chunks or hold.written or hold.registration is None
                if by_grpc and (hold.written != every or req.chunks != len(every)):
                    raise _errors.FailedPreconditionError(
                        f"transfer_id = \"{req.transfer_id}\": {len(hold.written)} of its "
                        f"{len(every)} chunks were written (the caller says it sent "
                        f"{req.chunks}); nothing published")
                hold.tensor.publish(hold.name, replace=hold.replace)
                return self.m["FinishReply"](published=hold.name)
            return self.m["FinishReply"]()
        finally:
            self.table.drop(hold)

    def _list(self, req: Any, caller: str) -> Any:
        names = [n for n in self.client.keys(req.prefix)
                 if self._under(n, self.limits.offer_prefixes)]
        return self.m["ListReply"](names=names)

    def _held(self, transfer_id: str, prepared: bool) -> Hold:
        """The live hold of a Read (an offer) or a Write (a prepared buffer)."""
        hold = self.table.take(transfer_id, pop=False)
        if hold.prepared != prepared:
            raise _errors.FailedPreconditionError(
                f"transfer_id = \"{transfer_id}\": "
                + ("a prepared buffer, not an offer" if hold.prepared else
                   "an offer, not a prepared buffer"))
        if hold.place["device"] != "cpu":
            raise _errors.UnimplementedError(
                f"device = \"{device_name(hold.place)}\": device bytes move by NIXL only")
        return hold

    @staticmethod
    def _bounds(hold: Hold, offset: int, length: int, what: str, limit: int) -> None:
        if length > limit or offset + length > hold.place["nbytes"]:
            raise _errors.InvalidArgumentError(
                f"{what}: offset {offset} + length {length} is past the span's "
                f"{hold.place['nbytes']} bytes or over {limit} bytes a call")

    @staticmethod
    def _copy(hold: Hold, offset: int, length: int, data: bytes | None = None) -> bytes:
        """Reads [offset, offset + length) of the hold's span, or writes `data` there, unless
        the hold ended (NotFoundError): the drop waits for a copy under way."""
        address = int(hold.place["address"]) + offset
        with hold.busy:
            if hold.dropped or hold.expired or hold.finished:
                raise _errors.NotFoundError("the transfer ended (finished, or its hold time "
                                            "passed)")
            if data is None:
                return ctypes.string_at(address, length)
            ctypes.memmove(address, data, length)
            return b""

    def _read(self, req: Any, caller: str) -> Any:
        hold = self._held(req.transfer_id, prepared=False)
        self._bounds(hold, req.offset, req.length, "Read", CHUNK_BYTES)
        return self.m["ReadReply"](data=self._copy(hold, req.offset, req.length),
                                   offset=req.offset)

    def _write(self, req: Any, caller: str) -> Any:
        self._write_chunk(self._held(req.transfer_id, prepared=True), req.offset, req.data)
        return self.m["WriteReply"]()

    def _write_chunk(self, hold: Hold, offset: int, data: bytes) -> None:
        """A Write's chunk: whole chunks at their places only, so that Finish can tell that
        every one came."""
        nbytes = hold.place["nbytes"]
        if (offset % CHUNK_BYTES or not 0 <= offset < nbytes
                or len(data) != min(CHUNK_BYTES, nbytes - offset)):
            raise _errors.InvalidArgumentError(
                f"Write: {len(data)} bytes at offset {offset}; chunks are the span's "
                f"{CHUNK_BYTES}-byte pieces, whole and in place")
        self._copy(hold, offset, len(data), data)
        with hold.busy:
            hold.written.add(offset)

    def read_stream(self, request: bytes, proof: str | None) -> Iterator[bytes]:
        """Read over gRPC: the span's chunks [offset, offset + length), each with its proof."""
        token = self.credentials.token
        nonce = self._check("Read", request, proof)
        req = self.m["ReadRequest"].FromString(request)
        hold = self._held(req.transfer_id, prepared=False)
        self._bounds(hold, req.offset, req.length, "Read", hold.place["nbytes"])
        end = req.offset + req.length
        for offset in range(req.offset, end, CHUNK_BYTES):
            data = self._copy(hold, offset, min(CHUNK_BYTES, end - offset))
            chunk_proof = (token.sign_chunk("Read", nonce, f"{req.transfer_id}:{offset}", data)
                           if token is not None else "")
            yield self.m["ReadReply"](data=data, offset=offset,
                                      proof=chunk_proof).SerializeToString()

    def write_stream(self, requests: Iterator[bytes], proof: str | None) -> tuple[bytes, str]:
        """Write over gRPC: chunks, each proved, into prepared buffers; the reply and its proof.
        The call's own proof is checked before a chunk is read."""
        token = self.credentials.token
        nonce = self._check("Write", b"", proof)
        holds: dict[str, Hold] = {}
        for raw in requests:
            req = self.m["WriteRequest"].FromString(raw)
            if token is not None:
                token.check_chunk("Write", nonce, f"{req.transfer_id}:{req.offset}", req.data,
                                  req.proof, "the caller")
            hold = holds.get(req.transfer_id) or holds.setdefault(
                req.transfer_id, self._held(req.transfer_id, prepared=True))
            self._write_chunk(hold, req.offset, req.data)
        if not holds:
            raise _errors.InvalidArgumentError("Write: a stream with no chunk")
        reply = bytes(self.m["WriteReply"]().SerializeToString())
        return reply, token.sign_reply("Write", nonce, reply) if token is not None else ""

    @property
    def holds(self) -> int:
        return self.table.count

    def close(self) -> None:
        """Drops every hold (a closing mover's peers' transfers fail)."""
        self.table.close()
