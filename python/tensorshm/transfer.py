"""tensorshm.transfer: named tensors shipped between nodes' daemons, by movers that prove who
they are on every call.

One :class:`Mover` per node: a client of that node's tensorshmd, a NIXL agent, and a gRPC server
(the ``Mover`` service of proto/tensorshm/v1/mover.proto) that other nodes' movers call. Shipping
a name from node A to node B (``mover_b.pull(a_address, name)``):

1. B asks A for the name (Offer). A acquires it (the lease keeps the bytes while they move),
   registers the span of its bytes with NIXL for this transfer alone, and answers with the layout
   and where the span lies, as plain fields.
2. B creates an unpublished tensor of the same dtype, shape and strides in its own daemon and
   posts a one-sided NIXL READ of A's span straight into it: no byte passes through Python
   between the two shared memories. Where the two movers share no UCX transport they may use (see
   below), B reads the span in chunks over the authenticated gRPC channel instead (Read).
3. B tells A it is done (Finish: A drops its lease and the registration) and, only if A held the
   bytes until then, publishes them under the name (or another).

``push`` is the other way round (A WRITEs into a buffer B prepared, or sends it in Write calls),
and ``pull_prefix`` ships every name under a prefix. Every step has a deadline; whatever fails,
neither side keeps a lease, an unpublished buffer, a registration or a pending transfer.

**Trust.** Every call and every answer carries a proof of the fleet token (``token_file``; an
HMAC over the call with a nonce and the time, never the secret itself), and/or the movers use
mTLS (``tls_cert``, ``tls_key``, ``tls_ca``): see tensorshm/_mover_auth.py. A call without them
gets UNAUTHENTICATED and touches nothing; a mover with neither refuses to start unless
``insecure=True``. Nothing a peer sends is unpickled. A peer's holds are capped by this mover's
``hold_seconds``, its prepared bytes by ``peer_quota_bytes``, its names by ``offer_prefixes`` and
``accept_prefixes``, its devices by this node's pools.

**Transports.** NIXL over UCX, restricted to transports whose access the kernel or the NIC
enforces: shared memory and CMA between processes of one host (CMA needs the same uid or
CAP_SYS_PTRACE) and cuda_ipc; with mTLS, RDMA verbs between hosts too (see tensorshm/_nixl.py:
UCX serves software RDMA to whoever learns its worker address, so that address travels only
under TLS). UCX's TCP transport is left out unless ``allow_tcp_rma=True``: its software RDMA
lets any peer that reaches its port read and write the mover process's memory. ``transport``:
"auto" (NIXL where both movers can, else chunks over gRPC), "nixl" or "grpc".

The control channel is gRPC, or any other when the peer is a :class:`Peer`: its calls then go
through ``Peer.call`` into the other mover's :meth:`Mover.serve` (tensorshm.ray's movers, Ray
actors, call each other that way), with the same proofs.

NIXL: ``pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1`` (the ``nixl`` package pulls torch
only for type hints); grpcio and protobuf. ``make test-multinode`` installs them.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket as _socket
import time
from concurrent import futures
from typing import Any

from . import _errors
from ._client import Client, connect
from ._mover_auth import Credentials
from ._mover_calls import Calls, Peer, options
from ._mover_holds import Limits
from ._mover_service import CHUNK_BYTES, Service, messages
from ._nixl import Agent as _Agent
from ._nixl import NoPath, UnsafeUcx

__all__ = ["Mover", "Peer", "main"]

_log = logging.getLogger("tensorshm.transfer")
_TRANSPORTS = ("auto", "nixl", "grpc")
_FINISH_SECONDS = 5.0  # what a Finish may take beyond a ship's deadline


class Mover:
    """A node's mover: ``Mover(socket, token_file=PATH)`` serves other nodes' movers on
    ``listen`` (host:port; port 0 picks one, see :attr:`address`) and ships tensors from and to
    them. ``listen=None`` starts no gRPC server (``address`` is None): peers then reach it
    through :meth:`serve` only.

    Credentials (at least one, or ``insecure=True``, which logs a warning at every start):
    ``token_file``, a fleet secret in a file of this uid that no group or other user may read
    (FailedPreconditionError naming it otherwise); ``tls_cert``, ``tls_key`` and ``tls_ca`` for
    mTLS (both sides present a certificate of the CA and verify the other's).

    ``socket``: this node's tensorshmd (default: as ``tensorshm.connect()``), or pass ``client``.
    ``timeout``: the default bound of one ship, in seconds. ``hold_seconds``: the longest this
    mover keeps a lease or buffer for a peer (a peer may ask for less; infinite, NaN and
    negative asks are refused). ``peer_quota_bytes``: the most bytes one peer may have prepared
    here at once. ``offer_prefixes`` / ``accept_prefixes``: the names this mover offers (Offer,
    List) and accepts (Prepare); by default every name. ``transport`` and ``allow_tcp_rma``: see
    the module doc. ``advertise``: the addresses peers dial this mover by, besides ``listen``'s
    (a DNS name, a Service's address; needed for a wildcard ``listen``): a call's proof names the
    mover it is meant for, and one meant for another mover is refused, so that a relay cannot
    pass a call to one mover on to another.
    """

    def __init__(self, socket: str | None = None, *, listen: str | None = "127.0.0.1:0",
                 client: Client | None = None, timeout: float = 60.0,
                 hold_seconds: float = 60.0, name: str | None = None,
                 token_file: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, tls_ca: str | None = None,
                 insecure: bool = False, transport: str = "auto", allow_tcp_rma: bool = False,
                 offer_prefixes: tuple[str, ...] | list[str] = ("",),
                 accept_prefixes: tuple[str, ...] | list[str] = ("",),
                 peer_quota_bytes: int = 4 << 30,
                 advertise: tuple[str, ...] | list[str] = ()) -> None:
        import grpc

        if transport not in _TRANSPORTS:
            raise _errors.InvalidArgumentError(
                f"transport = \"{transport}\": one of {', '.join(_TRANSPORTS)}")
        if not (hold_seconds > 0 and hold_seconds < float("inf")):
            raise _errors.InvalidArgumentError(
                f"hold_seconds = {hold_seconds}: a finite number of seconds > 0")
        self._grpc = grpc
        self.credentials = Credentials.load(token_file=token_file, tls_cert=tls_cert,
                                            tls_key=tls_key, tls_ca=tls_ca, insecure=insecure)
        self._m = messages()
        self.timeout = timeout
        self.transport = transport
        self.name = name or (
            f"tsm-mover-{_socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}")
        self._agent: _Agent | None = None
        if transport != "grpc":
            try:
                self._agent = _Agent(self.name, allow_tcp_rma=allow_tcp_rma,
                                     mtls=self.credentials.tls is not None)
            except _errors.FailedPreconditionError as e:
                if transport == "nixl" or isinstance(e, UnsafeUcx):
                    raise
                _log.info("%s: no NIXL (%s): bytes go over gRPC", self.name, e)
        self._calls = Calls(grpc, self.credentials, self._m)
        self._server = None
        self.address: str | None = None
        self._closed = False
        self._own_client = client is None
        try:
            self.client = connect(socket) if client is None else client
            if listen is not None:
                self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                                           options=options())
                server_credentials = self.credentials.server_credentials(grpc)
                host = listen.rsplit(":", 1)[0]
                try:
                    port = (self._server.add_secure_port(listen, server_credentials)
                            if server_credentials is not None
                            else self._server.add_insecure_port(listen))
                except RuntimeError:
                    port = 0
                if port == 0:
                    raise _errors.InvalidArgumentError(
                        f"listen = \"{listen}\": cannot listen there")
                self.address = f"{host}:{port}"
                if host.strip("[]") in ("", "0.0.0.0", "::") and not advertise:
                    raise _errors.InvalidArgumentError(
                        f"listen = \"{listen}\": a wildcard address needs advertise= "
                        "(--advertise): the addresses peers dial this mover by, which their "
                        "proofs name")
            # The names a call's proof may name this mover by: the address it listens on and
            # those it is reached by (a DNS name, a load balancer's, a Ray actor's name).
            targets = tuple(advertise) + ((self.address,) if self.address else ())
            if self.credentials.token is not None and not targets:
                raise _errors.InvalidArgumentError(
                    "advertise: a mover with no listen address needs the name its peers call "
                    "it by (tensorshm.ray gives its actor name)")
            self.targets = targets
            self._service = Service(self.client, self._agent, self.credentials, Limits(
                hold_seconds=hold_seconds, offer_prefixes=tuple(offer_prefixes),
                accept_prefixes=tuple(accept_prefixes), peer_quota_bytes=peer_quota_bytes),
                targets)
            if self._server is not None:
                self._server.add_generic_rpc_handlers((self._service.grpc_handler(grpc),))
                self._server.start()
        except BaseException:
            self.close()
            raise

    @property
    def hold_seconds(self) -> float:
        return self._service.limits.hold_seconds

    @property
    def nixl(self) -> bool:
        """Whether this mover can move bytes by NIXL (else by chunks over gRPC)."""
        return self._agent is not None

    def serve(self, method: str, request: bytes, proof: str = "") -> tuple[bytes, str]:
        """One Mover service call from a peer that reaches this mover through a :class:`Peer`
        (not gRPC): `request` is the serialized request message of `method` ("Offer", "Prepare",
        "Finish", "List", "Read" or "Write") and `proof` its proof of the fleet token; returns
        the serialized reply and its proof, or raises the tensorshm error that the gRPC server
        would answer with (UnauthenticatedError first, for a call without a valid proof).
        Thread-safe, as the gRPC handlers are."""
        return self._service.serve(method, request, proof)

    # ---- Calling peers ----

    def _finish(self, peer: str | Peer, transfer_id: str, commit: bool, deadline: float,
                chunks: int = 0) -> Any:
        return self._calls.call(peer, "Finish", self._m["FinishRequest"](
            transfer_id=transfer_id, commit=commit, chunks=chunks),
            max(deadline, time.monotonic() + _FINISH_SECONDS))

    def _hold_ask(self, deadline: float) -> float:
        """The hold to ask a peer for: the rest of the ship and a margin for Finish (the peer
        caps it by its own maximum)."""
        return max(deadline - time.monotonic(), 0.0) + _FINISH_SECONDS

    def _span(self, endpoint: Any, place: dict[str, Any], peer: str | Peer, what: str) -> None:
        """Checks that a peer's span is the length of ours."""
        span = endpoint.span
        if span.length != place["nbytes"]:
            raise _errors.InvalidArgumentError(
                f"{what} at mover {peer}: span.length = {span.length}, where the tensor spans "
                f"{place['nbytes']} bytes")

    def _by_nixl(self, operation: str, place: dict[str, Any], endpoint: Any, transfer_id: str,
                 peer: str | Peer, deadline: float) -> bool:
        """Moves the span by NIXL if both movers can: False when the bytes must go by gRPC
        instead (transport "auto" only)."""
        agent = self._agent
        if agent is None or not endpoint.agent_name or not agent.reaches(endpoint.agent_name):
            if self.transport == "nixl":
                raise _errors.FailedPreconditionError(
                    f"mover {peer} and this one share no NIXL transport, and transport = "
                    "\"nixl\"")
            return False
        try:
            source = agent.peer(endpoint.agent_name, endpoint.agent_metadata)
        except _errors.ConnectionError:
            if self.transport == "nixl":
                raise
            return False  # no UCX transport both may use: the bytes go by gRPC
        try:
            registration = agent.register(place)
            try:
                remote = agent.remote_descs(endpoint.span.address, endpoint.span.length,
                                            endpoint.span.device)
                agent.move(operation, agent.descs(registration), remote, source,
                           transfer_id.encode(), deadline)
            finally:
                agent.deregister(registration)
        except NoPath:
            agent.forget(source)
            if self.transport == "nixl":
                raise
            return False
        except _errors.ConnectionError:
            agent.forget(source)
            raise
        finally:
            agent.done(source)
        return True

    # ---- Shipping ----

    def pull(self, peer: str | Peer, name: str, as_name: str | None = None, *,
             replace: bool = False, timeout: float | None = None,
             device: str | None = None) -> str:
        """Ships `name` from the mover at `peer` (host:port, or a :class:`Peer`) into this
        node's daemon, published as `as_name` (default: the same name); returns the name
        published. `device`: where it goes here ("cpu", "cuda:N"; default: the device it is on
        at the source, "cuda:N" by this node's numbering). Device memory moves where NIXL can
        register it (UCX with CUDA support); elsewhere UnimplementedError names the device."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        offer = self._calls.call(peer, "Offer", self._m["OfferRequest"](
            name=name, hold_seconds=self._hold_ask(deadline), requester_agent=self.name,
            nixl=self._agent is not None), deadline)
        layout = offer.layout
        tensor = None
        finished = False
        try:
            tensor = self.client.create(list(layout.shape), layout.dtype,
                                        device or layout.device or "cpu",
                                        strides=list(layout.strides) or None,
                                        timeout=max(deadline - time.monotonic(), 0))
            place = tensor.segment_place()
            self._span(offer.source, place, peer, "Offer")
            if not self._by_nixl("READ", place, offer.source, offer.transfer_id, peer, deadline):
                self._calls.stream("READ", place, offer.transfer_id, peer, deadline)
            # The source held the bytes until now only if it still has the transfer: else its
            # hold ran out mid-read, and what was read may be another tensor's.
            finished = True
            self._finish(peer, offer.transfer_id, False, deadline)
            published = as_name or name
            tensor.publish(published, replace=replace)
            return published
        finally:
            if tensor is not None:
                tensor.release()
            if not finished:
                try:
                    self._finish(peer, offer.transfer_id, False, deadline)
                except _errors.Error:
                    pass  # the source drops its lease when its hold time passes

    def push(self, peer: str | Peer, name: str, as_name: str | None = None, *,
             replace: bool = False, timeout: float | None = None) -> str:
        """Ships `name` from this node's daemon to the mover at `peer`, published there as
        `as_name` (default: the same name); returns the name published."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self.client.get(name, timeout=0) as tensor:
            place = tensor.segment_place()
            layout = self._m["TensorLayout"](dtype=tensor.dtype, shape=list(tensor.shape),
                                             strides=list(tensor.strides), device=tensor.device,
                                             nbytes=place["nbytes"])
            prepared = self._calls.call(peer, "Prepare", self._m["PrepareRequest"](
                name=as_name or name, layout=layout, hold_seconds=self._hold_ask(deadline),
                replace=replace, requester_agent=self.name, nixl=self._agent is not None),
                deadline)
            chunks = 0  # sent in Write calls: the destination checks that all of them came
            try:
                self._span(prepared.destination, place, peer, "Prepare")
                if not self._by_nixl("WRITE", place, prepared.destination,
                                     prepared.transfer_id, peer, deadline):
                    self._calls.stream("WRITE", place, prepared.transfer_id, peer, deadline)
                    chunks = -(-int(place["nbytes"]) // CHUNK_BYTES)
            except BaseException:
                try:  # the destination drops its buffer (or does when its hold time passes)
                    self._finish(peer, prepared.transfer_id, False, deadline)
                except _errors.Error:
                    pass
                raise
            finished = self._finish(peer, prepared.transfer_id, True, deadline, chunks)
        return str(finished.published)

    def pull_prefix(self, peer: str | Peer, prefix: str, *, replace: bool = False,
                    timeout: float | None = None) -> list[str]:
        """Ships every name under `prefix` at `peer`; returns the names, in order. A peer that
        lists a name outside `prefix` gets PermissionError, and nothing is shipped."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        names = list(self._calls.call(peer, "List", self._m["ListRequest"](prefix=prefix),
                                deadline).names)
        outside = [n for n in names if not n.startswith(prefix)]
        if outside:
            raise _errors.PermissionError(
                f"List at mover {peer}: name = \"{outside[0]}\" is not under prefix "
                f"\"{prefix}\" ({len(outside)} such); nothing shipped")
        return [self.pull(peer, n, replace=replace, timeout=deadline - time.monotonic())
                for n in names]

    # ---- Lifetime ----

    @property
    def holds(self) -> int:
        """How many peers' transfers this mover holds now."""
        return self._service.holds

    @property
    def registrations(self) -> int:
        """How many spans this mover has registered with NIXL now."""
        return 0 if self._agent is None else self._agent.registrations

    def close(self) -> None:
        """Stops serving, drops every hold, and closes the agent and (if its own) the client."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.stop(grace=None)
        if hasattr(self, "_service"):
            self._service.close()
        self._calls.close()
        if self._agent is not None:
            self._agent.close()
        if self._own_client and hasattr(self, "client"):
            self.client.close()

    def __enter__(self) -> Mover:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m tensorshm.transfer --socket SOCKET --listen HOST:PORT --token-file PATH``: a
    node's mover, serving until SIGTERM or SIGINT (see tensorshm/_mover_cli.py)."""
    from ._mover_cli import main as run

    return run(argv)


if __name__ == "__main__":
    raise SystemExit(main())
