"""The Trio shell around the scheduling core: request actors, the scheduler
actor, executors, the embedded API and the offline `LLM` facade.

    from cadence.actors import EngineConfig, SamplingParams, open_engine

    async with open_engine(EngineConfig()) as engine:      # the built-in demo model
        async for out in engine.generate("def ", SamplingParams(max_tokens=8)):
            ...

`LLM` runs batches from synchronous code and `AsyncioEngine` embeds the engine in
an asyncio program.
"""

import cadence.gpu  # noqa: F401  (first: sets OpenMP's spin count before torch loads; see gpu/openmp_env.py)
from cadence.statemachine.config import CacheConfig, SchedulerConfig
from cadence.statemachine import errors as _errors
from cadence.statemachine.errors import *  # noqa: F401,F403  (every user-facing error)
from cadence.statemachine.sampling import SamplingParams

from .engine import Engine, EngineConfig, RequestStream, open_engine
from .llm import LLM
from .request_actor import CompletionOutput, Logprob, RequestOutput, RequestResult

__all__ = [
    "open_engine",
    "Engine",
    "EngineConfig",
    "RequestStream",
    "RequestOutput",
    "RequestResult",
    "SamplingParams",
    "SchedulerConfig",
    "CacheConfig",
    "LLM",
    "CompletionOutput",
    "Logprob",
    "AsyncioEngine",
] + list(_errors.__all__)


def __getattr__(name: str):
    # The asyncio bridge (and asyncio itself) loads only for the programs that use it.
    if name == "AsyncioEngine":
        from .asyncio_engine import AsyncioEngine
        return AsyncioEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
