"""The model runner: persistent batch, paged KV cache, one forward and one sampling pass per step.

The runner applies each `StepPlan`'s deltas to its persistent batch, flattens
the scheduled tokens of all requests (prefill chunks and decodes alike) into
one forward pass, and samples a token for every request whose step reached the
end of its known tokens.

Per-step host work is kept proportional to the batch, not to its tokens or
blocks: each request owns a row of a host block table that is written when
blocks are added, a step's integer inputs are built with a few tensor
operations and cross to the device in one copy, and pure-decode steps replay a
CUDA graph (see `cuda_graphs`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from array import array
from collections.abc import Sequence as SequenceABC
from itertools import chain
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

import attrs
import torch

from cadence.statemachine.errors import ConfigError, ExecutorError
from cadence.statemachine.plan import StepPlan, StepResult
from cadence.statemachine.sampling import SamplingParams, StructuredOutput

from . import cpu_kernels, cpu_linear, host_memory, openmp_env
from .attention import AttentionMetadata, get_attention_backend, row_attention_pays
from .config import SMALL_MODEL_MACS, ModelConfig, macs_per_token
from .cuda_graphs import DecodeGraphs, DecodeInputs, StagingBuffer, graph_batch_sizes
from .worklist import BalanceConfig
from .loader import load_weights
from .model import LastRows, build_model, init_random_weights
from .sampler import Sampler, restricted
from .host_memory import zeroed_cpu_tensor
from .threads import AUTO, pin_compute_threads, resolve_num_threads, set_num_threads

_log = logging.getLogger("cadence.gpu")
CPU_PATHS = (AUTO, "packed", "eager")
# Sampling parameters of the profiling pass: a full sort of the vocabulary is
# the sampler's largest temporary.
PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
# Cache blocks kept outside the scheduler's range: padding rows of graph batches write here.
NUM_SCRATCH_BLOCKS = 1
# Matrix-library workspaces the capture stream allocates, with room to spare.
GRAPH_WORKSPACE_BYTES = 64 << 20
# Initial size of the pinned staging buffer of eager steps; it grows on demand.
INITIAL_STAGING_BYTES = 1 << 20
# Prompt positions scored per pass when a request asks for prompt logprobs: bounds
# the float32 logits and log-softmax temporaries to this many rows of the vocabulary.
PROMPT_LOGPROBS_ROWS = 256


class TokenMatcherLike(Protocol):
    """One request's position in its structured-output grammar (cadence.actors.structured
    makes them): the mask of its next token, and each token it takes."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 CPU bitmask."""

    def accept(self, token_id: int) -> bool:
        """Take a sampled token; False if the grammar does not allow it."""


# Builds a request's matcher from its structured output and the tokens it has generated.
MatcherFactory = Callable[[StructuredOutput, Sequence[int]], TokenMatcherLike]


class TokenSlice(SequenceABC):
    """A read-only window onto a list of token ids, made without copying the list."""

    __slots__ = ("_tokens", "_start", "_stop")

    def __init__(self, tokens: list[int], start: int, stop: int) -> None:
        self._tokens, self._start, self._stop = tokens, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._tokens[self._start : self._stop][index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("token index out of range")
        return self._tokens[self._start + index]

    def __iter__(self):
        tokens = self._tokens
        return (tokens[i] for i in range(self._start, self._stop))


@attrs.define(slots=True)
class CachedRequestState:
    """One request as the runner remembers it between steps.

    token_ids: prompt plus every token sampled so far.
    block_ids: the request's block table; position p lives in block_ids[p // block_size].
    row: the request's row of the runner's host block table.
    plain_greedy: greedy with no penalties, no logprobs and no structured output,
      so argmax alone samples it.
    penalised: has a repetition, presence or frequency penalty (the sampler reads its history).
    num_masked_outputs: outputs before which stop tokens are masked (min_tokens, if
      the request has any stop token to mask).
    matcher: where a request with structured output stands in its grammar.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    row: int = 0
    plain_greedy: bool = False
    penalised: bool = False
    num_masked_outputs: int = 0
    matcher: Any = None


@attrs.define(slots=True)
class HostBatch:
    """One step's flattened inputs on the host, in the layout of `AttentionMetadata`."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_decode_seqs: int
    # Each query row's block table and context length, where its prompts attend a row at
    # a time (`AttentionMetadata.row_block_tables`).
    row_block_tables: torch.Tensor | None = None
    row_seq_lens: torch.Tensor | None = None


@attrs.define(slots=True)
class StepInputs:
    """Device tensors of one forward pass: tokens, positions, attention metadata."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


@attrs.define(slots=True)
class GpuTimer:
    """Device time of each step's work, from its input upload to its sampled tokens (CUDA events)."""

    busy_s: float = 0.0
    num_steps: int = 0
    _start: torch.cuda.Event | None = None

    def start(self) -> None:
        """Mark the start of a step's device work on the current stream."""
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def stop(self) -> None:
        """Mark the end of the step's device work and add its duration."""
        if self._start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        self.busy_s += self._start.elapsed_time(end) / 1e3
        self.num_steps += 1
        self._start = None

    def reset(self) -> None:
        """Forget the totals."""
        self.busy_s, self.num_steps, self._start = 0.0, 0, None


def int64_tensor(values) -> torch.Tensor:
    """A CPU int64 tensor of Python ints, built from a packed buffer (several times faster than torch.tensor)."""
    packed = array("q", values)
    if not packed:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(packed, dtype=torch.int64)


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device for a name: "auto" is CUDA when available, else CPU; CUDA without one is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but torch sees no CUDA device; use 'cpu' or 'auto'")
    return device


def default_attention_backend(device: torch.device, config: ModelConfig | None = None) -> str:
    """On CPU "cpu" (the in-place decode kernel) where it builds, except for small models
    (under SMALL_MODEL_MACS per token, such as the demo model) on a machine that has not
    built the kernels yet: their steps are cheap enough that "sdpa" serves them without
    a ~30 s compile (two cores) before the first token (once built, by any larger model or
    `cadence build-kernels`, they run a small model's decode steps 3-8x faster); on
    CUDA "triton" (the paged kernels, with decode graphs) where triton imports, else "sdpa"."""
    if device.type == "cpu":
        if config is not None and macs_per_token(config) < SMALL_MODEL_MACS and not cpu_kernels.is_built():
            return "sdpa"
        return "cpu" if cpu_kernels.load() is not None else "sdpa"
    if device.type != "cuda":
        return "sdpa"
    try:
        import triton  # noqa: F401  (only asked whether it is installed)
    except ImportError:
        return "sdpa"
    return "triton"


def cpu_has_bfloat16_units() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX tiles or AVX-512 BF16), so
    bfloat16 products run at least as fast as float32 ones while reading half the bytes."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def default_dtype(config: ModelConfig, device: torch.device) -> torch.dtype:
    """On CPU bfloat16 where the CPU has bfloat16 units, else float32 (as vLLM's CPU
    backend chooses); on GPU the checkpoint's half-precision dtype, bfloat16 otherwise."""
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_bfloat16_units() else torch.float32
    return torch.float16 if config.dtype == "float16" else torch.bfloat16


