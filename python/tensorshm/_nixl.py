"""tensorshm.transfer's NIXL side: one agent per Mover, registering the span of each tensor it
ships for that transfer only and running one-sided READs and WRITEs (see transfer.py).

Which UCX transports the agent may use is this module's business. UCX emulates RDMA in software
(over TCP, shared memory, UD) where a transport has none, and it serves that emulation to any
peer that holds the agent's worker address, whatever this side's own settings: a put or get to
any address of the mover's process, registered or not. So:

- Without mTLS (a fleet token alone: the metadata, worker address included, crosses the wire
  readable), the agent reaches processes of its own host only: shared memory, CMA (the kernel
  lets a same-uid or CAP_SYS_PTRACE process alone touch another's memory that way) and cuda_ipc.
  Between hosts the bytes then go over the authenticated gRPC stream.
- With mTLS (the metadata goes to the fleet's movers alone), every transport but TCP: RDMA verbs
  between hosts as well. A mover of the fleet is then trusted with the others' processes.
- Never UCX's TCP transport (it listens on every interface) and never this side's use of the
  emulation (UCX_PROTO_EMULATION_ENABLE=n): a READ or WRITE runs only where a transport does it
  for real, and fails at once, before a byte moves, where none does (the Mover then sends the
  bytes over gRPC). With TCP left out the agent listens on no port at all.

``allow_tcp_rma`` lets all of it in (see Mover).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from . import _errors

_POLL_SECONDS = 0.0005
# The transports a mover's agent may use unless TCP RMA is allowed, with UCX's software emulation
# of RDMA off: those within one host, or (with mTLS) all but TCP.
HOST_UCX_TLS = "shm,cuda_ipc,cuda_copy,self"  # less cuda_* where no CUDA driver loads
FLEET_UCX_TLS = "^tcp"
_HOST_TRANSPORTS = {"shm", "sm", "posix", "sysv", "cma", "knem", "xpmem", "self", "cuda_ipc",
                    "cuda_copy", "cuda", "rocm_ipc", "rocm_copy", "rocm"}
_EMULATION = "UCX_PROTO_EMULATION_ENABLE"
# After this many metadata loads of one peer with nothing in flight, the peer is dropped and
# loaded afresh on its next transfer, so that the registrations of past transfers do not pile up.
_PEER_RELOADS = 256
_env_lock = threading.Lock()  # UCX reads UCX_TLS while a backend is made


def _import_nixl() -> Any:
    """NIXL's Python API from the backend package installed (nixl-cu12 or nixl-cu13), taken
    directly: the `nixl` package picks one by the CUDA version torch was built for, and with a
    CUDA 13 torch in the environment it refuses a nixl-cu12 that works (host memory needs no
    CUDA at all)."""
    errors = []
    for package in ("nixl_cu12", "nixl_cu13"):
        try:
            return importlib.import_module(f"{package}._api")
        except ImportError as e:
            errors.append(f"{package}: {e}")
    raise _errors.FailedPreconditionError(
        f"tensorshm.transfer needs NIXL to move bytes by RDMA or shared memory "
        f"({'; '.join(errors)}): pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1 (make "
        "test-multinode installs it into .venv), or transport=\"grpc\"")


def tcp_allowed(tls: str) -> bool:
    """Whether a UCX_TLS value lets UCX use its TCP transport."""
    names = {n.strip() for n in tls.split(",") if n.strip()}
    if tls.startswith("^"):
        return "tcp" not in {n.lstrip("^") for n in names}
    return bool(names & {"tcp", "all"})


def _host_tls() -> str:
    """HOST_UCX_TLS, without the CUDA transports where the CUDA driver does not load (UCX would
    warn that they are not available at every start)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "shm,self"
    return HOST_UCX_TLS


def _host_only(tls: str) -> bool:
    """Whether a UCX_TLS value names transports within one host only."""
    names = {n.strip() for n in tls.split(",") if n.strip()}
    return not tls.startswith("^") and names <= _HOST_TRANSPORTS


class UnsafeUcx(_errors.FailedPreconditionError):
    """The environment lets UCX do software RDMA (TCP, or its emulation) and the mover was not
    told that it may."""


class NoPath(_errors.ConnectionError):
    """No UCX transport this agent may use reaches the peer (nothing was moved)."""


@dataclass
class Registration:
    """One registered span: its NIXL registration and where it lies."""

    handle: Any
    kind: str  # "DRAM" or "VRAM"
    device: int
    address: int
    length: int


