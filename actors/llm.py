"""`LLM`: synchronous, offline generation over the whole engine.

    llm = LLM(max_num_seqs=8)
    results = llm.generate(["Hello", "World"], SamplingParams(max_tokens=16))

The engine (and its executor, with the model's weights) starts on the first
`generate` in a background thread with its own Trio run, and serves every
later call until `close()` (or the end of a `with LLM(...) as llm:` block).
Each call submits every prompt at once in order (again later, if the waiting
queue was full) and collects the finished requests.
"""

from __future__ import annotations

import sys
from typing import Sequence, Union

import trio

from cadence.statemachine.errors import ConfigError, QueueFullError
from cadence.statemachine.sampling import SamplingParams
from cadence.statemachine.stats import StatsSummary

from .chat import EngineChat
from .engine import Engine, EngineConfig, open_engine
from .request_actor import RequestResult
from .trio_thread import TrioThread

__all__ = ["LLM"]

Prompt = Union[str, Sequence[int]]


class _NoBar:
    """Stands in for a progress bar when there is none."""

    def update(self, n: int = 1) -> None:
        """Count `n` more finished prompts (nothing to show)."""

    def close(self) -> None:
        """Nothing to close."""


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc="generating", unit="req", file=sys.stderr)


class LLM:
    """Offline batch generation with a synchronous API.

    Pass an `EngineConfig`, or its fields as keywords (SchedulerConfig and
    CacheConfig fields are accepted flat, e.g. `LLM(max_num_seqs=8)`).
    """

    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        if config is not None and kwargs:
            raise ConfigError("pass either an EngineConfig or keyword options, not both")
        self.config = config if config is not None else EngineConfig.from_kwargs(**kwargs)
        self.last_stats: StatsSummary | None = None
        self._host: TrioThread[Engine] | None = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Shut the engine down (a later `generate` starts a new one)."""
        host, self._host = self._host, None
        if host is not None:
            host.stop()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing can be reported from a finaliser
            pass

    def _engine(self) -> tuple[TrioThread[Engine], Engine]:
        """The running engine; a new one if there is none or the last one gave up."""
        host = self._host
        if host is not None and (not host.running or host.resource.closed):
            self.close()
            host = None
        if host is None:
            host = TrioThread(lambda: open_engine(self.config), name="cadence-llm")
            host.start()  # raises what starting the engine raised
            self._host = host
        return host, host.resource

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestResult]:
        """Generate for every prompt; results come back in the prompts' order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * len(prompts)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise ConfigError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams")
        host, engine = self._engine()
        return host.run(self._generate, engine, prompts, per_prompt, use_tqdm)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        **template_variables,
    ) -> list[RequestResult]:
        """Generate the assistant's turn of one conversation (a list of messages) or of
        each of several, rendered with the model folder's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        _, engine = self._engine()
        chat = EngineChat(self.config.model, engine.tokenizer)
        prompts = [chat.prompt_ids(conversation, add_generation_prompt=add_generation_prompt,
                                   **template_variables) for conversation in conversations]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    async def _generate(self, engine: Engine, prompts: list[Prompt], params: list[SamplingParams],
                        use_tqdm: bool) -> list[RequestResult]:
        results: list[RequestResult | None] = [None] * len(prompts)
        bar = _progress_bar(len(prompts), use_tqdm)
        try:
            pending = list(range(len(prompts)))
            while pending:
                # Everything is handed over before the first step, in prompt order;
                # what the full waiting queue refused goes again once the rest is done.
                streams = [(i, engine.generate(prompts[i], params[i]).enqueue()) for i in pending]
                refused: list[int] = []

                async def collect(index: int, stream) -> None:
                    try:
                        results[index] = await stream.collect()
                    except QueueFullError:
                        refused.append(index)
                        return
                    bar.update(1)

                async with trio.open_nursery() as nursery:
                    for index, stream in streams:
                        nursery.start_soon(collect, index, stream)
                if len(refused) == len(pending):
                    raise QueueFullError(
                        f"the waiting queue refused all {len(refused)} remaining prompts")
                pending = sorted(refused)
            self.last_stats = engine.stats()
        finally:
            bar.close()
        return results  # type: ignore[return-value]
