"""The model runner: persistent batch, paged KV cache, one forward and one sampling pass per step.

The runner applies each `StepPlan`'s deltas to its persistent batch, flattens
the scheduled tokens of all requests (prefill chunks and decodes alike) into
one forward pass, and samples a token for every request whose step reached the
end of its known tokens.
"""

from __future__ import annotations

import time
from itertools import chain
from pathlib import Path
from typing import Mapping, Sequence

import attrs
import torch

from cadence.statemachine.errors import ConfigError, ExecutorError
from cadence.statemachine.plan import StepPlan, StepResult
from cadence.statemachine.sampling import SamplingParams

from .attention import AttentionMetadata, get_attention_backend
from .config import ModelConfig
from .loader import load_weights
from .model import build_model, init_random_weights
from .sampler import Sampler

# Sampling parameters of the profiling pass: a full sort of the vocabulary is
# the sampler's largest temporary.
PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


@attrs.define(slots=True)
class CachedRequestState:
    """One request as the runner remembers it between steps.

    token_ids: prompt plus every token sampled so far.
    block_ids: the request's block table; position p lives in block_ids[p // block_size].
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams


@attrs.define(slots=True)
class StepInputs:
    """Device tensors of one forward pass: tokens, positions, attention metadata."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device for a name: "auto" is CUDA when available, else CPU; CUDA without one is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but torch sees no CUDA device; use 'cpu' or 'auto'")
    return device


def default_dtype(config: ModelConfig, device: torch.device) -> torch.dtype:
    """float32 on CPU; on GPU the checkpoint's half-precision dtype, bfloat16 otherwise."""
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if config.dtype == "float16" else torch.bfloat16