def _where(place: dict[str, Any]) -> tuple[str, int]:
    """NIXL's memory kind and device of a segment_place() dict."""
    if place["device"] == "cuda":
        return "VRAM", int(place["device_id"])
    return "DRAM", 0


class Agent:
    """This mover's NIXL agent. Without NIXL's progress thread (it spins a core): the Mover polls
    while it serves a transfer, and an initiator polls its own transfer. Thread-safe."""

    def __init__(self, name: str, *, allow_tcp_rma: bool = False, mtls: bool = False) -> None:
        api = _import_nixl()
        self._api = api
        tls = os.environ.get("UCX_TLS")
        if tls is not None and tcp_allowed(tls) and not allow_tcp_rma:
            raise UnsafeUcx(
                f"UCX_TLS = \"{tls}\" lets UCX use TCP, whose RDMA emulation lets any peer that "
                "reaches its port read and write this process's memory: leave TCP out, or "
                "allow_tcp_rma=True (--allow-tcp-rma) knowing that")
        if tls is not None and not (mtls or allow_tcp_rma or _host_only(tls)):
            raise UnsafeUcx(
                f"UCX_TLS = \"{tls}\" names transports between hosts, and without mTLS the "
                "agent's worker address crosses the wire readable: whoever sees it can read "
                "and write this process's memory through UCX's emulated RDMA. Use mTLS "
                f"(--tls-*), or transports of one host ({HOST_UCX_TLS})")
        emulation = os.environ.get(_EMULATION)
        if emulation is not None and emulation.lower() not in ("n", "no", "0", "off", "false") \
                and not allow_tcp_rma:
            raise UnsafeUcx(
                f"{_EMULATION} = \"{emulation}\" turns on UCX's software RDMA, which lets a peer "
                "read and write any address of this process: unset it, or allow_tcp_rma=True "
                "(--allow-tcp-rma) knowing that")
        config = api.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=[],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.name = name
        self.nixl = api.nixl_agent(name, config)
        with _env_lock:
            saved = {k: os.environ.get(k) for k in ("UCX_TLS", _EMULATION)}
            if not allow_tcp_rma:
                os.environ.setdefault("UCX_TLS", FLEET_UCX_TLS if mtls else _host_tls())
                os.environ[_EMULATION] = "n"
            try:
                # Peer failure handling needs a transport with its own connection (TCP, RDMA):
                # the shared-memory ones have none, and a dead peer's transfer then ends at its
                # deadline instead.
                self.nixl.create_backend("UCX", {
                    "ucx_error_handling_mode": "peer" if allow_tcp_rma else "none"})
            except Exception as e:  # the nixl._bindings errors
                raise _errors.FailedPreconditionError(
                    f"NIXL agent {name}: its UCX backend did not start ({e})") from e
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
        self._lock = threading.Lock()
        self._peers: dict[str, bytes] = {}  # agent name -> the metadata loaded last
        self._loads: dict[str, int] = {}  # agent name -> loads since it was added
        self._busy: dict[str, int] = {}  # agent name -> transfers in flight with it
        self._registered: set[int] = set()  # id() of the live Registrations
        # Peers that UCX found no transport to, with the emulation off: their bytes go by gRPC.
        self._no_path: set[str] = set()

    def register(self, place: dict[str, Any]) -> Registration:
        """Registers the span of a tensor's bytes (a segment_place() dict) for one transfer;
        deregister it once the transfer is over. UnimplementedError, naming the device, where
        NIXL cannot register device memory (its UCX built without CUDA support, or no GPU
        driver)."""
        kind, device = _where(place)
        address, length = int(place["address"]), int(place["nbytes"])
        try:
            handle = self.nixl.register_memory([(address, length, device, "")], kind)
        except Exception as e:  # the nixl._bindings errors
            if kind == "DRAM":
                raise _errors.InternalError(f"NIXL cannot register {length} bytes: {e}") from e
            raise _errors.UnimplementedError(
                f"device = \"cuda:{device}\": NIXL here cannot register device memory as VRAM "
                f"({e}: its UCX has no CUDA support, or there is no GPU driver); "
                "tensorshm.transfer moves host tensors only on this machine") from e
        registration = Registration(handle, kind, device, address, length)
        with self._lock:
            self._registered.add(id(registration))
        return registration

    def deregister(self, registration: Registration) -> None:
        with self._lock:
            if id(registration) not in self._registered:
                return
            self._registered.discard(id(registration))
        self.nixl.deregister_memory(registration.handle)

    @property
    def registrations(self) -> int:
        """How many spans are registered now."""
        with self._lock:
            return len(self._registered)

    def metadata(self, registration: Registration) -> bytes:
        """What a peer needs to reach `registration`'s span, and no other: the connection and
        that one registration (NIXL's partial metadata)."""
        return bytes(self.nixl.get_partial_agent_metadata(registration.handle, True, ["UCX"]))

    def reaches(self, name: str) -> bool:
        """False once UCX found no transport to agent `name` (see move)."""
        with self._lock:
            return name not in self._no_path

    def descs(self, registration: Registration) -> Any:
        return self.nixl.get_xfer_descs(
            [(registration.address, registration.length, registration.device)],
            registration.kind)

    def remote_descs(self, address: int, length: int, device: str) -> Any:
        """A peer's span as a descriptor list, built here from plain fields."""
        kind, device_id = ("VRAM", int(device[5:])) if device.startswith("cuda:") else ("DRAM", 0)
        return self.nixl.get_xfer_descs([(address, length, device_id)], kind)

    def peer(self, name: str, metadata: bytes) -> str:
        """`name`, after loading its metadata (its latest registrations); ConnectionError when
        it cannot be loaded or reached (no transport both sides may use). Pair with done()."""
        with self._lock:
            if self._peers.get(name) != metadata:
                if (self._loads.get(name, 0) >= _PEER_RELOADS and not self._busy.get(name)
                        and self._peers.pop(name, None) is not None):
                    self.nixl.remove_remote_agent(name)
                    self._loads[name] = 0
                try:
                    loaded = self.nixl.add_remote_agent(metadata)
                except Exception as e:  # the nixl._bindings errors
                    raise _errors.ConnectionError(
                        f"NIXL agent {name}: cannot load its metadata or reach it (no UCX "
                        f"transport both movers may use?): {e}") from e
                if loaded.decode(errors="replace") != name:
                    raise _errors.InvalidArgumentError(
                        f"agent_name = \"{name}\": its metadata is agent "
                        f"\"{loaded.decode(errors='replace')}\"'s")
                self._peers[name] = metadata
                self._loads[name] = self._loads.get(name, 0) + 1
            self._busy[name] = self._busy.get(name, 0) + 1
        return name

    def done(self, name: str) -> None:
        with self._lock:
            self._busy[name] = max(self._busy.get(name, 0) - 1, 0)

    def forget(self, name: str) -> None:
        """After a failed transfer: the peer may have restarted; take its metadata again."""
        with self._lock:
            # The caller's own transfer is the one in flight it may count.
            if self._peers.pop(name, None) is not None and self._busy.get(name, 0) <= 1:
                self.nixl.remove_remote_agent(name)
                self._loads[name] = 0

    def move(self, operation: str, local: Any, remote: Any, peer: str, note: bytes,
             deadline: float) -> None:
        """One NIXL READ or WRITE between `local` and `remote`, polled until done; TimeoutError
        past `deadline`, ConnectionError when the peer is gone, NoPath (before a byte moved)
        when no transport this agent may use reaches it."""
        try:
            handle = self.nixl.initialize_xfer(operation, local, remote, peer, note)
        except Exception as e:  # the nixl._bindings errors
            raise NoPath(
                f"NIXL {operation} with agent {peer}: the span is not one it registered for "
                f"this transfer, or no transport reaches it: {e}") from e
        try:
            try:
                state = self.nixl.transfer(handle, note)
            except Exception as e:  # UCX found no protocol: nothing was posted
                with self._lock:
                    self._no_path.add(peer)
                raise NoPath(f"NIXL {operation} with agent {peer}: no transport this mover "
                             f"may use reaches it ({e})") from e
            while state != "DONE":
                if time.monotonic() > deadline:
                    raise _errors.TimeoutError(
                        f"NIXL {operation} from agent {peer}: not done by its deadline")
                time.sleep(_POLL_SECONDS)
                state = self.nixl.check_xfer_state(handle)
        except _errors.Error:
            raise
        except Exception as e:  # nixlRemoteDisconnectError and the other nixl._bindings errors
            raise _errors.ConnectionError(f"NIXL {operation} with agent {peer}: {e}") from e
        finally:
            self.nixl.release_xfer_handle(handle)

    def poll(self) -> list[bytes]:
        """Progresses the agent's connections; the notifications that came."""
        notes = self.nixl.get_new_notifs()
        return [n for messages in notes.values() for n in messages]

    def close(self) -> None:
        with self._lock:
            for name in self._peers:
                self.nixl.remove_remote_agent(name)
            self._peers.clear()
