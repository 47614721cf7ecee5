"""Process lifecycle hooks, installed once when tensorshm is imported: interpreter exit (waits
woken, nanobind's leak warnings quieted when daemon threads hold objects) and fork."""

from __future__ import annotations

import atexit
import os
import threading

from . import _tensorshm

# At interpreter exit, before threading joins non-daemon threads: waits in progress (get,
# create or put with a timeout) are woken and raise CancelledError, and later ones raise it at
# once, so that a thread blocked in get(name, timeout=None) cannot keep the process from
# exiting, and daemon threads let go of what they hold before finalization.
try:
    threading._register_atexit(_tensorshm._cancel_waits_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # pragma: no cover - older or exiting interpreters
    atexit.register(_tensorshm._cancel_waits_at_exit)


def _at_exit() -> None:
    """After threading joined its threads: a thread still alive is a daemon thread, which
    finalization freezes with whatever it holds (tensors, clients). nanobind would report those
    as leaked at teardown; they are not (the process is exiting, and the daemon reclaims the
    session's leases and buffers when its connection closes), so its warnings are turned off
    then, and only then."""
    if threading.active_count() > 1:
        _tensorshm._quiet_leak_warnings()


atexit.register(_at_exit)

# In a child of fork(), the client the DLPack exchange API's allocator creates tensors through is
# the parent's (it cannot allocate there), and a parent thread may have held the lock around it.
os.register_at_fork(after_in_child=_tensorshm._after_fork_in_child)