class ModelRunner:
    """Holds the model, its paged KV cache and the persistent batch; `execute` runs one step.

    num_blocks: KV blocks per layer. Required on CPU; on CUDA None means "as many
      as fit in `gpu_memory_utilization` of the device after a profiling pass of
      `max_num_batched_tokens` tokens over up to `max_num_seqs` sequences".
    weights_path: a Hugging Face model directory; None initialises weights at
      random from `seed`.
    dtype: a torch dtype or its name ("bfloat16", "bf16", ...); None or "auto"
      is float32 on CPU and the checkpoint's half precision (else bfloat16) on GPU.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        num_blocks: int | None = None,
        block_size: int = 16,
        device: str | torch.device = "auto",
        dtype: torch.dtype | str | None = None,
        attention_backend: str = "reference",
        seed: int = 0,
        weights_path: str | Path | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
    ) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self.config = model_config
        self.device = resolve_device(device)
        if isinstance(dtype, str) and dtype != "auto":
            if dtype not in DTYPES:
                raise ConfigError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {dtype!r}")
            dtype = DTYPES[dtype]
        elif dtype == "auto":
            dtype = None
        self.dtype = dtype or default_dtype(model_config, self.device)
        self.block_size = block_size
        self.max_model_len = model_config.max_model_len
        self.backend = get_attention_backend(attention_backend)
        self.model = build_model(model_config, self.backend, self.dtype, self.device)
        if weights_path is None:
            init_random_weights(self.model, seed)
        else:
            load_weights(self.model, weights_path)
        self.sampler = Sampler(model_config.eos_token_ids, seed=seed, device=self.device)
        if num_blocks is None:
            if self.device.type != "cuda":
                raise ConfigError("num_blocks is required on CPU (it is profiled only on CUDA)")
            num_blocks = self._profile_num_blocks(gpu_memory_utilization, max_num_batched_tokens, max_num_seqs)
        if num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.kv_caches = self._allocate_kv_caches(num_blocks)
        self._requests: dict[str, CachedRequestState] = {}

    @classmethod
    def from_pretrained(cls, directory: str | Path, **kwargs) -> ModelRunner:
        """A runner for the Hugging Face model in `directory` (config.json + safetensors)."""
        return cls(ModelConfig.from_pretrained(directory), weights_path=directory, **kwargs)

    @property
    def vocab_size(self) -> int:
        """Size of the model's output distribution."""
        return self.config.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence token ids from the model's config and generation config."""
        return list(self.config.eos_token_ids)

    @property
    def num_requests(self) -> int:
        """Requests in the persistent batch."""
        return len(self._requests)

    def kv_block_bytes(self) -> int:
        """Bytes one block takes across all layers, K and V."""
        c = self.config
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim * element_size

    def reset(self) -> None:
        """Forget every request (executor restart); cache contents are left as they are."""
        self._requests.clear()

    def execute(self, plan: StepPlan, sampling_params: Mapping[str, SamplingParams]) -> StepResult:
        """Apply the plan's deltas, compute its scheduled tokens, sample where a request reached its end."""
        start_ns = time.perf_counter_ns()
        self._apply_deltas(plan, sampling_params)
        scheduled = self._scheduled_requests(plan)
        if not scheduled:
            return StepResult(plan.step_id, {}, None, (time.perf_counter_ns() - start_ns) // 1000)
        # Decodes first, so a backend can treat the first `num_decode_seqs` sequences alike.
        scheduled.sort(key=lambda item: item[1] != 1)
        inputs = self._build_inputs(
            [(s.token_ids[s.num_computed_tokens : s.num_computed_tokens + n], s.num_computed_tokens, s.block_ids)
             for s, n in scheduled]
        )
        to_sample: list[tuple[CachedRequestState, int]] = []
        last_row = -1
        for state, n in scheduled:
            last_row += n
            if state.num_computed_tokens + n == len(state.token_ids):
                to_sample.append((state, last_row))
        sampled, logprobs = self._forward_and_sample(inputs, to_sample)
        for state, n in scheduled:
            state.num_computed_tokens += n
        order = {rid: i for i, rid in enumerate(plan.num_scheduled_tokens)}
        sampled = dict(sorted(sampled.items(), key=lambda kv: order[kv[0]]))
        return StepResult(plan.step_id, sampled, logprobs, (time.perf_counter_ns() - start_ns) // 1000)

    def _forward_and_sample(self, inputs: StepInputs, to_sample):
        with torch.inference_mode():
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
            if not to_sample:
                return {}, None
            rows = torch.tensor([row for _, row in to_sample], device=self.device)
            logits = self.model.compute_logits(hidden[rows])
            states = [s for s, _ in to_sample]
            out = self.sampler(
                logits,
                [s.sampling_params for s in states],
                [s.token_ids[: s.num_prompt_tokens] for s in states],
                [s.token_ids[s.num_prompt_tokens :] for s in states],
            )
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[list[tuple[int, float]]]] = {}
        for state, token, token_logprobs in zip(states, out.token_ids, out.logprobs):
            state.token_ids.append(token)
            sampled[state.request_id] = [token]
            if token_logprobs is not None:
                logprobs[state.request_id] = [token_logprobs]
        return sampled, (logprobs or None)

    def _apply_deltas(self, plan: StepPlan, sampling_params: Mapping[str, SamplingParams]) -> None:
        for request_id in chain(plan.finished_ids, plan.preempted_ids):
            self._requests.pop(request_id, None)
        for new in plan.new_requests:
            params = sampling_params.get(new.request_id)
            if params is None:
                raise ExecutorError(f"step {plan.step_id}: no SamplingParams for new request {new.request_id!r}")
            if not 0 <= new.num_computed_tokens <= len(new.token_ids):
                raise ExecutorError(
                    f"step {plan.step_id}: request {new.request_id!r} has num_computed_tokens "
                    f"{new.num_computed_tokens} but {len(new.token_ids)} tokens"
                )
            self._requests[new.request_id] = CachedRequestState(
                new.request_id, list(new.token_ids), new.num_prompt_tokens,
                list(new.block_ids), new.num_computed_tokens, params,
            )
        for request_id, block_ids in plan.new_block_ids.items():
            self._state(plan, request_id).block_ids.extend(block_ids)

    def _state(self, plan: StepPlan, request_id: str) -> CachedRequestState:
        state = self._requests.get(request_id)
        if state is None:
            raise ExecutorError(f"step {plan.step_id}: request {request_id!r} is not in the executor's batch")
        return state

    def _scheduled_requests(self, plan: StepPlan) -> list[tuple[CachedRequestState, int]]:
        scheduled = []
        for request_id, n in plan.num_scheduled_tokens.items():
            state = self._state(plan, request_id)
            end = state.num_computed_tokens + n
            where = f"step {plan.step_id}: request {request_id!r}"
            if n < 1 or end > len(state.token_ids):
                raise ExecutorError(
                    f"{where} is scheduled {n} tokens from {state.num_computed_tokens} "
                    f"but knows only {len(state.token_ids)} tokens"
                )
            if end > self.max_model_len:
                raise ExecutorError(f"{where} reaches {end} tokens, past max_model_len {self.max_model_len}")
            num_blocks_needed = -(-end // self.block_size)
            if len(state.block_ids) < num_blocks_needed:
                raise ExecutorError(
                    f"{where} needs {num_blocks_needed} blocks for {end} tokens, has {len(state.block_ids)}"
                )
            bad = [b for b in state.block_ids[:num_blocks_needed] if not 0 <= b < self.num_blocks]
            if bad:
                raise ExecutorError(f"{where} uses block ids {bad} outside [0, {self.num_blocks})")
            scheduled.append((state, n))
        if sum(n for _, n in scheduled) != plan.total_num_scheduled_tokens:
            raise ExecutorError(
                f"step {plan.step_id}: total_num_scheduled_tokens is {plan.total_num_scheduled_tokens}, "
                f"the per-request counts sum to {sum(n for _, n in scheduled)}"
            )
        return scheduled

    def _build_inputs(self, seqs: Sequence[tuple[Sequence[int], int, Sequence[int]]]) -> StepInputs:
        """Flatten (new token ids, first position, block table) per sequence into one step's inputs."""
        q_lens = torch.tensor([len(tokens) for tokens, _, _ in seqs], dtype=torch.int32)
        starts = torch.tensor([start for _, start, _ in seqs], dtype=torch.int64)
        seq_lens = starts.to(torch.int32) + q_lens
        query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        torch.cumsum(q_lens, dim=0, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), q_lens.long())
        positions = torch.arange(num_tokens) - query_start_loc.long()[seq_of_token] + starts[seq_of_token]
        blocks_per_seq = [-(-int(n) // self.block_size) for n in seq_lens]
        block_tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32)
        for i, ((_, _, table), n) in enumerate(zip(seqs, blocks_per_seq)):
            block_tables[i, :n] = torch.as_tensor(table[:n], dtype=torch.int32)
        slot_mapping = (
            block_tables[seq_of_token, positions // self.block_size].long() * self.block_size
            + positions % self.block_size
        )
        input_ids = torch.tensor(list(chain.from_iterable(tokens for tokens, _, _ in seqs)), dtype=torch.long)
        to_device = self._to_device
        meta = AttentionMetadata(
            slot_mapping=to_device(slot_mapping),
            query_start_loc=to_device(query_start_loc),
            seq_lens=to_device(seq_lens),
            block_tables=to_device(block_tables),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            num_decode_seqs=int((q_lens == 1).sum()),
        )
        return StepInputs(to_device(input_ids), to_device(positions), meta)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.config
        # Zeroed, not empty: attention multiplies masked-out cache entries by 0, and NaN * 0 is NaN.
        cache = torch.zeros(
            c.num_layers, 2, num_blocks, self.block_size, c.num_kv_heads, c.head_dim,
            dtype=self.dtype, device=self.device,
        )
        return [(cache[layer, 0], cache[layer, 1]) for layer in range(c.num_layers)]

    def _profile_num_blocks(self, utilization: float, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """KV blocks that fit after the peak memory of a largest-step forward and sampling pass."""
        num_tokens = min(max_num_batched_tokens, self.max_model_len * max_num_seqs)
        num_seqs = min(max_num_seqs, num_tokens)
        q_lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        tables, next_block = [], 0
        for q_len in q_lens:
            n = -(-q_len // self.block_size)
            tables.append(list(range(next_block, next_block + n)))
            next_block += n
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        kv_caches = self.kv_caches = self._allocate_kv_caches(next_block)
        inputs = self._build_inputs([([0] * q, 0, t) for q, t in zip(q_lens, tables)])
        states = [
            CachedRequestState(f"profile-{i}", [0] * q, q, t, 0, PROFILE_SAMPLING)
            for i, (q, t) in enumerate(zip(q_lens, tables))
        ]
        offsets = torch.tensor(q_lens).cumsum(0) - 1
        self._forward_and_sample(inputs, list(zip(states, offsets.tolist())))
        torch.cuda.synchronize(self.device)
        peak_bytes = torch.cuda.max_memory_allocated(self.device) - self.kv_block_bytes() * next_block
        del self.kv_caches, kv_caches
        torch.cuda.empty_cache()
        free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
        other_bytes = total_bytes - free_bytes - torch.cuda.memory_reserved(self.device)
        available = total_bytes * utilization - other_bytes - peak_bytes
        num_blocks = int(available // self.kv_block_bytes())
        if num_blocks < 1:
            raise ConfigError(
                f"no GPU memory left for the KV cache: weights and activations peak at "
                f"{peak_bytes / 2**30:.2f} GiB of {total_bytes * utilization / 2**30:.2f} GiB allowed; "
                f"raise gpu_memory_utilization or lower max_num_batched_tokens"
            )
        return num_blocks
