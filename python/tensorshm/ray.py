"""tensorshm.ray: tensorshm.transfer's movers as Ray actors, one per node, for Ray applications.

::

    import ray
    import tensorshm.ray

    ray.init()
    movers = tensorshm.ray.start_movers({"node_a": "/run/tensorshm/tensorshm.sock",
                                         "node_b": "/run/tensorshm/tensorshm.sock"},
                                        token_file="/etc/tensorshm/mover.token")
    tensorshm.ray.ship("jobs/17/out", "node_a", "node_b")  # now in node_b's tensorshmd
    tensorshm.ray.stop_movers(movers)

Each mover is a :class:`MoverActor`: a :class:`tensorshm.transfer.Mover` (a client of its node's
tensorshmd and a NIXL agent) pinned to its node, either by a custom resource only that node has
(``ray start --resources='{"node_a": 1}'``; the actor asks for a 0.001 share of it) or by the
node's id (a hard NodeAffinitySchedulingStrategy). The movers are named actors
(``tensorshm-mover:<node>``) in the job's namespace, so any task, actor or driver of the
namespace ships by node name.

The control channel between two movers is Ray actor calls: the destination's actor calls
``serve`` on the source's with the Mover service's serialized messages (the offer: layout, NIXL
metadata and the span, a few kB), each with its proof of the fleet token (``token_file``: the
same secret in a file on every node, readable by the movers' uid alone), and checks the proof of
each answer, as over gRPC. A Ray namespace is no boundary: any driver or task of the cluster can
call an actor's ``serve``, and without a proof it gets UnauthenticatedError and nothing else.
The actors' other methods (``pull``, ``push``, ``pull_prefix``, ``close``) are a Ray API like
any actor's, open to every member of the cluster, and Ray pickles their arguments: Ray runs any
code a member of the cluster submits, on every node, so the cluster's membership is the boundary
there; the token guards the movers' protocol between nodes, not the cluster. The tensor's
bytes never pass through Ray's object store:
NIXL READs them one-sided from the source daemon's shared memory into a buffer of the
destination daemon, which publishes it under the name. A mover neither holds CPU slots
(``num_cpus=0``) nor spins while idle.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as e:
    raise ImportError(f"tensorshm.ray needs Ray ({e}): pip install ray") from e

from . import _errors
from .transfer import Mover

# The share of a node's custom resource a mover asks for: the resource only places it.
RESOURCE_SHARE = 0.001
# What ship waits beyond its timeout for the destination's answer (its Finish call to the source
# has 5 s of its own).
_ANSWER_MARGIN_SECONDS = 10.0


def actor_name(node: str) -> str:
    """The name of `node`'s mover actor in its namespace."""
    return f"tensorshm-mover:{node}"


