"""Offline batch generation without Trio, with vLLM's names:

    from cadence.actors import LLM, SamplingParams

    llm = LLM(model="demo", max_num_seqs=8)
    outputs = llm.generate(["def ", "class "], SamplingParams(max_tokens=16))
    print(outputs[0].outputs[0].text)

The engine (and its executor, with the model's weights) starts on the first
`generate` in a background thread with its own Trio run, and serves every
later call until `close()` (or the end of a `with LLM(...) as llm:` block).
Each call submits every prompt at once in order (again later, if the waiting
queue was full) and collects the finished requests.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

import attrs
import trio

from cadence.statemachine.errors import ConfigError, InvalidRequestError, QueueFullError
from cadence.statemachine.sampling import SamplingParams
from cadence.statemachine.stats import StatsSummary

from .chat import EngineChat
from .engine import DEMO_MODEL, Engine, EngineConfig, open_engine, resolve_model
from .request_actor import RequestResult
from .trio_thread import TrioThread

__all__ = ["LLM", "VLLM_OPTIONS", "VLLM_ACCEPTED"]

Prompt = Union[str, Sequence[int]]
# vLLM's prompt shapes: text, token ids, {"prompt": text} or {"prompt_token_ids": ids}.
PromptLike = Union[str, Sequence[int], Mapping[str, Any]]
_PROMPT_SHAPES = ("a str, a list of token ids, {'prompt': str}, {'prompt_token_ids': [int, ...]}, "
                  "or a list of these")

# vLLM's `LLM(...)` keywords and the Cadence option each one sets: an EngineConfig,
# SchedulerConfig or CacheConfig field (given to EngineConfig.from_kwargs), or, after
# "executor_options.", an option of the model executor. Cadence's own names work as well.
VLLM_OPTIONS: dict[str, str] = {
    "model": "model",
    "tensor_parallel_size": "executor_options.tp",
    "gpu_memory_utilization": "executor_options.gpu_memory_utilization",
    "max_model_len": "max_model_len",
    "dtype": "dtype",
    "seed": "seed",
    "device": "device",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "enable_prefix_caching": "enable_prefix_caching",
    "enable_chunked_prefill": "enable_chunked_prefill",
    "block_size": "block_size",
    "num_gpu_blocks_override": "num_blocks",
    "enforce_eager": "executor_options.use_cuda_graphs",
    "tokenizer": "tokenizer",
}
_EXECUTOR_OPTION = "executor_options."
# Cadence's own model-executor options that LLM(...) takes by name.
EXECUTOR_OPTION_NAMES: dict[str, str] = {
    "num_threads": "executor_options.num_threads",
    "cpu_path": "executor_options.cpu_path",
    "prefault_blocks": "executor_options.prefault_blocks",
}
# vLLM keywords taken with no Cadence option behind them, and why.
VLLM_ACCEPTED = {
    # Cadence builds its models from its own code; it never runs a checkpoint's.
    "trust_remote_code": "no checkpoint code is ever run",
}


def _vllm_value(key: str, value: Any, model: Any) -> tuple[bool, Any]:
    """(whether to set it, the Cadence value) of one vLLM keyword whose meaning is
    spelled differently: enforce_eager=True turns CUDA graphs off (False leaves
    the executor's own choice); tokenizer names a folder (or "demo") whose
    tokenizer.json is loaded, unless it is the model's own."""
    if key == "enforce_eager":
        return bool(value), False
    if key == "tokenizer" and isinstance(value, (str, Path)):
        if str(value) == str(model):
            return False, None
        from cadence.gpu.tokenizer import Tokenizer

        return True, Tokenizer.from_pretrained(resolve_model(str(value)))
    return True, value


def engine_config_from_options(**kwargs: Any) -> EngineConfig:
    """An EngineConfig from vLLM's keywords (VLLM_OPTIONS) and Cadence's own."""
    options: dict[str, Any] = {}
    executor_options = dict(kwargs.pop("executor_options", None) or {})
    for key in VLLM_ACCEPTED:
        kwargs.pop(key, None)
    model = kwargs.get("model", DEMO_MODEL)
    for key, value in kwargs.items():
        wanted, value = _vllm_value(key, value, model)
        if not wanted:
            continue
        target = VLLM_OPTIONS.get(key) or EXECUTOR_OPTION_NAMES.get(key, key)
        if target.startswith(_EXECUTOR_OPTION):
            executor_options[target[len(_EXECUTOR_OPTION):]] = value
        elif target in options:
            raise ConfigError(f"option {target!r} given twice (once as {key!r})")
        else:
            options[target] = value
    if executor_options:
        options["executor_options"] = executor_options
    return EngineConfig.from_kwargs(**options)


def _prompt_of(item: Any) -> tuple[Prompt, str | None]:
    """(what the engine takes, the prompt text or None) for one prompt, or a clear error."""
    if isinstance(item, str):
        return item, item
    if isinstance(item, Mapping):
        if isinstance(item.get("prompt_token_ids"), Sequence) and not isinstance(item["prompt_token_ids"], str):
            return list(item["prompt_token_ids"]), item.get("prompt")
        if isinstance(item.get("prompt"), str):
            return item["prompt"], item["prompt"]
        raise InvalidRequestError(f"a prompt dict needs 'prompt' (str) or 'prompt_token_ids' "
                                  f"(list of int), got keys {sorted(item)}")
    if isinstance(item, Sequence) and item and all(type(t) is int for t in item):
        return list(item), None
    raise InvalidRequestError(f"each prompt must be {_PROMPT_SHAPES}; got {type(item).__name__} "
                              f"{item!r:.60}")


def _prompt_list(prompts: Any) -> list[tuple[Prompt, str | None]]:
    """Every prompt of a call: one prompt of any shape, or a list of them."""
    single = isinstance(prompts, (str, Mapping)) or (
        isinstance(prompts, Sequence) and bool(prompts) and type(prompts[0]) is int)
    if single:
        return [_prompt_of(prompts)]
    if not isinstance(prompts, Sequence):
        raise InvalidRequestError(f"prompts must be {_PROMPT_SHAPES}; got {type(prompts).__name__}")
    return [_prompt_of(item) for item in prompts]


def _submit(engine: Engine, prompt: Prompt, samples: list[SamplingParams]) -> list:
    """Queue a prompt's samples: one request, or (n > 1) one request group whose
    prompt is computed once."""
    if len(samples) == 1:
        return [engine.generate(prompt, samples[0]).enqueue()]
    streams = engine.generate_group(prompt, samples)
    for stream in streams:
        stream.enqueue()
    return streams


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

    Pass a model (`LLM("demo")`, `LLM(model="path/to/hf_dir")`; the built-in
    demo model by default), an `EngineConfig`, or options as keywords: vLLM's
    names (VLLM_OPTIONS: tensor_parallel_size, gpu_memory_utilization,
    max_model_len, dtype, seed, ...) or any EngineConfig, SchedulerConfig or
    CacheConfig field (e.g. `LLM(max_num_seqs=8)`, `LLM(executor="simulated")`).
    """

    def __init__(self, model: str | EngineConfig | None = None, *,
                 config: EngineConfig | None = None, **kwargs: Any) -> None:
        if isinstance(model, EngineConfig):
            model, config = None, model if config is None else config
        if model is not None:
            kwargs["model"] = model
        if config is not None and kwargs:
            raise ConfigError("pass either an EngineConfig or keyword options, not both")
        self.config = config if config is not None else engine_config_from_options(**kwargs)
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

    def get_tokenizer(self):
        """The engine's tokenizer (starting the engine if it is not running), as vLLM's
        `LLM.get_tokenizer()`; None for a model without one."""
        return self._engine()[1].tokenizer

    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestResult]:
        """Generate for every prompt; results come back in the prompts' order.

        prompts: one prompt or a list; each is text, token ids, {"prompt": text}
        or {"prompt_token_ids": ids}. sampling_params (or `params`): one for all
        prompts or one per prompt. Each result answers to vLLM's names
        (`result.outputs[0].text`) and to Cadence's (`result.text`).
        """
        if params is not None and sampling_params is not None:
            raise ConfigError("pass sampling_params or params, not both")
        params = sampling_params if sampling_params is not None else params
        items = _prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * len(items)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(items):
                raise ConfigError(f"{len(items)} prompts but {len(per_prompt)} SamplingParams")
        host, engine = self._engine()
        results = host.run(self._generate, engine, [prompt for prompt, _ in items],
                           [p.samples() for p in per_prompt], use_tqdm)
        # A token-id prompt that came with its text keeps that text as `prompt`.
        return [result if text is None or result.prompt is not None else attrs.evolve(result, prompt=text)
                for result, (_, text) in zip(results, items)]

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
                streams = [(i, _submit(engine, prompts[i], params[i])) for i in pending]
                refused: list[int] = []

                async def collect(index: int, group) -> None:
                    try:
                        first, *samples = [await stream.collect() for stream in group]
                    except QueueFullError:
                        for stream in group:
                            await stream.aclose()
                        refused.append(index)
                        return
                    results[index] = attrs.evolve(first, samples=samples) if samples else first
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
