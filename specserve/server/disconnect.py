"""A client that leaves: its work is cancelled, which aborts its engine requests (their
KV slots are freed), every task involved is awaited, so no outcome goes unretrieved, and the
handler answers 499 (nobody reads it) without a traceback."""
from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from starlette.requests import Request

Result = TypeVar("Result")


class ClientDisconnected(Exception):
    pass


async def run_unless_disconnected(request: Request, work: Awaitable[Result]) -> Result:
    """Awaits `work` unless the client disconnects first; then cancels it, waits until it
    has wound down and raises ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        # also when this handler itself is cancelled: nothing may outlive it
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def gather_all(*works: Awaitable[Result]) -> list[Result]:
    """asyncio.gather, except that when one fails (or this is cancelled) the others are
    cancelled too, rather than left running, and awaited."""
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone. The body has been read, so the next message the
    server receives is the disconnect. If the server cannot tell, it never returns."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:
        await asyncio.get_running_loop().create_future()
