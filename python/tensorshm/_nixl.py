"""tensorshm.transfer's NIXL side: one agent per Mover, registering the segments it moves and
running one-sided READs and WRITEs (see transfer.py)."""

from __future__ import annotations

import importlib
import threading
import time
from typing import Any

from . import _errors

_POLL_SECONDS = 0.0005


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
        f"tensorshm.transfer needs NIXL ({'; '.join(errors)}): pip install --no-deps "
        "nixl==1.5.1 nixl-cu12==1.5.1 (make test-multinode installs it into .venv)")


class Agent:
    """This mover's NIXL agent: registers each segment mapping once, keeps the peers' metadata,
    and runs transfers. Without NIXL's progress thread (it spins a core): the Mover polls while it
    serves a transfer, and an initiator polls its own transfer."""

    def __init__(self, name: str) -> None:
        api = _import_nixl()
        self._api = api
        config = api.nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.name = name
        self.nixl = api.nixl_agent(name, config)
        # What a peer needs to reach this agent's registered memory: taken again after every
        # registration change (it carries the registrations' keys).
        self.metadata: bytes = self.nixl.get_agent_metadata()
        self._lock = threading.Lock()
        # (memory kind, device, base address, length) of a registered mapping -> its
        # registration
        self._registered: dict[tuple[str, int, int, int], Any] = {}
        self._peers: dict[str, bytes] = {}  # agent name -> the metadata added for it

    def descriptors(self, place: dict[str, Any]) -> Any:
        """The NIXL transfer descriptor of a tensor's bytes (a _segment_place() dict), after
        registering the segment's mapping in this process if it is not yet: host segments as
        DRAM, CUDA segments (the device pointer of the client's IPC open) as VRAM on their
        device. UnimplementedError, naming the device, where NIXL cannot register device
        memory (its UCX built without CUDA support, or no GPU driver)."""
        cuda = place["device"] == "cuda"
        kind, device = ("VRAM", int(place["device_id"])) if cuda else ("DRAM", 0)
        base = place["address"] - place["offset"]
        key = (kind, device, base, int(place["segment_size"]))
        with self._lock:
            if key not in self._registered:
                # A mapping at an address that overlaps this one is gone (its segment was
                # unmapped, by a daemon restart or a shrink): its registration goes too.
                for old, reg in list(self._registered.items()):
                    if old[:2] == key[:2] and old[2] < base + key[3] and base < old[2] + old[3]:
                        self.nixl.deregister_memory(reg)
                        del self._registered[old]
                try:
                    self._registered[key] = self.nixl.register_memory(
                        [(base, key[3], device, "")], kind)
                except Exception as e:  # the nixl._bindings errors
                    if not cuda:
                        raise
                    raise _errors.UnimplementedError(
                        f"device = \"cuda:{device}\": NIXL here cannot register device memory "
                        f"as VRAM ({e}: its UCX has no CUDA support, or there is no GPU driver); "
                        "tensorshm.transfer moves host tensors only on this machine") from e
                self.metadata = self.nixl.get_agent_metadata()
        return self.nixl.get_xfer_descs([(place["address"], place["nbytes"], device)], kind)

    def peer(self, name: str, metadata: bytes) -> str:
        """`name`, after loading its (new) metadata: ConnectionError when it cannot be reached."""
        with self._lock:
            if self._peers.get(name) != metadata:
                if self._peers.pop(name, None) is not None:
                    self.nixl.remove_remote_agent(name)
                try:
                    self.nixl.add_remote_agent(metadata)
                except Exception as e:  # the nixl._bindings errors
                    raise _errors.ConnectionError(
                        f"NIXL agent {name}: cannot load its metadata or reach it: {e}") from e
                self._peers[name] = metadata
        return name

    def forget(self, name: str) -> None:
        """After a failed transfer: the peer may have restarted; take its metadata again."""
        with self._lock:
            if self._peers.pop(name, None) is not None:
                self.nixl.remove_remote_agent(name)

    def move(self, operation: str, local: Any, remote: Any, peer: str, note: bytes,
             deadline: float) -> None:
        """One NIXL READ or WRITE between `local` and `remote`, polled until done; TimeoutError
        past `deadline`, ConnectionError when the peer is gone."""
        handle = self.nixl.initialize_xfer(operation, local, remote, peer, note)
        try:
            state = self.nixl.transfer(handle, note)
            while state != "DONE":
                if time.monotonic() > deadline:
                    raise _errors.TimeoutError(
                        f"NIXL {operation} from agent {peer}: not done by its deadline")
                time.sleep(_POLL_SECONDS)
                state = self.nixl.check_xfer_state(handle)
        except _errors.Error:
            raise
        except Exception as e:  # nixlRemoteDisconnectError and the other nixl._bindings errors
            self.forget(peer)
            raise _errors.ConnectionError(f"NIXL {operation} with agent {peer}: {e}") from e
        finally:
            self.nixl.release_xfer_handle(handle)

    def poll(self) -> list[bytes]:
        """Progresses the agent's connections; the notifications that came."""
        notes = self.nixl.get_new_notifs()
        return [n for messages in notes.values() for n in messages]

    def close(self) -> None:
        with self._lock:
            for reg in self._registered.values():
                self.nixl.deregister_memory(reg)
            self._registered.clear()
            for name in self._peers:
                self.nixl.remove_remote_agent(name)
            self._peers.clear()