def _rows_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


class ModelRunner:
    """Holds the model, its paged KV cache and the persistent batch; `execute` runs one step.

    num_blocks: KV blocks per layer. Required on CPU; on CUDA None means "as many
      as fit in `gpu_memory_utilization` of the device after a profiling pass of
      `max_num_batched_tokens` tokens over up to `max_num_seqs` sequences".
    weights_path: a Hugging Face model directory; None initialises weights at
      random from `seed`.
    dtype: a torch dtype or its name ("bfloat16", "bf16", ...); None or "auto" is
      `default_dtype`: bfloat16 on a CPU with bfloat16 units (float32 on others), the
      checkpoint's half precision (else bfloat16) on GPU.
    attention_backend: "reference", "sdpa", "cpu" or "triton"; "auto" is cpu on CPU
      (sdpa where its kernel cannot be built) and triton on CUDA (see
      `default_attention_backend`).
    num_threads: torch's CPU threads while this runner computes, set from the
      constructing thread before the first kernel (which should be the thread that
      runs `execute`); "auto" follows `cadence.gpu.threads`, None leaves torch's.
    prefault_blocks: on CPU, the KV blocks faulted in when the runner is built (at most
      as many bytes as the weights, and `host_memory.PREFAULT_MAX_BYTES`); None is as
      many as `max_num_seqs` sequences of `max_model_len` hold. The engine passes what
      its scheduler can run.
    pin_threads: pin the constructing thread and its compute team one per core when
      `num_threads` is 2 or more (see `cadence.gpu.threads.pin_compute_threads`); the
      engine's executors ask for it, since their model thread is the runner's own.
    cpu_path: how a CPU runner computes its products: "packed" (weights prepacked
      for oneDNN, q/k/v and gate/up merged; `cadence.gpu.cpu_linear`) or "eager"
      (torch's plain ops, the path parity tests compare with); "auto" is packed
      where the torch build can pack the dtype. Ignored on CUDA.
    max_model_len: longest sequence accepted; None is the model's own limit.
    use_cuda_graphs: replay CUDA graphs for pure-decode steps of up to
      `max_num_seqs` sequences; None means on for CUDA with the "triton" backend.
    pad_decode_batches: run pure-decode steps padded to the graph batch sizes even
      without graphs (eagerly): the CPU twin of the graph path, for tests and debugging.
    fused_elementwise: RMSNorm (with the residual add after attention), SwiGLU and
      the rotary embedding with the cache write as single Triton kernels
      (`cadence.gpu.triton_fused`); CUDA, or Triton's CPU interpreter in tests. None
      means on for CUDA with the "triton" backend (1.65-1.82x the plain path's
      tokens/s on the H200's nano workload, float32 greedy identical to transformers;
      benchmarks/results/h200_gpu_check*.json).
    balanced_decode_attention: on the padded decode path (graphs, or its eager twin),
      cut decode contexts into length-balanced tiles (`cadence.gpu.worklist`) instead
      of one program per sequence; True for the default `BalanceConfig`. Needs the
      "triton" backend. Off by default until measured on a GPU.

    `matcher_factory` (set by whoever builds the runner; None refuses requests
    with structured output) makes each such request's grammar matcher; its
    token mask is applied in the sampler, on the device.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        num_blocks: int | None = None,
        block_size: int = 16,
        device: str | torch.device = "auto",
        dtype: torch.dtype | str | None = None,
        attention_backend: str = AUTO,
        seed: int = 0,
        weights_path: str | Path | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        use_cuda_graphs: bool | None = None,
        pad_decode_batches: bool = False,
        fused_elementwise: bool | None = None,
        balanced_decode_attention: bool | BalanceConfig = False,
        num_threads: int | str | None = AUTO,
        cpu_path: str = AUTO,
        pin_threads: bool = False,
        prefault_blocks: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_model_len is not None and not 1 <= max_model_len <= model_config.max_model_len:
            raise ConfigError(
                f"max_model_len must be in [1, {model_config.max_model_len}] for this model, got {max_model_len}"
            )
        self.config = model_config
        self.device = resolve_device(device)
        self.num_threads = resolve_num_threads(num_threads, model_config, self.device)
        set_num_threads(self.num_threads)
        self.pinned_cores = pin_compute_threads(self.num_threads) if pin_threads else None
        if attention_backend == AUTO:
            attention_backend = default_attention_backend(self.device, model_config)
        elif attention_backend == "cpu":
            if self.device.type != "cpu":
                raise ConfigError(f"attention_backend 'cpu' runs on the CPU, not {self.device.type!r}")
            if cpu_kernels.load() is None:  # built now, not inside the first step
                raise ConfigError(f"attention_backend 'cpu': its kernel could not be built "
                                  f"({cpu_kernels.unavailable_reason()})")
        if isinstance(dtype, str) and dtype != "auto":
            if dtype not in DTYPES:
                raise ConfigError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {dtype!r}")
            dtype = DTYPES[dtype]
        elif dtype == "auto":
            dtype = None
        self.dtype = dtype or default_dtype(model_config, self.device)
        self.block_size = block_size
        self.max_model_len = max_model_len or model_config.max_model_len
        self.max_num_seqs = max_num_seqs
        self.use_cuda_graphs = self._resolve_cuda_graphs(use_cuda_graphs, attention_backend)
        self.backend = get_attention_backend(attention_backend)
        self.fused_elementwise = self._resolve_fused_elementwise(fused_elementwise, attention_backend)
        self.model = self._build_model(weights_path, seed)
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())  # before packing
        self.cpu_path = self._resolve_cpu_path(cpu_path)
        # Greedy rows' tokens: torch's argmax, or the CPU kernels' (the same answers, ties
        # and NaNs included, several times faster over a 32k vocabulary).
        self._argmax = _rows_argmax
        if self.cpu_path == "packed":
            self.model.pack(small_batch=cpu_kernels.small_batch() if self.backend.name == "cpu" else None)
            if self.backend.name == "cpu":  # its kernels are built: the fused ones come with them
                self.model.set_fused_elementwise(True, cpu_kernels)
                self._argmax = cpu_kernels.argmax
        # Where the CPU kernels have no one-pass attention of prompts but a vector decode
        # kernel, a step's prompts attend a row at a time where that pays (`_host_batch`).
        self._row_attention = self._resolve_row_attention()
        if self.fused_elementwise:
            # Before any decode graph is captured, so the graphs hold the fused kernels.
            self.model.set_fused_elementwise(True)
        if self.device.type == "cuda":
            _log.info("CUDA path: %s, %s attention, elementwise ops %s, decode graphs %s",
                      str(self.dtype).removeprefix("torch."), self.backend.name,
                      "fused" if self.fused_elementwise else "plain", "on" if self.use_cuda_graphs else "off")
        self.sampler = Sampler(model_config.eos_token_ids, seed=seed, device=self.device)
        self.matcher_factory: MatcherFactory | None = None
        self._requests: dict[str, CachedRequestState] = {}
        self._failed: dict[str, str] = {}
        # Requests it failed and dropped, until a plan names them finished or preempted:
        # a plan made before the failure was known may still schedule them.
        self._dropped: dict[str, str] = {}
        self._prompt_logprobs: dict[str, tuple[int, list[list[tuple[int, float]]]]] = {}
        self._max_blocks_per_seq = -(-self.max_model_len // block_size)
        self._block_table = torch.zeros(max_num_seqs, self._max_blocks_per_seq, dtype=torch.int32)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._staging = StagingBuffer(INITIAL_STAGING_BYTES, self.device) if self.device.type == "cuda" else None
        self.gpu_timer: GpuTimer | None = None
        if num_blocks is None:
            if self.device.type != "cuda":
                raise ConfigError("num_blocks is required on CPU (it is profiled only on CUDA)")
            num_blocks = self._profile_num_blocks(gpu_memory_utilization, max_num_batched_tokens, max_num_seqs)
        if num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {num_blocks}")
        if prefault_blocks is not None and prefault_blocks < 0:
            raise ConfigError(f"prefault_blocks must be >= 0, got {prefault_blocks}")
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        self.kv_caches = self._allocate_kv_caches(num_blocks)
        if self.device.type == "cpu":
            self._reserve_host_memory(prefault_blocks, weight_bytes)
        self.decode_graphs: DecodeGraphs | None = None
        if self.use_cuda_graphs or pad_decode_batches:
            with torch.inference_mode():
                self.decode_graphs = DecodeGraphs(
                    self.model, self.kv_caches, batch_sizes=graph_batch_sizes(max_num_seqs),
                    max_blocks_per_seq=self._max_blocks_per_seq, block_size=block_size,
                    scratch_block=self.scratch_block, device=self.device, capture=self.use_cuda_graphs,
                    balance=self._balance_config(balanced_decode_attention, attention_backend),
                )

    @staticmethod
    def _balance_config(requested: bool | BalanceConfig, attention_backend: str) -> BalanceConfig | None:
        if requested is False:
            return None
        if attention_backend != "triton":
            raise ConfigError(f"balanced_decode_attention needs attention_backend 'triton', "
                              f"got {attention_backend!r}")
        return BalanceConfig() if requested is True else requested

    def _resolve_cpu_path(self, requested: str) -> str | None:
        """The CPU path this runner takes (None on an accelerator)."""
        if requested not in CPU_PATHS:
            raise ConfigError(f"cpu_path must be one of {', '.join(CPU_PATHS)}, got {requested!r}")
        if self.device.type != "cpu":
            return None
        available = cpu_linear.packing_available(self.dtype)
        if not available and self.dtype == torch.bfloat16 and self.backend.name == "cpu":
            # Where oneDNN cannot pack bfloat16 (AVX2 without AVX-512), the kernels' own
            # product takes every row count from their layout alone.
            small = cpu_kernels.small_batch()
            available = small is not None and self.dtype in small.dtypes
        if requested == "packed" and not available:
            raise ConfigError(f"cpu_path 'packed' needs oneDNN or this CPU's kernels, and float32 or bfloat16 weights; "
                              f"this runner has {self.dtype} (torch mkldnn available: "
                              f"{torch.backends.mkldnn.is_available()})")
        path = ("packed" if available else "eager") if requested == AUTO else requested
        _log.info("CPU path: %s, %s, %s thread(s)%s; %s", path, str(self.dtype).removeprefix("torch."),
                  self.num_threads or torch.get_num_threads(),
                  f" pinned to cores {list(self.pinned_cores)}" if self.pinned_cores else "",
                  openmp_env.describe())
        return path

    def _resolve_row_attention(self) -> bool:
        if self.backend.name != "cpu" or self.device.type != "cpu":
            return False
        kernel = cpu_kernels.load()
        if kernel is None:
            return False
        probe = torch.empty(0, self.config.num_heads, self.config.head_dim, dtype=self.dtype)
        by_row = kernel.has_row_attention(probe) and not kernel.has_paged_attention(probe)
        if by_row:
            _log.info("CPU attention: prompts a row at a time through the decode kernel, each step's "
                      "layers in one call of the kernels")
        return by_row

    def _resolve_fused_elementwise(self, requested: bool | None, attention_backend: str) -> bool:
        if requested is None:
            return (self.device.type == "cuda" and attention_backend == "triton"
                    and importlib.util.find_spec("triton") is not None)
        if requested and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("fused_elementwise needs a CUDA device (or TRITON_INTERPRET=1 to run "
                              "the kernels in Triton's CPU interpreter, for tests)")
        return requested

    def _resolve_cuda_graphs(self, requested: bool | None, attention_backend: str) -> bool:
        usable = self.device.type == "cuda" and attention_backend == "triton"
        if requested is None:
            return usable
        if requested and not usable:
            raise ConfigError(
                f"use_cuda_graphs needs a CUDA device and attention_backend 'triton', "
                f"got device {self.device.type!r} and backend {attention_backend!r}"
            )
        return requested

    def _build_model(self, weights_path: str | Path | None, seed: int):
        """The model with its weights: read from `weights_path`, or random from `seed`."""
        model = build_model(self.config, self.backend, self.dtype, self.device)
        if weights_path is None:
            init_random_weights(model, seed)
        else:
            load_weights(model, weights_path)
        return model

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this runner's cache holds (all of them, unless the model is sharded)."""
        return self.config.num_kv_heads

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
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return self.block_size * self.config.kv_bytes_per_token(element_size, self.num_local_kv_heads)

    def reset(self) -> None:
        """Forget every request (executor restart); cache contents are left as they are."""
        for state in self._requests.values():
            self._free_rows.append(state.row)
        self._requests.clear()
        self._dropped.clear()

    def take_failed(self) -> dict[str, str]:
        """The requests the last step could not serve, with why; each was dropped from the batch."""
        failed, self._failed = self._failed, {}
        return failed

    def take_prompt_logprobs(self) -> dict[str, tuple[int, list[list[tuple[int, float]]]]]:
        """The prompt log-probabilities the last step computed: per request that asked,
        (the prompt position of the first token scored, one entry of [token id,
        logprob] pairs per token: that prompt token first, then the top alternatives)."""
        scored, self._prompt_logprobs = self._prompt_logprobs, {}
        return scored

    def enable_gpu_timing(self) -> GpuTimer:
        """Start measuring each step's device time (CUDA only); returns the timer that sums it."""
        if self.device.type != "cuda":
            raise ConfigError("GPU timing needs a CUDA device")
        self.gpu_timer = GpuTimer()
        return self.gpu_timer

    def execute(self, plan: StepPlan, sampling_params: Mapping[str, SamplingParams]) -> StepResult:
        """Apply the plan's deltas, compute its scheduled tokens, sample where a request reached its end."""
        start_ns = time.perf_counter_ns()
        self._failed = {}
        self._prompt_logprobs = {}
        self._apply_deltas(plan, sampling_params)
        scheduled = self._scheduled_requests(plan)
        if not scheduled:
            return StepResult(plan.step_id, {}, None, (time.perf_counter_ns() - start_ns) // 1000)
        # Decodes first, so a backend can treat the first `num_decode_seqs` sequences alike.
        scheduled.sort(key=lambda item: item[1] != 1)
        sample_seqs = [
            i for i, (state, n) in enumerate(scheduled)
            if state.num_computed_tokens + n == len(state.token_ids)
        ]
        batch = self._host_batch(scheduled)
        prompt_spans = self._prompt_spans(scheduled)
        with torch.inference_mode():
            if self.gpu_timer is not None:
                self.gpu_timer.start()
            graphs = self.decode_graphs
            # The decode graphs keep only each sequence's last row: prompt scoring runs eagerly.
            if (graphs is not None and batch.num_decode_seqs == len(scheduled)
                    and len(scheduled) <= graphs.max_batch_size and not prompt_spans):
                logits = self._decode_logits(graphs, batch, sample_seqs)
            else:
                logits = self._eager_logits(batch, sample_seqs, prompt_spans)
            states = [scheduled[i][0] for i in sample_seqs]
            try:
                tokens, logprobs = self._sample(logits, states) if states else ([], [])
            except Exception as exc:
                tokens, logprobs, states = self._sample_each(logits, states, exc)
            if self.gpu_timer is not None:
                self.gpu_timer.stop()
        for state, n in scheduled:
            state.num_computed_tokens += n
        for request_id in self._failed:
            self._prompt_logprobs.pop(request_id, None)
        by_request: dict[str, int] = {}
        logprobs_by_request: dict[str, list[list[tuple[int, float]]]] = {}
        for state, token, token_logprobs in zip(states, tokens, logprobs):
            if state.matcher is not None and not state.matcher.accept(token):
                self._failed[state.request_id] = self._dropped[state.request_id] = (
                    f"sampled token {token} does not follow its structured output")
                self._prompt_logprobs.pop(state.request_id, None)
                self._drop(state.request_id)
                continue
            state.token_ids.append(token)
            by_request[state.request_id] = token
            if token_logprobs is not None:
                logprobs_by_request[state.request_id] = [token_logprobs]
        sampled = {rid: [by_request[rid]] for rid in plan.num_scheduled_tokens if rid in by_request}
        return StepResult(
            plan.step_id, sampled, logprobs_by_request or None, (time.perf_counter_ns() - start_ns) // 1000
        )

    # ---- one step -----------------------------------------------------------------

    def _host_batch(self, scheduled: Sequence[tuple[CachedRequestState, int]]) -> HostBatch:
        """Flatten the scheduled tokens of every request (decodes first) into host tensors."""
        states = [state for state, _ in scheduled]
        q_lens = [n for _, n in scheduled]
        starts = [state.num_computed_tokens for state in states]
        num_seqs = len(states)
        num_decodes = q_lens.count(1)
        starts_t = int64_tensor(starts)
        rows = int64_tensor([state.row for state in states])
        if num_decodes == num_seqs:
            # One token each: its slot read from the request's own block list (the host
            # block table holds the same ids), in Python, cheaper than torch's indexing
            # ops at a handful of rows (~140 -> ~50 us a batch-1 step here).
            size, longest = self.block_size, max(starts) + 1
            return HostBatch(
                int64_tensor([s.token_ids[c] for s, c in zip(states, starts)]), starts_t,
                int64_tensor([s.block_ids[c // size] * size + c % size for s, c in zip(states, starts)]),
                torch.arange(num_seqs + 1, dtype=torch.int32),
                torch.frombuffer(array("i", [c + 1 for c in starts]), dtype=torch.int32),
                self._block_table[:, :-(-longest // size)].index_select(0, rows), 1, longest, num_decodes)
        seq_ids = torch.arange(num_seqs)
        input_ids = int64_tensor(
            chain.from_iterable(s.token_ids[c : c + n] for s, c, n in zip(states, starts, q_lens))
        )
        q_lens_t = int64_tensor(q_lens)
        offsets = torch.zeros(num_seqs + 1, dtype=torch.int64)
        torch.cumsum(q_lens_t, dim=0, out=offsets[1:])
        seq_of_token = torch.repeat_interleave(seq_ids, q_lens_t)
        positions = torch.arange(input_ids.shape[0]) - offsets[seq_of_token] + starts_t[seq_of_token]
        query_start_loc = offsets.to(torch.int32)
        seq_lens = (starts_t + q_lens_t).to(torch.int32)
        max_seq_len = max(c + n for c, n in zip(starts, q_lens))
        width = -(-max_seq_len // self.block_size)
        block_tables = self._block_table[:, :width].index_select(0, rows)
        slot_mapping = (
            block_tables[seq_of_token, positions // self.block_size].long() * self.block_size
            + positions % self.block_size
        )
        row_tables = row_lens = None
        if self._row_attention and row_attention_pays(
                [(c, n) for c, n in zip(starts, q_lens) if n > 1], self.block_size, len(positions), width):
            row_tables, row_lens = block_tables.index_select(0, seq_of_token), (positions + 1).to(torch.int32)
        return HostBatch(input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables,
                         max(q_lens), max_seq_len, num_decodes, row_tables, row_lens)

    def _build_inputs(self, seqs: Sequence[tuple[Sequence[int], int, Sequence[int]]]) -> StepInputs:
        """Device inputs for (new token ids, first position, block table) per sequence, outside any plan."""
        states = []
        for i, (tokens, start, table) in enumerate(seqs):
            state = self._new_state(f"inputs-{i}", [0] * start + list(tokens), start + len(tokens), start,
                                    PROFILE_SAMPLING)
            self._append_blocks(state, table)
            states.append((state, len(tokens)))
        try:
            states.sort(key=lambda item: item[1] != 1)
            inputs, _ = self._send(self._host_batch(states), [])
        finally:
            self._free_rows.extend(state.row for state, _ in states)
        return inputs

    def _send(self, batch: HostBatch, sample_seqs: list[int]) -> tuple[StepInputs, LastRows]:
        """The batch on the device in one copy, and the token rows of the sampled sequences."""
        seqs = int64_tensor(sample_seqs)
        # A sequence's last token row; a step of single tokens has one row per sequence.
        sample_rows = seqs if batch.max_query_len == 1 else batch.query_start_loc.long()[1:][seqs] - 1
        host = [batch.input_ids, batch.positions, batch.slot_mapping, batch.query_start_loc,
                batch.seq_lens, batch.block_tables, sample_rows, seqs]
        device = host if self._staging is None else self._staging.send(host)
        input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables, rows, seqs = device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_tables=block_tables, max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
            num_decode_seqs=batch.num_decode_seqs,
            # Only ever on the CPU (`_resolve_row_attention`): no device copy to make.
            row_block_tables=batch.row_block_tables, row_seq_lens=batch.row_seq_lens,
        )
        return StepInputs(input_ids, positions, meta), LastRows(rows, seqs)

    def _eager_logits(self, batch: HostBatch, sample_seqs: list[int],
                      prompt_spans: Sequence[tuple[int, CachedRequestState, int, int]] = ()
                      ) -> torch.Tensor | None:
        """Run the flattened batch through the model; logits of the sampled sequences' last
        tokens. The prompt positions of `prompt_spans` are scored on the way."""
        inputs, last = self._send(batch, sample_seqs)
        if prompt_spans:  # every prompt position's hidden state is scored
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
            self._score_prompts(hidden, batch, prompt_spans)
            return self.model.compute_logits(hidden[last.rows]) if sample_seqs else None
        # The last layer computes only the rows that sample (the others' K/V are all a
        # later step reads of it).
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, last)
        return self.model.compute_logits(hidden) if sample_seqs else None

    @staticmethod
    def _prompt_spans(scheduled: Sequence[tuple[CachedRequestState, int]]
                      ) -> list[tuple[int, CachedRequestState, int, int]]:
        """(batch index, state, first position, end position) of the positions this step
        computes whose logits score a next prompt token, for requests that asked."""
        spans = []
        for i, (state, n) in enumerate(scheduled):
            start, last = state.num_computed_tokens, state.num_prompt_tokens - 1
            if start < last and state.sampling_params.prompt_logprobs is not None:
                spans.append((i, state, start, min(start + n, last)))
        return spans

    def _score_prompts(self, hidden: torch.Tensor, batch: HostBatch,
                       spans: Sequence[tuple[int, CachedRequestState, int, int]]) -> None:
        """Log-softmax of the raw logits at each span position, gathered at the next prompt
        token and its top alternatives, in passes of at most PROMPT_LOGPROBS_ROWS rows."""
        query_starts = batch.query_start_loc.tolist()
        rows, targets, owners = [], [], []
        for i, state, start, end in spans:
            first_row = query_starts[i]
            rows.extend(range(first_row, first_row + end - start))
            targets.extend(state.token_ids[start + 1 : end + 1])
            owners.extend([i] * (end - start))
        entries: dict[int, list[list[tuple[int, float]]]] = {i: [] for i, *_ in spans}
        wanted = {i: state.sampling_params.prompt_logprobs for i, state, *_ in spans}
        device = hidden.device
        for low in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
            high = min(low + PROMPT_LOGPROBS_ROWS, len(rows))
            logits = self.model.compute_logits(hidden[int64_tensor(rows[low:high]).to(device)])
            if logits is None:
                continue  # a tensor-parallel rank other than 0: its peer on rank 0 keeps the result
            logprobs = logits.float().log_softmax(dim=-1)
            target = int64_tensor(targets[low:high]).to(device)
            target_lp = logprobs.gather(1, target[:, None])[:, 0].tolist()
            num_top = max(wanted[owner] for owner in owners[low:high])
            top_lp, top_ids = (t.tolist() for t in logprobs.topk(num_top, dim=-1))
            for j in range(high - low):
                n = wanted[owners[low + j]]
                entries[owners[low + j]].append(
                    [(targets[low + j], target_lp[j]), *zip(top_ids[j][:n], top_lp[j][:n])])
        for i, state, start, _ in spans:
            if entries[i]:
                self._prompt_logprobs[state.request_id] = (start + 1, entries[i])

    def _decode_logits(self, graphs: DecodeGraphs, batch: HostBatch, sample_seqs: list[int]) -> torch.Tensor:
        """Logits of a pure-decode batch through the padded (graph) path, rows of the sampled sequences."""
        num_seqs = batch.input_ids.shape[0]
        padded = graphs.prepare(DecodeInputs(
            batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens, batch.block_tables,
        ))
        logits = graphs.run(padded, batch.max_seq_len)
        if len(sample_seqs) == num_seqs:
            return logits[:num_seqs]
        return logits[torch.tensor(sample_seqs, dtype=torch.int64).to(self.device)]

    def _sample_each(self, logits: torch.Tensor, states: list[CachedRequestState], error: Exception):
        """Sample row by row after the batched sampler raised `error`: the rows that
        fail alone are reported and dropped, the others keep their tokens. If every
        row fails, the fault is not theirs and the step fails with `error`."""
        tokens, logprobs, kept, failed = [], [], [], {}
        for i, state in enumerate(states):
            try:
                row_tokens, row_logprobs = self._sample(logits[i : i + 1], [state])
            except Exception as exc:
                failed[state.request_id] = f"sampling failed: {type(exc).__name__}: {exc}"
                continue
            tokens += row_tokens
            logprobs += row_logprobs
            kept.append(state)
        if not kept:
            raise error
        for request_id, why in failed.items():
            self._failed[request_id] = self._dropped[request_id] = why
            self._drop(request_id)
        return tokens, logprobs, kept

    def _sample(self, logits: torch.Tensor, states: list[CachedRequestState]):
        """Tokens (and logprobs, None per row where not asked) for logits [len(states), vocab]."""
        if all(s.plain_greedy and len(s.token_ids) - s.num_prompt_tokens >= s.num_masked_outputs for s in states):
            return self._argmax(logits).tolist(), [None] * len(states)
        bitmask = self._token_bitmask(states)
        prompts, outputs = [], []
        for s in states:
            if s.penalised:
                prompts.append(s.token_ids[: s.num_prompt_tokens])
                outputs.append(s.token_ids[s.num_prompt_tokens :])
            else:
                prompts.append(TokenSlice(s.token_ids, 0, s.num_prompt_tokens))
                outputs.append(TokenSlice(s.token_ids, s.num_prompt_tokens, len(s.token_ids)))
        out = self.sampler(logits, [s.sampling_params for s in states], prompts, outputs, bitmask)
        return out.token_ids, out.logprobs

    def _token_bitmask(self, states: list[CachedRequestState]) -> torch.Tensor | None:
        """The allowed next tokens of each row (all, for rows without structured output),
        or None when no row has structured output. Filled on the host; the sampler
        moves it to the device."""
        if all(s.matcher is None for s in states):
            return None
        bitmask = torch.full((len(states), -(-self.vocab_size // 32)), -1, dtype=torch.int32,
                             pin_memory=self.device.type == "cuda")
        for row, state in enumerate(states):
            if state.matcher is not None:
                state.matcher.fill_bitmask(bitmask, row)
        return bitmask

    def _new_matcher(self, state: CachedRequestState) -> str | None:
        """Give a request with structured output its matcher, advanced over the tokens it
        has generated (after preemption or a restart it arrives with them); the reason
        when it cannot have one."""
        structured = state.sampling_params.structured_output
        if structured is None:
            return None
        if self.matcher_factory is None:
            return "this executor has no structured-output support"
        try:
            state.matcher = self.matcher_factory(structured, state.token_ids[state.num_prompt_tokens:])
        except Exception as exc:
            return f"structured output: {exc}"
        return None

    # ---- the persistent batch ----------------------------------------------------

    def _apply_deltas(self, plan: StepPlan, sampling_params: Mapping[str, SamplingParams]) -> None:
        dropped = self._dropped
        for request_id in chain(plan.finished_ids, plan.preempted_ids):
            self._drop(request_id)
            dropped.pop(request_id, None)
        for new in plan.new_requests:
            params = sampling_params.get(new.request_id)
            if params is None:
                raise ExecutorError(f"step {plan.step_id}: no SamplingParams for new request {new.request_id!r}")
            if not 0 <= new.num_computed_tokens <= len(new.token_ids):
                raise ExecutorError(
                    f"step {plan.step_id}: request {new.request_id!r} has num_computed_tokens "
                    f"{new.num_computed_tokens} but {len(new.token_ids)} tokens"
                )
            self._check_block_ids(plan, new.request_id, new.block_ids)
            self._drop(new.request_id)
            bad = self._foreign_token(new.token_ids)
            if bad is None:
                bad = self._foreign_token(params.stop_token_ids)
            if bad is not None:
                self._failed[new.request_id] = dropped[new.request_id] = (
                    f"token id {bad} is outside the model's vocabulary [0, {self.vocab_size})")
                continue
            state = self._new_state(new.request_id, list(new.token_ids), new.num_prompt_tokens,
                                    new.num_computed_tokens, params)
            why = self._new_matcher(state)
            if why is not None:
                self._failed[new.request_id] = dropped[new.request_id] = why
                self._free_rows.append(state.row)
                continue
            self._requests[new.request_id] = state
            self._append_blocks(state, new.block_ids)
        for request_id, block_ids in plan.new_block_ids.items():
            if request_id in dropped and request_id not in self._requests:
                continue
            state = self._state(plan, request_id)
            self._check_block_ids(plan, request_id, block_ids)
            self._append_blocks(state, block_ids)

    def _foreign_token(self, token_ids: Sequence[int]) -> int | None:
        """A token id the embedding cannot look up (on a GPU it would fault the device), or None."""
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= self.vocab_size):
            return next(t for t in token_ids if not 0 <= t < self.vocab_size)
        return None

    def _new_state(self, request_id: str, token_ids: list[int], num_prompt_tokens: int,
                   num_computed_tokens: int, params: SamplingParams) -> CachedRequestState:
        penalised = (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                     or params.frequency_penalty != 0.0)
        has_stops = bool(params.stop_token_ids) or (not params.ignore_eos and bool(self.sampler.eos_token_ids))
        return CachedRequestState(
            request_id, token_ids, num_prompt_tokens, [], num_computed_tokens, params,
            row=self._take_row(),
            plain_greedy=(params.greedy and not penalised and params.logprobs is None
                          and params.structured_output is None and not restricted(params)),
            penalised=penalised,
            num_masked_outputs=params.min_tokens if has_stops else 0,
        )

    def _drop(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        if state is not None:
            self._free_rows.append(state.row)

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self._block_table
            self._block_table = torch.zeros(2 * old.shape[0], old.shape[1], dtype=old.dtype)
            self._block_table[: old.shape[0]] = old
            self._free_rows = list(range(self._block_table.shape[0] - 1, old.shape[0] - 1, -1))
        return self._free_rows.pop()

    def _append_blocks(self, state: CachedRequestState, block_ids: Sequence[int]) -> None:
        start = len(state.block_ids)
        state.block_ids.extend(block_ids)
        # Blocks past the widest table could hold only positions past max_model_len.
        stop = min(len(state.block_ids), self._max_blocks_per_seq)
        if start < stop:
            self._block_table[state.row, start:stop] = torch.tensor(state.block_ids[start:stop], dtype=torch.int32)

    def _check_block_ids(self, plan: StepPlan, request_id: str, block_ids: Sequence[int]) -> None:
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
            raise ExecutorError(
                f"step {plan.step_id}: request {request_id!r} uses block ids {bad} outside [0, {self.num_blocks})"
            )

    def _state(self, plan: StepPlan, request_id: str) -> CachedRequestState:
        state = self._requests.get(request_id)
        if state is None:
            raise ExecutorError(f"step {plan.step_id}: request {request_id!r} is not in the executor's batch")
        return state

    def _scheduled_requests(self, plan: StepPlan) -> list[tuple[CachedRequestState, int]]:
        requests, block_size, max_model_len = self._requests, self.block_size, self.max_model_len
        scheduled = []
        for request_id, n in plan.num_scheduled_tokens.items():
            state = requests.get(request_id)
            if state is None and request_id in self._dropped:
                self._failed[request_id] = self._dropped[request_id]
                continue  # refused at input preparation, this step or an earlier one
            if state is None:
                raise ExecutorError(f"step {plan.step_id}: request {request_id!r} is not in the executor's batch")
            end = state.num_computed_tokens + n
            if n < 1 or end > len(state.token_ids) or end > max_model_len or len(state.block_ids) * block_size < end:
                self._reject_schedule(plan, state, n)
            scheduled.append((state, n))
        total = sum(plan.num_scheduled_tokens.values())
        if total != plan.total_num_scheduled_tokens:
            raise ExecutorError(
                f"step {plan.step_id}: total_num_scheduled_tokens is {plan.total_num_scheduled_tokens}, "
                f"the per-request counts sum to {total}"
            )
        return scheduled

    def _reject_schedule(self, plan: StepPlan, state: CachedRequestState, n: int) -> None:
        """Raise the ExecutorError that says why `n` tokens cannot be computed for `state` now."""
        where = f"step {plan.step_id}: request {state.request_id!r}"
        end = state.num_computed_tokens + n
        if n < 1 or end > len(state.token_ids):
            raise ExecutorError(
                f"{where} is scheduled {n} tokens from {state.num_computed_tokens} "
                f"but knows only {len(state.token_ids)} tokens"
            )
        if end > self.max_model_len:
            raise ExecutorError(f"{where} reaches {end} tokens, past max_model_len {self.max_model_len}")
        num_blocks_needed = -(-end // self.block_size)
        raise ExecutorError(f"{where} needs {num_blocks_needed} blocks for {end} tokens, has {len(state.block_ids)}")

    # ---- memory ------------------------------------------------------------------

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.config
        shape = (c.num_layers, 2, num_blocks + NUM_SCRATCH_BLOCKS, self.block_size, self.num_local_kv_heads, c.head_dim)
        # Zeroed, not empty: attention multiplies masked-out cache entries by 0, and NaN * 0 is NaN.
        if self.device.type == "cpu":
            cache = zeroed_cpu_tensor(shape, self.dtype)
        else:
            cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return [(cache[layer, 0], cache[layer, 1]) for layer in range(c.num_layers)]

    def _reserve_host_memory(self, prefault_blocks: int | None, weight_bytes: int) -> None:
        """On CPU: keep freed tensors for reuse, and fault in the first `prefault_blocks`
        KV blocks (None: as many as `max_num_seqs` sequences of `max_model_len` hold), at
        most as many bytes as the weights take and `host_memory.PREFAULT_MAX_BYTES`, so
        that the steps meet neither cost (`cadence.gpu.host_memory`). First, the
        memory that building the model freed goes back to the kernel."""
        host_memory.release_free_memory()
        host_memory.keep_freed_memory()
        block_bytes = self.kv_block_bytes()
        if prefault_blocks is None:
            prefault_blocks = self.max_num_seqs * self._max_blocks_per_seq
        wanted = min(self.num_blocks, prefault_blocks,
                     min(weight_bytes, host_memory.PREFAULT_MAX_BYTES) // block_bytes)
        start = time.perf_counter()
        done = host_memory.prefault([cache for pair in self.kv_caches for cache in pair], wanted)
        _log.info("KV cache: %d of %d blocks (%d MiB) faulted in at start in %.2f s",
                  done // block_bytes, self.num_blocks, done >> 20, time.perf_counter() - start)

    def _graph_pool_bytes(self, max_num_seqs: int) -> int:
        """A bound on the decode graphs' memory: logits of the largest batch, its activations, library workspaces."""
        if not self.use_cuda_graphs:
            return 0
        c = self.config
        element_size = torch.empty((), dtype=self.dtype).element_size()
        logits = max_num_seqs * c.vocab_size * (4 + element_size)
        activations = max_num_seqs * (4 * c.hidden_size + 3 * c.intermediate_size
                                      + 3 * c.num_heads * c.head_dim) * element_size * 4
        return logits + activations + GRAPH_WORKSPACE_BYTES

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
        self.num_blocks = next_block
        kv_caches = self.kv_caches = self._allocate_kv_caches(next_block)
        states = []
        for i, (q_len, table) in enumerate(zip(q_lens, tables)):
            state = self._new_state(f"profile-{i}", [0] * q_len, q_len, 0, PROFILE_SAMPLING)
            self._append_blocks(state, table)
            states.append(state)
        scheduled = [(state, state.num_prompt_tokens) for state in states]
        batch = self._host_batch(scheduled)
        with torch.inference_mode():
            logits = self._eager_logits(batch, list(range(num_seqs)))
            self._sample(logits, states)
            del logits
        for state in states:
            self._free_rows.append(state.row)
        torch.cuda.synchronize(self.device)
        num_cache_blocks = next_block + NUM_SCRATCH_BLOCKS
        peak_bytes = torch.cuda.max_memory_allocated(self.device) - self.kv_block_bytes() * num_cache_blocks
        peak_bytes += self._graph_pool_bytes(max_num_seqs)
        del self.kv_caches, kv_caches
        torch.cuda.empty_cache()
        free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
        other_bytes = total_bytes - free_bytes - torch.cuda.memory_reserved(self.device)
        available = total_bytes * utilization - other_bytes - peak_bytes
        num_blocks = int(available // self.kv_block_bytes()) - NUM_SCRATCH_BLOCKS
        if num_blocks < 1:
            raise ConfigError(
                f"no GPU memory left for the KV cache: weights and activations peak at "
                f"{peak_bytes / 2**30:.2f} GiB of {total_bytes * utilization / 2**30:.2f} GiB allowed; "
                f"raise gpu_memory_utilization or lower max_num_batched_tokens"
            )
        return num_blocks
