"""The Trio shell around the scheduling core: request actors, the scheduler
actor, executors, the embedded API and the offline `LLM` facade.

    from cadence.actors import EngineConfig, SamplingParams, open_engine

    async with open_engine(EngineConfig()) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=8)):
            ...
"""

from cadence.statemachine.config import CacheConfig, SchedulerConfig
from cadence.statemachine import errors as _errors
from cadence.statemachine.errors import *  # noqa: F401,F403  (every user-facing error)
from cadence.statemachine.sampling import SamplingParams

from .engine import Engine, EngineConfig, RequestStream, open_engine
from .llm import LLM
from .request_actor import RequestOutput, RequestResult

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
] + list(_errors.__all__)
