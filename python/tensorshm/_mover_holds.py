"""tensorshm.transfer's holds: what a mover keeps for its peers' transfers (a source's lease, a
destination's unpublished buffer), what each peer may hold, and how a hold ends.

A hold lives until the peer's Finish or its deadline. One that runs out is deregistered from
NIXL at once and refused to Read, Write and Finish, but its memory is kept one more hold time
before it goes back to the daemon, so that a peer still moving bytes (too slow, or dead) never
reads or writes memory that another tensor has by then.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from . import _errors
from ._nixl import Agent, Registration

_POLL_SECONDS = 0.0005


@dataclass
class Hold:
    """What this mover keeps for a peer's transfer: a source's lease (Offer) or a destination's
    unpublished buffer (Prepare: `name` is what Finish publishes it as), until Finish or
    `deadline`."""

    tensor: Any
    place: dict[str, Any]
    deadline: float
    registration: Registration | None = None
    prepared: bool = False
    name: str = ""
    replace: bool = False
    # Who asked for it (the caller's transport identity, see Service.serve): whose quota it
    # counts against.
    peer: str = ""
    nbytes: int = 0  # the bytes it counts against that quota (from before it was made)
    expired: bool = False  # past its deadline: refused to Read, Write and Finish
    finished: bool = False  # taken by Finish: no chunk lands after
    dropped: bool = False  # its tensor released
    written: set[int] = field(default_factory=set)  # the chunks a Write stream wrote (offsets)
    # Held while a Read or Write copies, and by the drop: no chunk touches memory given back.
    busy: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class Limits:
    """What peers may ask of this mover (see Mover)."""

    hold_seconds: float = 60.0
    offer_prefixes: tuple[str, ...] = ("",)
    accept_prefixes: tuple[str, ...] = ("",)
    peer_quota_bytes: int = 4 << 30
    peer_holds: int = 256  # the most transfers one peer may have held here at once


class HoldTable:
    """The holds of one mover, by transfer id, and what each peer holds (transfers and prepared
    bytes, against its Limits). Thread-safe; a poller thread progresses the agent while NIXL
    transfers are held, and ends holds whose time passed."""

    def __init__(self, agent: Agent | None, limits: Limits) -> None:
        self.agent = agent
        self.limits = limits
        self._holds: dict[str, Hold] = {}
        self._usage: dict[str, tuple[int, int]] = {}  # peer -> (holds, prepared bytes)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._poller = threading.Thread(target=self._poll, name="tensorshm-mover-poll",
                                        daemon=True)
        self._poller.start()

    def add(self, hold: Hold) -> str:
        """Holds `hold` (reserved for its peer first, see reserve); its transfer id."""
        transfer_id = secrets.token_hex(16)
        with self._lock:
            if self._closed:
                raise _errors.ConnectionError("this mover is closing")
            self._holds[transfer_id] = hold
            self._wake.notify()
        return transfer_id

    def reserve(self, caller: str, nbytes: int) -> None:
        """Counts a hold of `nbytes` against `caller`'s quota and hold count, or refuses it
        (ResourceExhaustedError); atomic with other calls'."""
        with self._lock:
            count, held = self._usage.get(caller, (0, 0))
            if count >= self.limits.peer_holds:
                raise _errors.ResourceExhaustedError(
                    f"{caller}: {count} transfers held here already, at most "
                    f"{self.limits.peer_holds}")
            if held + nbytes > self.limits.peer_quota_bytes:
                raise _errors.ResourceExhaustedError(
                    f"layout.nbytes = {nbytes}: {caller} has {held} bytes prepared here, and "
                    f"may have {self.limits.peer_quota_bytes}")
            self._usage[caller] = (count + 1, held + nbytes)

    def unreserve(self, caller: str, nbytes: int) -> None:
        with self._lock:
            count, held = self._usage.get(caller, (1, nbytes))
            if count <= 1:
                self._usage.pop(caller, None)
            else:
                self._usage[caller] = (count - 1, held - nbytes)

    def take(self, transfer_id: str, pop: bool) -> Hold:
        """The live hold of `transfer_id` (`pop`: no longer held after); NotFoundError when
        there is none or its time passed."""
        with self._lock:
            hold = self._holds.get(transfer_id)
            if hold is not None and pop:
                del self._holds[transfer_id]
        if hold is None or hold.expired:
            if hold is not None and pop:
                self.drop(hold)  # the peer says it is done with it
            raise _errors.NotFoundError(
                f"transfer_id = \"{transfer_id}\": no such transfer here (finished, or its "
                "hold time passed)")
        return hold

    def drop(self, hold: Hold) -> None:
        """Ends a hold no longer in the table: its peer's reservation, its registration, its
        tensor (idempotent; waits for a chunk being copied)."""
        with hold.busy:
            if hold.dropped:
                return
            hold.dropped = True
        self.unreserve(hold.peer, hold.nbytes)
        if hold.registration is not None and self.agent is not None:
            self.agent.deregister(hold.registration)
            hold.registration = None
        hold.tensor.release()

    def _poll(self) -> None:
        """While peers' transfers are held: progresses the agent (a peer's READ or WRITE needs
        this side to answer its connection) and ends holds whose time has passed: first their
        registration, one hold time later their memory."""
        while True:
            with self._lock:
                while not self._holds and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                nixl = any(h.registration is not None for h in self._holds.values())
                if not nixl:
                    soonest = min(h.deadline for h in self._holds.values())
                    self._wake.wait(max(soonest - time.monotonic(), 0.0))
            if nixl and self.agent is not None:
                try:
                    self.agent.poll()
                except Exception:
                    pass  # a peer that went away: its transfer fails on its side
            now = time.monotonic()
            ending: list[Hold] = []  # out of time now: deregistered, refused, memory kept
            ended: list[Hold] = []  # out of time for a second hold time: memory given back
            with self._lock:
                for transfer_id, hold in list(self._holds.items()):
                    if hold.deadline >= now:
                        continue
                    if hold.expired:
                        del self._holds[transfer_id]
                        ended.append(hold)
                    else:
                        hold.expired = True
                        hold.deadline = now + self.limits.hold_seconds
                        ending.append(hold)
            for hold in ending:
                with hold.busy:  # no chunk copies past this point
                    registration, hold.registration = hold.registration, None
                if registration is not None and self.agent is not None:
                    self.agent.deregister(registration)
            for hold in ended:
                self.drop(hold)
            if nixl:
                time.sleep(_POLL_SECONDS)

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._holds)

    def close(self) -> None:
        """Drops every hold (a closing mover's peers' transfers fail)."""
        with self._lock:
            self._closed = True
            holds = list(self._holds.values())
            self._holds.clear()
            self._wake.notify()
        self._poller.join()
        for hold in holds:
            self.drop(hold)
