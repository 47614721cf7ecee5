"""The asyncio side of Client (aget, aget_many, aput): each runs its blocking call in a worker
thread of its own and awaits it without blocking the event loop; cancelling the awaiting task
wakes the wait and releases what it got."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable, TypeVar

from . import _tensorshm
from ._tensorshm import Tensor

if TYPE_CHECKING:
    from ._client import Client

_T = TypeVar("_T")


async def aget(client: Client, name: str, timeout: float | None) -> Tensor:
    """Client.aget: the fast path on the loop's thread, else the wait in a worker thread."""
    native = client._native
    tensor = native.try_get_local(name)
    if tensor is not None:
        return tensor
    t = None if timeout is None else float(timeout)
    return await off_loop(lambda cancel: native.get(name, t, cancel),
                          lambda tensor: tensor.release())


async def aget_many(client: Client, names: Iterable[str], timeout: float | None) -> list[Tensor]:
    """Client.aget_many."""
    listed = list(names)
    return await off_loop(lambda cancel: client._get_many(listed, timeout, cancel), _release_all)


async def aput(client: Client, name: str, obj: Any, replace: bool,
               timeout: float | None) -> Tensor:
    """Client.aput."""
    return await off_loop(
        lambda cancel: client._put(name, obj, replace, timeout, cancel),
        lambda tensor: tensor.release())


def _release_all(tensors: list[Tensor]) -> None:
    for tensor in tensors:
        tensor.release()


async def off_loop(call: Callable[[_tensorshm._WaitCanceller], _T],
                   release: Callable[[_T], None]) -> _T:
    """Runs ``call(cancel)`` in a worker thread (its own: a wait may last, and must not hold up
    other calls) and awaits its result without blocking the loop. Cancelling the awaiting task
    cancels the wait, waits for the call to end (promptly), and ``release``s what it got."""
    loop = asyncio.get_running_loop()
    cancel = _tensorshm._WaitCanceller()
    done: asyncio.Future[_T] = loop.create_future()

    def deliver(result: Any, error: BaseException | None) -> None:
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def work() -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = call(cancel)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            error = e
        try:
            loop.call_soon_threadsafe(deliver, result, error)
        except RuntimeError:  # the loop is closed: nobody takes the result
            if error is None:
                release(result)

    threading.Thread(target=work, name="tensorshm-async", daemon=True).start()
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        cancel.cancel()
        while not done.done():
            try:
                await asyncio.shield(done)
            except asyncio.CancelledError:
                continue
            except BaseException:  # noqa: BLE001 - the call failed: nothing to release
                break
        if done.exception() is None:
            release(done.result())
        raise
