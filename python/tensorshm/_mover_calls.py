"""tensorshm.transfer's calls to peers: over gRPC (a channel per address, mTLS when the mover
has it) or through a Peer, each request with its proof and each answer checked before use; and
the bytes of a span moved over that channel where NIXL cannot move them (Read and Write streams
of proved chunks, or one chunk a call through a Peer)."""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any, Protocol

from . import _errors
from ._mover_auth import PROOF_KEY, Credentials
from ._mover_service import CHUNK_BYTES, MESSAGE_LIMIT, METHODS, device_name


class Peer(Protocol):
    """Another node's mover reached over a channel other than gRPC (``str(peer)`` names it in
    errors). ``call`` sends one Mover service call, the request serialized with its proof, to
    that mover's :meth:`Mover.serve` and returns the serialized reply with its proof; it raises
    the tensorshm error the peer raised, TimeoutError when no answer comes within `timeout`
    seconds, and ConnectionError when the peer cannot be reached."""

    def call(self, method: str, request: bytes, proof: str, timeout: float) -> tuple[bytes, str]:
        ...


def options() -> list[tuple[str, int]]:
    """gRPC's channel and server options for the Mover service (its chunks pass the default
    message limit)."""
    return [("grpc.max_receive_message_length", MESSAGE_LIMIT),
            ("grpc.max_send_message_length", MESSAGE_LIMIT)]


def _rpc_error(e: Any, method: str, peer: Any) -> _errors.Error:
    """A gRPC error of a call at `peer` as tensorshm's, by its status code."""
    return _errors.from_code(e.code().value[0], f"{method} at mover {peer}: {e.details()}")


class Calls:
    """One mover's calls to its peers. Thread-safe (channels are made once per address)."""

    def __init__(self, grpc: Any, credentials: Credentials, messages: dict[str, Any]) -> None:
        self._grpc = grpc
        self.credentials = credentials
        self._m = messages
        self._channels: dict[str, Any] = {}
        self._channels_lock = threading.Lock()

    def channel(self, peer: str) -> Any:
        with self._channels_lock:
            channel = self._channels.get(peer)
            if channel is None:
                grpc = self._grpc
                credentials = self.credentials.channel_credentials(grpc)
                channel = (grpc.secure_channel(peer, credentials, options=options())
                           if credentials is not None
                           else grpc.insecure_channel(peer, options=options()))
                self._channels[peer] = channel
        return channel

    def call(self, peer: str | Peer, method: str, request: Any, deadline: float) -> Any:
        """One Mover service call at `peer`, proved, and its answer, checked."""
        data = request.SerializeToString()
        token = self.credentials.token
        proof, nonce = (token.sign_call(method, data, str(peer)) if token is not None
                        else ("", b""))
        timeout = max(deadline - time.monotonic(), 0.001)
        if isinstance(peer, str):
            grpc = self._grpc
            stub = self.channel(peer).unary_unary(f"/tensorshm.v1.Mover/{method}")
            try:
                reply, call = stub.with_call(
                    data, timeout=timeout, metadata=((PROOF_KEY, proof),) if proof else None)
            except grpc.RpcError as e:
                raise _rpc_error(e, method, peer) from None
            reply_proof = dict(call.trailing_metadata() or ()).get(PROOF_KEY)
        else:
            reply, reply_proof = peer.call(method, data, proof, timeout)
        if token is not None:
            token.check_reply(method, nonce, reply, reply_proof, str(peer))
        return self._m[METHODS[method][2]].FromString(reply)

    def stream(self, operation: str, place: dict[str, Any], transfer_id: str,
               peer: str | Peer, deadline: float) -> None:
        """Moves the span over the control channel: a stream of proved chunks over gRPC (Read,
        Write), or one chunk a call through a Peer."""
        if place["device"] != "cpu":
            raise _errors.UnimplementedError(
                f"device = \"{device_name(place)}\": device bytes move by NIXL only, and mover "
                f"{peer} and this one share no NIXL transport")
        address, nbytes = int(place["address"]), int(place["nbytes"])
        if not isinstance(peer, str):
            for offset in range(0, nbytes, CHUNK_BYTES):
                length = min(CHUNK_BYTES, nbytes - offset)
                if operation == "READ":
                    reply = self.call(peer, "Read", self._m["ReadRequest"](
                        transfer_id=transfer_id, offset=offset, length=length), deadline)
                    self._land(reply, offset, length, address, peer)
                else:
                    self.call(peer, "Write", self._m["WriteRequest"](
                        transfer_id=transfer_id, offset=offset,
                        data=ctypes.string_at(address + offset, length)), deadline)
            return
        grpc = self._grpc
        token = self.credentials.token
        method = "Read" if operation == "READ" else "Write"
        request = (self._m["ReadRequest"](transfer_id=transfer_id, offset=0, length=nbytes)
                   .SerializeToString() if method == "Read" else b"")
        proof, nonce = (token.sign_call(method, request, peer) if token is not None
                        else ("", b""))
        metadata = ((PROOF_KEY, proof),) if proof else None
        timeout = max(deadline - time.monotonic(), 0.001)
        path = f"/tensorshm.v1.Mover/{method}"
        try:
            if method == "Read":
                offset = 0
                for raw in self.channel(peer).unary_stream(path)(
                        request, timeout=timeout, metadata=metadata):
                    reply = self._m["ReadReply"].FromString(raw)
                    if token is not None:
                        token.check_chunk("Read", nonce, f"{transfer_id}:{reply.offset}",
                                          reply.data, reply.proof, f"mover {peer}")
                    length = min(CHUNK_BYTES, nbytes - offset)
                    self._land(reply, offset, length, address, peer)
                    offset += length
                if offset != nbytes:
                    raise _errors.InvalidArgumentError(
                        f"Read at mover {peer}: {offset} of the span's {nbytes} bytes came")
                return

            def chunks() -> Any:
                for offset in range(0, nbytes, CHUNK_BYTES):
                    data = ctypes.string_at(address + offset, min(CHUNK_BYTES, nbytes - offset))
                    where = f"{transfer_id}:{offset}"
                    yield self._m["WriteRequest"](
                        transfer_id=transfer_id, offset=offset, data=data,
                        proof=token.sign_chunk("Write", nonce, where, data) if token else ""
                    ).SerializeToString()

            reply, call = self.channel(peer).stream_unary(path).with_call(
                chunks(), timeout=timeout, metadata=metadata)
            if token is not None:
                token.check_reply("Write", nonce, reply,
                                  dict(call.trailing_metadata() or ()).get(PROOF_KEY), str(peer))
        except grpc.RpcError as e:
            raise _rpc_error(e, method, peer) from None

    @staticmethod
    def _land(reply: Any, offset: int, length: int, address: int, peer: str | Peer) -> None:
        """Copies a Read chunk into place, if it is the one asked for."""
        if reply.offset != offset or len(reply.data) != length:
            raise _errors.InvalidArgumentError(
                f"Read at mover {peer}: {len(reply.data)} bytes at offset {reply.offset}, for "
                f"{length} at {offset}")
        ctypes.memmove(address + offset, reply.data, length)

    def close(self) -> None:
        with self._channels_lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
