"""The engine for asyncio programs (FastAPI, aiohttp, plain `asyncio.run`).

    async with AsyncioEngine(model="demo") as engine:
        async for out in engine.generate("def ", SamplingParams(max_tokens=16)):
            print(out.text, end="")

The engine runs in a thread of its own with its own Trio run (`TrioThread`);
the asyncio side never blocks on it. Every message crosses without waiting:
asyncio asks Trio with `TrioToken.run_sync_soon`, Trio answers with
`loop.call_soon_threadsafe`. A stream is pulled one delta at a time (the
request actor merges whatever piles up meanwhile), so a slow consumer holds
nothing but its own request's output. Cancelling a consuming task, breaking
out of its loop or closing the stream aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

import trio

from cadence.statemachine.errors import ConfigError, EngineClosedError
from cadence.statemachine.sampling import SamplingParams
from cadence.statemachine.stats import StatsSummary

from .engine import Engine, EngineConfig, Prompt, RequestStream, open_engine, result_of
from .llm import engine_config_from_options
from .request_actor import RequestOutput, RequestResult
from .trio_thread import TrioThread

__all__ = ["AsyncioEngine", "AsyncioRequestStream"]


def _post(future: asyncio.Future, result: Any = None, error: BaseException | None = None,
          orphaned: Callable[[Any], None] | None = None) -> None:
    """Settle `future` from the Trio thread (its loop may be gone: then nobody waits).
    If the waiter was cancelled meanwhile, `orphaned(result)` undoes what it asked for."""
    def settle() -> None:
        if future.done():
            if orphaned is not None and error is None:
                try:
                    orphaned(result)
                except EngineClosedError:  # gone with the engine already
                    pass
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    try:
        future.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:
        pass


class _Bridge:
    """The Trio side: the engine and a nursery for the tasks asyncio asks for."""

    def __init__(self, engine: Engine, nursery: trio.Nursery) -> None:
        self.engine = engine
        self.nursery = nursery

    def call(self, async_fn: Callable[..., Awaitable[Any]], args: tuple, future: asyncio.Future,
             orphaned: Callable[[Any], None] | None) -> None:
        """Run `async_fn(*args)` in a task of its own; its outcome settles `future`.
        (Called through `run_sync_soon`, where an exception would end the Trio run.)"""
        try:
            self.nursery.start_soon(self._call, async_fn, args, future, orphaned)
        except RuntimeError:  # the nursery is closing: the engine is going away
            _post(future, error=EngineClosedError("the engine closed"))

    async def _call(self, async_fn, args, future, orphaned) -> None:
        try:
            result = await async_fn(*args)
        except trio.Cancelled:
            _post(future, error=EngineClosedError("the engine closed"))
            raise
        except Exception as exc:  # handed to the asyncio caller, not to the nursery
            _post(future, error=exc)
        else:
            _post(future, result, orphaned=orphaned)


@asynccontextmanager
async def _open_bridge(config: EngineConfig) -> AsyncIterator[_Bridge]:
    async with open_engine(config) as engine:
        async with trio.open_nursery() as nursery:
            yield _Bridge(engine, nursery)
            nursery.cancel_scope.cancel()


class _Pump:
    """One request on the Trio side: takes one pull at a time and answers it."""

    def __init__(self, bridge: _Bridge, stream: RequestStream) -> None:
        self.stream = stream
        self.scope = trio.CancelScope()
        self.pulls_in, self.pulls = trio.open_memory_channel(1)
        bridge.nursery.start_soon(self.run)

    def pull(self, future: asyncio.Future) -> None:
        """Ask for the next delta (at most one pull is outstanding). Called through
        `run_sync_soon`, so it never raises: a pull the pump cannot take is answered."""
        try:
            self.pulls_in.send_nowait(future)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            _post(future, error=EngineClosedError("the request's stream has ended"))

    async def run(self) -> None:
        future = None
        try:
            with self.scope:
                async for future in self.pulls:
                    try:
                        out = await self.stream.__anext__()
                    except StopAsyncIteration:
                        out = None
                    except Exception as exc:  # the request's own error, for its consumer
                        _post(future, error=exc)
                        future = None
                        return
                    _post(future, out)
                    future = None
                    if out is None:  # the stream has ended
                        return
        finally:
            self.pulls.close()
            if future is not None:
                _post(future, error=EngineClosedError("the engine closed"))
            await self.stream.aclose()  # aborts the request if it still runs


class AsyncioRequestStream:
    """The deltas of one request, for asyncio: `async for out in stream`.

    Submission happens on the first iteration (or `await stream.start()`);
    validation errors raise there.
    """

    def __init__(self, engine: AsyncioEngine, prompt: Prompt, params: SamplingParams | None,
                 options: dict[str, Any]) -> None:
        self._engine = engine
        self._submission = (prompt, params, options)
        self._pump: _Pump | None = None
        self._done = False
        self.request_id: str | None = None
        self.prompt_token_ids: list[int] | None = None

    async def start(self) -> AsyncioRequestStream:
        """Submit the request and wait until the engine accepts it."""
        if self._pump is None:
            prompt, params, options = self._submission
            engine = self._engine
            # A consumer cancelled before the answer leaves a pump nobody pulls: stop it.
            pump, self.request_id, self.prompt_token_ids = await engine._on_trio(
                self._open_pump, prompt, params, options,
                orphaned=lambda opened: engine._send(opened[0].scope.cancel))
            self._pump = pump
        return self

    @staticmethod
    async def _open_pump(bridge: _Bridge, prompt, params, options) -> tuple[_Pump, str, list[int]]:
        stream = await bridge.engine.generate(prompt, params, **options).start()
        return _Pump(bridge, stream), stream.request_id, stream.prompt_token_ids

    def __aiter__(self) -> AsyncioRequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        await self.start()
        future = asyncio.get_running_loop().create_future()
        try:
            self._engine._send(self._pump.pull, future)
            out = await future
        except BaseException:
            self._done = True
            self._stop()
            raise
        if out is None:
            self._done = True
            raise StopAsyncIteration
        return out

    async def aclose(self) -> None:
        """Abort the request if it is still running."""
        self._done = True
        self._stop()

    def _stop(self) -> None:
        if self._pump is not None:
            self._engine._send(self._pump.scope.cancel)

    async def collect(self) -> RequestResult:
        """Consume the stream and return the request as a whole."""
        deltas = [out async for out in self]
        prompt = self._submission[0]
        return result_of(deltas, self.prompt_token_ids, prompt if isinstance(prompt, str) else None)

    def __del__(self) -> None:
        if not self._done and self._pump is not None:
            try:
                self._stop()
            except Exception:  # a finaliser may run after the engine is gone
                pass


class AsyncioEngine:
    """A running engine for asyncio code: `async with AsyncioEngine(config) as engine:`.

    Takes what `LLM` takes: an EngineConfig, a model name, or keyword options
    (vLLM's names or Cadence's). `generate` streams `RequestOutput` deltas;
    `abort` and `stats` answer as the Trio `Engine`'s do, awaited.
    """

    def __init__(self, config: EngineConfig | str | None = None, **kwargs: Any) -> None:
        if isinstance(config, str):
            kwargs["model"], config = config, None
        if config is None:
            config = engine_config_from_options(**kwargs)
        elif kwargs:
            raise ConfigError("pass either an EngineConfig or keyword options, not both")
        self.config = config
        self._host: TrioThread[_Bridge] | None = None

    async def __aenter__(self) -> AsyncioEngine:
        host = TrioThread(lambda: _open_bridge(self.config), name="cadence-asyncio")
        # Starting loads the model: done in a worker thread, so the event loop runs on.
        await asyncio.to_thread(host.start)
        self._host = host
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        host, self._host = self._host, None
        if host is not None:
            await asyncio.to_thread(host.stop)

    def _send(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call the synchronous `fn(*args)` in the Trio thread soon, without waiting."""
        host = self._host
        if host is None or not host.running:
            raise EngineClosedError("the engine is not running (use `async with AsyncioEngine(...)`)")
        host.token.run_sync_soon(fn, *args)

    async def _on_trio(self, async_fn: Callable[..., Awaitable[Any]], *args: Any,
                       orphaned: Callable[[Any], None] | None = None) -> Any:
        """Await `async_fn(bridge, *args)` run in the Trio thread."""
        future = asyncio.get_running_loop().create_future()
        bridge = self._host.resource if self._host is not None else None
        self._send(lambda: bridge.call(async_fn, (bridge, *args), future, orphaned))
        return await future

    def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                 **options: Any) -> AsyncioRequestStream:
        """Stream a request's deltas: `async for out in engine.generate(...)`; options as
        `Engine.generate` takes them (priority, tenant, deadline_s, request_id, ...)."""
        return AsyncioRequestStream(self, prompt, params, options)

    async def abort(self, request_id: str, detail: str = "aborted") -> None:
        """Abort a live request; raises RequestNotFoundError if none has this id."""
        await self._on_trio(lambda bridge: bridge.engine.abort(request_id, detail))

    async def stats(self) -> StatsSummary:
        """The scheduling core's counters, read in the engine's thread."""
        async def read(bridge: _Bridge) -> StatsSummary:
            return bridge.engine.stats()
        return await self._on_trio(read)

    async def wait_idle(self) -> None:
        """Wait until every submitted request has completed."""
        await self._on_trio(lambda bridge: bridge.engine.wait_idle())
