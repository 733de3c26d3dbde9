"""A Trio run in a background thread that keeps an async resource open, so
synchronous programs can use it across many calls.

    host = TrioThread(lambda: open_engine(config), name="cadence-llm")
    engine = host.start()                 # enters `async with open_engine(...)`
    host.run(some_async_fn, engine, ...)  # runs in the Trio thread, blocks for the result
    host.stop()                           # leaves the `async with`, joins the thread

The resource stays open until `stop()` (or until `until(resource)`, when
given, returns by itself); an error raised while opening it is raised by
`start()`, one raised while closing it by `stop()`. Errors come out as
themselves, not inside an exception group.
"""

from __future__ import annotations

import threading
from contextlib import AbstractAsyncContextManager
from typing import Any, Awaitable, Callable, Generic, TypeVar

import trio

from .unwrap import sole_error, unwrap_sole_error

T = TypeVar("T")


class TrioThread(Generic[T]):
    """Hosts `async with open_resource() as resource:` in a thread of its own."""

    def __init__(self, open_resource: Callable[[], AbstractAsyncContextManager[T]], *,
                 name: str = "cadence-trio",
                 until: Callable[[T], Awaitable[Any]] | None = None) -> None:
        self._open = open_resource
        self._until = until
        self.resource: T | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    @property
    def running(self) -> bool:
        """Whether the resource is open and its thread alive."""
        return self._thread.is_alive() and self.resource is not None

    @property
    def token(self) -> trio.lowlevel.TrioToken:
        """The Trio run's token: `token.run_sync_soon(fn)` calls `fn` there without waiting."""
        assert self._token is not None, "start() first"
        return self._token

    def start(self) -> T:
        """Start the thread, open the resource there and return it."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        assert self.resource is not None
        return self.resource

    def run(self, async_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run `async_fn(*args)` in the Trio thread and return its result (or raise)."""
        with unwrap_sole_error():
            return trio.from_thread.run(async_fn, *args, trio_token=self._token)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run the synchronous `fn(*args)` in the Trio thread and return its result."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def stop(self) -> None:
        """Close the resource and wait for the thread to end; raise what closing raised."""
        if self._thread.is_alive() and self._stop is not None:
            try:
                self.call(self._stop.set)
            except trio.RunFinishedError:
                pass
        if self._thread.ident is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        try:
            trio.run(self._host)
        except BaseException as exc:  # surfaced to the caller by start() or stop()
            self._error = sole_error(exc)
        finally:
            self._ready.set()

    async def _host(self) -> None:
        self._stop = stop = trio.Event()
        async with self._open() as resource:
            self.resource = resource
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            if self._until is None:
                await stop.wait()
            else:
                async with trio.open_nursery() as nursery:
                    async def stop_when_asked() -> None:
                        await stop.wait()
                        nursery.cancel_scope.cancel()
                    nursery.start_soon(stop_when_asked)
                    await self._until(resource)
                    nursery.cancel_scope.cancel()
