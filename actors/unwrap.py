"""One error out of an exception group, at the edges users call.

Trio (from 0.25, strict exception groups) wraps every error that leaves a
nursery in an ExceptionGroup, and nested nurseries nest the groups. A user of
`open_engine`, `LLM.generate` or the CLI should see the one error that
happened (`RequestTooLongError`, not a group holding it), so the public entry
points unwrap groups with a single leaf; a group of several errors stays a
group, since none of them alone tells the story.
"""

from __future__ import annotations

import functools
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import AsyncIterator, Callable, Iterator, ParamSpec, TypeVar

__all__ = ["sole_error", "unwrap_sole_error", "unwrapping"]

P = ParamSpec("P")
T = TypeVar("T")


def sole_error(exc: BaseException) -> BaseException:
    """The single error inside nested one-member groups, or `exc` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


@contextmanager
def unwrap_sole_error() -> Iterator[None]:
    """Re-raise a group with one leaf as that leaf, keeping the leaf's own cause and
    context (usable around `async with` blocks as well as plain code)."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaf = sole_error(group)
        if leaf is group:
            raise
        context, cause, suppress = leaf.__context__, leaf.__cause__, leaf.__suppress_context__
        try:
            raise leaf
        finally:
            # Raising inside the handler would chain the group as the leaf's context.
            leaf.__context__, leaf.__cause__ = context, cause
            leaf.__suppress_context__ = suppress
            del leaf, group


def unwrapping(open_fn: Callable[P, AbstractAsyncContextManager[T]]
               ) -> Callable[P, AbstractAsyncContextManager[T]]:
    """Wrap a function returning an async context manager (`open_server`, ...) so that
    what leaves its block is unwrapped as `unwrap_sole_error` does."""
    @asynccontextmanager
    @functools.wraps(open_fn)
    async def opened(*args: P.args, **kwargs: P.kwargs) -> AsyncIterator[T]:
        with unwrap_sole_error():
            async with open_fn(*args, **kwargs) as value:
                yield value
    return opened