class _ActorPeer:
    """Another node's MoverActor as a tensorshm.transfer.Peer: Mover service calls go to its
    ``serve`` method as Ray actor calls. ``str()`` is its actor name, which the calls' proofs
    name (the mover answers to it alone)."""

    def __init__(self, handle: Any, label: str) -> None:
        self.handle = handle
        self.label = label

    def __str__(self) -> str:
        return self.label

    def call(self, method: str, request: bytes, proof: str,
             timeout: float) -> tuple[bytes, str]:
        reply: bytes
        reply_proof: str
        code: int
        message: str
        try:
            reply, reply_proof, code, message = ray.get(
                self.handle.serve.remote(method, request, proof), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise _errors.TimeoutError(
                f"{method} at mover {self.label}: no answer within {timeout:.3g} s") from None
        except ray.exceptions.RayActorError as e:
            raise _errors.ConnectionError(
                f"{method} at mover {self.label}: its actor is gone ({type(e).__name__})") from None
        if code:
            raise _errors.from_code(code, f"{method} at mover {self.label}: {message}")
        return reply, reply_proof


# A mover holds no CPU slot of its node. (The overloads Ray annotates ray.remote with leave out
# concurrency_groups; mypy keeps a decorated class's own type, without ActorClass's .options.)
@ray.remote(num_cpus=0, concurrency_groups={"serve": 8, "ship": 8})  # type: ignore[call-overload]
class MoverActor:
    """A node's mover as a Ray actor (start it with :func:`start_movers`).

    Peers' calls (``serve``) and this mover's own ships (``pull``, ``push``, ``pull_prefix``) run
    in two concurrency groups of threads: a ship waits on its peer's ``serve``, never on a
    ``serve`` of its own actor, so movers shipping to each other at once cannot deadlock. A
    ship's source or destination is a node name (its mover is looked up in this actor's
    namespace) or a MoverActor handle. Errors are tensorshm's (``ray.get`` raises them wrapped
    in a RayTaskError; :func:`ship` unwraps them).
    """

    def __init__(self, node: str, socket: str | None, hold_seconds: float,
                 token_file: str | None, insecure: bool) -> None:
        self.node = node
        self.socket = socket
        # A mover that cannot start (no daemon at `socket`) keeps the error for info() to raise:
        # Ray's error for a failed __init__ carries only its text, not the tensorshm error.
        self._start_error: _errors.Error | None = None
        try:
            # Peers' proofs name this mover by its actor name (see _ActorPeer).
            self._mover = Mover(socket, listen=None, hold_seconds=hold_seconds,
                                token_file=token_file, insecure=insecure,
                                advertise=[actor_name(node)])
        except _errors.Error as e:
            self._start_error = _errors.from_code(e.code, f"the mover of node \"{node}\": {e}")

    def info(self) -> dict[str, Any]:
        """Where this mover runs: its node name, Ray node id, the resources Ray assigned it,
        pid, NIXL agent name and tensorshmd socket. Raises the error that kept the mover from
        starting (start_movers then ends the actor)."""
        if self._start_error is not None:
            raise self._start_error
        context = ray.get_runtime_context()
        return {"node": self.node, "node_id": context.get_node_id(),
                "resources": context.get_assigned_resources(),  # type: ignore[no-untyped-call]
                "pid": os.getpid(),
                "agent": self._mover.name, "socket": self.socket}

    @ray.method(concurrency_group="serve")
    def serve(self, method: str, request: bytes, proof: str = "") -> tuple[bytes, str, int, str]:
        """A peer's Mover service call with its proof (tensorshm.transfer.Mover.serve): (reply,
        its proof, 0, "") or (b"", "", the error's gRPC code, its message), as a gRPC status
        would carry it. UnauthenticatedError's code for a call without a valid proof."""
        if self._start_error is not None:
            return b"", "", self._start_error.code, str(self._start_error)
        try:
            return *self._mover.serve(method, request, proof), 0, ""
        except _errors.Error as e:
            return b"", "", e.code, str(e)

    @staticmethod
    def _peer(node: Any) -> _ActorPeer:
        """The mover of `node`, a node name or a handle. A name is looked up for every ship (Ray
        answers from its own table, in microseconds), so a mover started again is found."""
        if isinstance(node, str):
            return _ActorPeer(_lookup(node), actor_name(node))
        return _ActorPeer(node, actor_name(ray.get(node.info.remote())["node"]))

    @ray.method(concurrency_group="ship")
    def pull(self, source: Any, name: str, as_name: str | None = None, *, replace: bool = False,
             timeout: float | None = None) -> str:
        """Ships `name` from `source`'s daemon into this node's (tensorshm.transfer.Mover.pull):
        the name published here."""
        return self._mover.pull(self._peer(source), name, as_name, replace=replace,
                                timeout=timeout)

    @ray.method(concurrency_group="ship")
    def push(self, destination: Any, name: str, as_name: str | None = None, *,
             replace: bool = False, timeout: float | None = None) -> str:
        """Ships `name` from this node's daemon into `destination`'s (Mover.push)."""
        return self._mover.push(self._peer(destination), name, as_name, replace=replace,
                                timeout=timeout)

    @ray.method(concurrency_group="ship")
    def pull_prefix(self, source: Any, prefix: str, *, replace: bool = False,
                    timeout: float | None = None) -> list[str]:
        """Ships every name under `prefix` at `source` into this node's daemon
        (Mover.pull_prefix): the names, in order."""
        return self._mover.pull_prefix(self._peer(source), prefix, replace=replace,
                                       timeout=timeout)

    def close(self) -> None:
        """Closes the mover: drops its holds, its NIXL agent and its tensorshmd session."""
        self._mover.close()


def _lookup(node: str) -> Any:
    # ConnectionError, as over gRPC where a mover that is gone cannot be reached. Ray drops a
    # dead actor's name once the GCS sees it dead; until then the lookup finds the dying actor
    # and the call on it fails with ConnectionError too (`_Mover._call`).
    try:
        return ray.get_actor(actor_name(node))
    except ValueError:
        raise _errors.ConnectionError(
            f"node = \"{node}\": no mover runs for it in namespace "
            f"\"{ray.get_runtime_context().namespace}\" (tensorshm.ray.start_movers starts it)"
        ) from None


def get_mover(node: Any) -> Any:
    """`node`'s MoverActor handle (a handle is returned as it is): ConnectionError when no mover
    runs for it in this job's namespace."""
    return _lookup(node) if isinstance(node, str) else node


def _placement(node: str, alive: list[dict[str, Any]]) -> dict[str, Any]:
    """Actor options that pin a mover to `node`: a node id, or a custom resource of one node."""
    if any(n["NodeID"] == node for n in alive):
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
    having = [n["NodeID"] for n in alive if n["Resources"].get(node, 0) > 0]
    if len(having) != 1:
        raise _errors.InvalidArgumentError(
            f"node = \"{node}\": neither the id of an alive node nor a custom resource of exactly "
            f"one (it is a resource of {len(having)} alive nodes)")
    return {"resources": {node: RESOURCE_SHARE}}


def start_movers(nodes: Mapping[str, str | None] | None = None, *, socket: str | None = None,
                 token_file: str | None = None, insecure: bool = False,
                 hold_seconds: float = 60.0, lifetime: str | None = None,
                 timeout: float = 60.0) -> dict[str, Any]:
    """Starts a mover actor per node and waits until each serves; returns {node: handle}.

    `nodes`: node name -> that node's tensorshmd socket (None: the default, as
    ``tensorshm.connect()``). A name is a custom resource that exactly one alive node has, or a
    node's id (hex, as ``ray.get_runtime_context().get_node_id()``). Without `nodes`: a mover on
    every alive node, named by its id, each on `socket`. `token_file`: the fleet secret's path on
    every node (each mover reads its node's file; it must be readable by the movers' uid alone);
    without it the movers refuse to start unless `insecure` (any caller of an actor's ``serve``
    can then ship the nodes' tensors). `hold_seconds`: the longest a mover keeps a lease or
    buffer for a peer that died mid-ship. `lifetime`: Ray's actor lifetime
    ("detached": the movers outlive this job; others in the namespace ship with them).

    Raises InvalidArgumentError for a name that pins no single node, AlreadyExistsError when a
    mover runs already under a name, TimeoutError when the movers do not start within `timeout`
    seconds, and the mover's own error when one cannot start (its daemon is not there: the
    error names the socket); no mover of the call stays then.
    """
    alive = [n for n in ray.nodes() if n["Alive"]]  # type: ignore[no-untyped-call]
    if nodes is None:
        nodes = {n["NodeID"]: socket for n in alive}
    placements = {node: _placement(node, alive) for node in nodes}
    movers: dict[str, Any] = {}
    try:
        for node, node_socket in nodes.items():
            try:
                movers[node] = MoverActor.options(  # type: ignore[attr-defined]
                    name=actor_name(node), lifetime=lifetime, **placements[node],
                ).remote(node, node_socket, hold_seconds, token_file, insecure)
            except ValueError as e:  # the name is taken
                raise _errors.AlreadyExistsError(
                    f"node = \"{node}\": a mover runs for it already ({e})") from None
        _wait([m.info.remote() for m in movers.values()], timeout, "start_movers")
    except BaseException:
        for handle in movers.values():
            ray.kill(handle)
        raise
    return movers


def stop_movers(movers: Mapping[str, Any] | Iterable[Any], *, timeout: float = 30.0) -> None:
    """Closes and ends the movers given as start_movers returned them (or node names or
    handles). A ship in flight fails; its source and destination keep nothing of it."""
    handles = [get_mover(m) for m in (movers.values() if isinstance(movers, Mapping) else movers)]
    try:
        ray.get([h.close.remote() for h in handles], timeout=timeout)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        pass  # a mover that is gone or stuck: killing it ends its daemon session all the same
    for handle in handles:
        ray.kill(handle)


def ship(name: str, from_node: Any, to_node: Any, as_name: str | None = None, *,
         replace: bool = False, timeout: float = 60.0) -> str:
    """Ships the tensor published as `name` in `from_node`'s tensorshmd to `to_node`'s, where
    it is published as `as_name` (default: the same name); returns that name. The nodes are
    names given to start_movers or MoverActor handles; `to_node`'s mover pulls (a one-sided NIXL
    READ into its daemon's shared memory).

    Raises tensorshm's errors: NotFoundError when `name` is not published at the source,
    AlreadyExistsError when `as_name` is taken at the destination and not `replace`,
    TimeoutError past `timeout` seconds, ConnectionError when a node has no mover (it never
    started, or it is gone). For an ObjectRef instead:
    ``get_mover(to_node).pull.remote(from_node, name, ...)``.
    """
    published: str = _wait(get_mover(to_node).pull.remote(
        from_node, name, as_name, replace=replace, timeout=timeout),
        timeout + _ANSWER_MARGIN_SECONDS, f"ship {name} to {to_node}")
    return published


def ship_prefix(prefix: str, from_node: Any, to_node: Any, *, replace: bool = False,
                timeout: float = 60.0) -> list[str]:
    """Ships every name under `prefix` at `from_node` to `to_node`, as :func:`ship` ships one;
    returns the names, in order."""
    names: list[str] = _wait(get_mover(to_node).pull_prefix.remote(
        from_node, prefix, replace=replace, timeout=timeout),
        timeout + _ANSWER_MARGIN_SECONDS, f"ship_prefix {prefix} to {to_node}")
    return names


def _wait(refs: Any, timeout: float, what: str) -> Any:
    """ray.get(refs), with a mover's errors raised as tensorshm's."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise _errors.TimeoutError(f"{what}: no answer within {timeout:.3g} s") from None
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, _errors.Error):
            raise e.cause from None
        raise
    except ray.exceptions.RayActorError as e:
        raise _errors.ConnectionError(f"{what}: a mover's actor is gone: {e}") from None
