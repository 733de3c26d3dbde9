"""Tensor parallelism: one model sharded across `tp` ranks that step together.

Sharding follows the usual layout for decoder stacks: q/k/v and gate/up are
split by output rows (each rank owns whole attention heads and a slice of the
MLP), o and down by input columns with a sum across ranks afterwards, and the
embedding and LM head by vocabulary rows. Each rank's paged KV cache holds only
its own KV heads, so the block ids of a plan mean the same on every rank.

Rank 0 hosts the scheduler side. Every step it broadcasts the msgpack-encoded
plan as a uint8 tensor (length first) on a control group, every rank applies it
to its persistent batch and runs its shard, the vocabulary slices of the logits
are gathered to rank 0 for sampling, and rank 0 broadcasts the sampled tokens
back so every rank's batch sees them. Nothing is pickled.

Ranks are created by any launcher that sets the usual rendezvous variables
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), such as
``torchrun -m cadence.gpu.tp_worker``, or by `start_local_runner`, which spawns
the other ranks of one machine itself.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import attrs
import msgpack
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.nn import functional as F

from cadence.statemachine.errors import ConfigError, ExecutorError
from cadence.statemachine.plan import NewRequestData, StepPlan
from cadence.statemachine.sampling import SamplingParams

from .config import PRESETS, ModelConfig
from .errors import CheckpointError, MissingWeightError, UnexpectedWeightError, WeightShapeError
from .loader import IGNORED_SUFFIXES, checkpoint_files
from .model import CausalLM, Embedding, Linear, init_random_weights
from .runner import ModelRunner

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RankGroup",
    "TensorParallelRunner",
    "decode_command",
    "encode_command",
    "init_rank_group",
    "load_sharded_weights",
    "local_config",
    "start_local_runner",
]

# How long a collective inside a step may wait for a peer before it fails.
DEFAULT_TIMEOUT_S = 30.0
# How long followers may wait, idle, for rank 0's next plan.
IDLE_TIMEOUT = datetime.timedelta(days=365)
# After a failed collective, how long to wait for the peer that caused it to be reaped.
DEATH_GRACE_S = 2.0
STOP_WAIT_S = 10.0
OP_STEP, OP_RESET, OP_STOP = "step", "reset", "stop"
# Row-parallel biases are added once, by rank 0, before the sum across ranks.
RANK0_ONLY_SUFFIXES = ("o_proj.bias", "down_proj.bias")
WORKER_MODULE = "cadence.gpu.tp_worker"
_PR_SET_PDEATHSIG = 1


# ---- the process group ------------------------------------------------------------


@attrs.define
class RankGroup:
    """This process's place among the ranks: collectives for steps, and a gloo group for idle plan waits."""

    rank: int
    world_size: int
    device: torch.device
    control: Any = None

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0 sends `payload` to every rank; every rank returns it."""
        length = torch.zeros(1, dtype=torch.int64)
        if self.rank == 0:
            length[0] = len(payload)
        dist.broadcast(length, src=0, group=self.control)
        if self.rank == 0:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            data = torch.empty(int(length[0]), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.control)
        return payload if self.rank == 0 else data.numpy().tobytes()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` across ranks in place and return it."""
        dist.all_reduce(tensor)
        return tensor

    def gather_columns(self, local: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's [N, k] slice along columns on rank 0; None elsewhere."""
        local = local.contiguous()
        if self.rank != 0:
            dist.gather(local, dst=0)
            return None
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=1)

    def broadcast_tokens(self, tokens: list[int] | None, count: int) -> list[int]:
        """Rank 0's `count` sampled tokens, on every rank."""
        tensor = torch.zeros(count, dtype=torch.int64, device=self.device)
        if self.rank == 0:
            tensor.copy_(torch.tensor(tokens, dtype=torch.int64))
        dist.broadcast(tensor, src=0)
        return tensor.tolist()


def init_rank_group(
    device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S, init_method: str = "env://",
    rank: int | None = None, world_size: int | None = None,
) -> RankGroup:
    """Join the process group described by the environment (or by `init_method`, `rank`, `world_size`).

    Collectives run on nccl for CUDA and gloo on the CPU, failing after
    `timeout_s`; plan broadcasts use a gloo group that may wait idle for long.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", rank if rank is not None else 0))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        torch_device = torch.device("cuda", local_rank)
        torch.cuda.set_device(torch_device)
    backend = "nccl" if torch_device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if rank is not None:
        kwargs = dict(rank=rank, world_size=world_size)
    dist.init_process_group(
        backend, init_method=init_method, timeout=datetime.timedelta(seconds=timeout_s), **kwargs
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return RankGroup(dist.get_rank(), dist.get_world_size(), torch_device, control)


# ---- the sharded model ---------------------------------------------------------------


def local_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The shape one of `tp` ranks holds; ConfigError when the model cannot be split that way."""
    if tp < 1:
        raise ConfigError(f"tp must be >= 1, got {tp}")
    for name, value in (("num_heads", config.num_heads), ("num_kv_heads", config.num_kv_heads),
                        ("intermediate_size", config.intermediate_size)):
        if value % tp:
            raise ConfigError(
                f"tensor parallelism tp={tp} must divide {name} ({value}); this model allows tp in "
                f"{[n for n in range(1, config.num_kv_heads + 1) if _splits(config, n)]}"
            )
    return attrs.evolve(
        config, num_heads=config.num_heads // tp, num_kv_heads=config.num_kv_heads // tp,
        intermediate_size=config.intermediate_size // tp, vocab_size=-(-config.vocab_size // tp),
    )


def _splits(config: ModelConfig, tp: int) -> bool:
    return not (config.num_heads % tp or config.num_kv_heads % tp or config.intermediate_size % tp)


class VocabParallelEmbedding(Embedding):
    """The rows of the embedding for one vocabulary slice; other tokens embed to 0 before the sum."""

    def __init__(self, num_local: int, dim: int, vocab_start: int, group: RankGroup, dtype=None) -> None:
        super().__init__(num_local, dim, dtype=dtype)
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings [T, dim], summed across ranks."""
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(hidden.masked_fill(outside[:, None], 0.0))


class RowParallelLinear(Linear):
    """A linear layer over this rank's slice of the input features; outputs are summed across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: RankGroup, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The partial product, then the sum across ranks."""
        return self.group.all_reduce(F.linear(x, self.weight, self.bias))


class ShardedCausalLM(CausalLM):
    """A `CausalLM` holding one rank's shard; its logits are gathered on rank 0."""

    def __init__(self, config: ModelConfig, backend, group: RankGroup, dtype=None) -> None:
        shard = local_config(config, group.world_size)
        super().__init__(shard, backend, dtype)
        self.full_config = config
        self.group = group
        self.vocab_start = group.rank * shard.vocab_size
        self.model.embed_tokens = VocabParallelEmbedding(
            shard.vocab_size, config.hidden_size, self.vocab_start, group, dtype)
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj = RowParallelLinear(attn.o_proj.in_features, config.hidden_size, config.o_bias, group, dtype)
            mlp.down_proj = RowParallelLinear(
                mlp.down_proj.in_features, config.hidden_size, config.mlp_bias, group, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits [N, vocab_size] on rank 0 (None on other ranks)."""
        gathered = self.group.gather_columns(super().compute_logits(hidden))
        return None if gathered is None else gathered[:, : self.full_config.vocab_size]


def build_sharded_model(config: ModelConfig, backend, group: RankGroup, dtype: torch.dtype) -> ShardedCausalLM:
    """This rank's shard, allocated on the group's device but not initialised."""
    with torch.device("meta"):
        model = ShardedCausalLM(config, backend, group, dtype)
    return model.to_empty(device=group.device).eval()


def _shape(source) -> tuple[int, ...]:
    return tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())


def _read_shard(name: str, source, param: torch.Tensor, group: RankGroup, where: str) -> torch.Tensor:
    """This rank's part of a full tensor (a tensor or a lazy safetensors slice) for `param`."""
    full, local = _shape(source), tuple(param.shape)
    if len(full) != len(local):
        raise WeightShapeError(f"{where}: tensor {name!r} has shape {full}, the model expects {local} per rank")
    split = [d for d in range(len(full)) if full[d] != local[d]]
    if not split:
        if name.endswith(RANK0_ONLY_SUFFIXES) and group.rank != 0:
            return torch.zeros(local)
        return source if isinstance(source, torch.Tensor) else source[:]
    dim = split[0]
    size = local[dim]
    if len(split) > 1 or not size * (group.world_size - 1) < full[dim] <= size * group.world_size:
        raise WeightShapeError(
            f"{where}: tensor {name!r} has shape {full}, which does not split into "
            f"{group.world_size} shards of {local}"
        )
    start, stop = group.rank * size, min((group.rank + 1) * size, full[dim])
    index = (slice(None),) * dim + (slice(start, stop),)
    part = source[index]
    if stop - start < size:  # the last vocabulary slice is padded with rows nobody looks up
        pad = list(local)
        pad[dim] = size - (stop - start)
        part = torch.cat([part, torch.zeros(pad, dtype=part.dtype)], dim=dim)
    return part


@torch.no_grad()
def load_sharded_weights(model: ShardedCausalLM, directory: str | Path) -> None:
    """Copy this rank's slice of every checkpoint tensor into the shard, reading only that slice."""
    params = dict(model.named_parameters())
    missing = set(params)
    for path in checkpoint_files(directory):
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None
        with handle:
            for name in handle.keys():
                if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.lm_head is None):
                    continue
                param = params.get(name)
                if param is None:
                    raise UnexpectedWeightError(
                        f"{path.name}: tensor {name!r} has no matching parameter in a "
                        f"{model.config.architecture} model with this config"
                    )
                param.copy_(_read_shard(name, handle.get_slice(name), param, model.group, path.name))
                missing.discard(name)
    if missing:
        raise MissingWeightError(f"checkpoint {directory} lacks {len(missing)} tensors: {', '.join(sorted(missing)[:5])}")


@torch.no_grad()
def init_sharded_random_weights(model: ShardedCausalLM, seed: int) -> None:
    """The shard of the weights `init_random_weights` gives the whole model, so every tp agrees."""
    with torch.device("meta"):
        full = CausalLM(model.full_config, None, next(model.parameters()).dtype)
    full = full.to_empty(device="cpu")
    init_random_weights(full, seed)
    full_params = dict(full.named_parameters())
    for name, param in model.named_parameters():
        param.copy_(_read_shard(name, full_params[name], param, model.group, "random weights"))


# ---- step plans on the wire ------------------------------------------------------------


def _sampling_to_wire(params: SamplingParams) -> dict[str, Any]:
    # Tuples as lists, a nested attrs value (structured_output) as its map.
    return {f.name: (list(v) if isinstance(v := getattr(params, f.name), tuple)
                     else attrs.asdict(v) if attrs.has(type(v)) else v)
            for f in attrs.fields(SamplingParams)}


def encode_command(op: str, plan: StepPlan | None = None,
                   sampling: Mapping[str, SamplingParams] | None = None) -> bytes:
    """msgpack bytes of one command to the ranks: a step (plan and new requests' sampling), reset or stop."""
    body: dict[str, Any] = {"op": op}
    if plan is not None:
        body["plan"] = {
            "step_id": plan.step_id,
            "num_scheduled_tokens": dict(plan.num_scheduled_tokens),
            "total_num_scheduled_tokens": plan.total_num_scheduled_tokens,
            "new_requests": [
                [r.request_id, list(r.token_ids), r.num_prompt_tokens, list(r.block_ids),
                 r.num_computed_tokens, r.resumed] for r in plan.new_requests
            ],
            "new_block_ids": {k: list(v) for k, v in plan.new_block_ids.items()},
            "preempted_ids": list(plan.preempted_ids),
            "finished_ids": list(plan.finished_ids),
            "resumed_ids": list(plan.resumed_ids),
        }
        body["sampling"] = {rid: _sampling_to_wire(p) for rid, p in (sampling or {}).items()}
    return msgpack.packb(body, use_bin_type=True)


def decode_command(payload: bytes) -> tuple[str, StepPlan | None, dict[str, SamplingParams]]:
    """The (op, plan, sampling) that `encode_command` encoded."""
    body = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    wire = body.get("plan")
    if wire is None:
        return body["op"], None, {}
    plan = StepPlan(
        step_id=wire["step_id"],
        num_scheduled_tokens=wire["num_scheduled_tokens"],
        total_num_scheduled_tokens=wire["total_num_scheduled_tokens"],
        new_requests=[NewRequestData(*fields) for fields in wire["new_requests"]],
        new_block_ids=wire["new_block_ids"],
        preempted_ids=wire["preempted_ids"],
        finished_ids=wire["finished_ids"],
        resumed_ids=wire["resumed_ids"],
    )
    sampling = {rid: SamplingParams(**fields) for rid, fields in body["sampling"].items()}
    return body["op"], plan, sampling


# ---- the runner ------------------------------------------------------------------------


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


class TensorParallelRunner(ModelRunner):
    """A `ModelRunner` over one rank's shard; rank 0's `execute` drives every rank through one step.

    Ranks other than 0 call `follow()`, which executes rank 0's commands until
    it stops them. `processes` maps ranks this process spawned to their
    `subprocess.Popen`, so a dead one is named in the error rank 0 raises.
    """

    def __init__(self, model_config: ModelConfig, group: RankGroup, **kwargs) -> None:
        if kwargs.get("use_cuda_graphs") or kwargs.get("pad_decode_batches"):
            raise ConfigError("CUDA graphs and padded decode batches are not supported with tensor parallelism")
        self.group = group
        self.processes: dict[int, subprocess.Popen] = {}
        self._closed = False
        local_config(model_config, group.world_size)
        # A shard's row-parallel products reduce across ranks inside its own modules: plain ops.
        kwargs.update(device=group.device, use_cuda_graphs=False, pad_decode_batches=False, cpu_path="eager")
        # Each rank's threads are set where the rank starts (tp_num_threads), not per runner.
        kwargs.setdefault("num_threads", None)
        # The fused elementwise kernels have not been measured on sharded ranks: asked for only.
        kwargs.setdefault("fused_elementwise", False)
        super().__init__(model_config, **kwargs)

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.group.rank

    @property
    def tp(self) -> int:
        """Number of ranks the model is sharded across."""
        return self.group.world_size

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank's cache holds."""
        return self.config.num_kv_heads // self.group.world_size

    def _build_model(self, weights_path, seed):
        model = build_sharded_model(self.config, self.backend, self.group, self.dtype)
        if weights_path is None:
            init_sharded_random_weights(model, seed)
        else:
            load_sharded_weights(model, weights_path)
        return model

    def _profile_num_blocks(self, *args) -> int:
        # Ranks may see different free memory; all must agree on one block count.
        count = torch.tensor([super()._profile_num_blocks(*args)], device=self.group.device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        return int(count.item())

    def _new_matcher(self, state) -> str | None:
        # Only rank 0 samples; the other ranks take its tokens as they come.
        return super()._new_matcher(state) if self.rank == 0 else None

    def _sample(self, logits, states):
        if self.rank == 0:
            tokens, logprobs = super()._sample(logits, states)
        else:
            tokens, logprobs = None, [None] * len(states)
        return self.group.broadcast_tokens(tokens, len(states)), logprobs

    def execute(self, plan: StepPlan, sampling_params: Mapping[str, SamplingParams]):
        """On rank 0: send the plan to every rank, run this shard, sample; returns the StepResult."""
        if self._closed:
            raise ExecutorError("tensor-parallel runner is closed")
        if self.rank != 0:
            return super().execute(plan, sampling_params)
        self._check_ranks(plan.step_id)
        try:
            self.group.broadcast_bytes(encode_command(OP_STEP, plan, sampling_params))
            return super().execute(plan, sampling_params)
        except RuntimeError as exc:
            raise self._collective_error(plan.step_id, exc) from exc

    def reset(self) -> None:
        """Forget every request, on every rank."""
        if self.rank == 0 and not self._closed:
            self.group.broadcast_bytes(encode_command(OP_RESET))
        super().reset()

    def follow(self) -> None:
        """Serve rank 0's commands until it says stop (ranks other than 0)."""
        while True:
            op, plan, sampling = decode_command(self.group.broadcast_bytes(None))
            if op == OP_STOP:
                return
            if op == OP_RESET:
                super().reset()
                continue
            try:
                super().execute(plan, sampling)
            except ExecutorError:
                pass  # rank 0 rejects the same plan at the same point and reports it

    def close(self) -> None:
        """Stop the other ranks, reap those this process spawned, and leave the process group."""
        if self._closed:
            return
        self._closed = True
        if self.rank == 0 and not self._dead_ranks():
            try:
                self.group.broadcast_bytes(encode_command(OP_STOP))
            except RuntimeError:
                pass  # a rank is gone; it is killed below
        deadline = time.monotonic() + STOP_WAIT_S
        for process in self.processes.values():
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _dead_ranks(self) -> list[str]:
        return [f"rank {rank} (pid {p.pid}) {_describe_exit(p.returncode)}"
                for rank, p in sorted(self.processes.items()) if p.poll() is not None]

    def _check_ranks(self, step_id: int) -> None:
        dead = self._dead_ranks()
        if dead:
            self._closed = True
            raise ExecutorError(f"tensor-parallel step {step_id} cannot run: {'; '.join(dead)}")

    def _collective_error(self, step_id: int, exc: BaseException) -> ExecutorError:
        """The error for a failed collective, naming the rank that died when this process owns it."""
        self._closed = True
        deadline = time.monotonic() + DEATH_GRACE_S
        while self.processes and not self._dead_ranks() and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = self._dead_ranks()
        who = "; ".join(dead) if dead else "a peer rank failed or timed out"
        return ExecutorError(f"tensor-parallel step {step_id} failed: {who} ({type(exc).__name__}: {exc})")


# ---- spawning the ranks of one machine ----------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this child when the process that spawned it ends."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def model_config_for(model: str) -> ModelConfig:
    """The config of a preset name or of a Hugging Face checkpoint directory."""
    return PRESETS[model] if model in PRESETS else ModelConfig.from_pretrained(model)


def build_rank_runner(group: RankGroup, spec: Mapping[str, Any]) -> TensorParallelRunner:
    """This rank's runner from a JSON-able spec: model (preset or directory) plus ModelRunner options."""
    options = dict(spec)
    model = options.pop("model")
    options.pop("device", None)
    if model not in PRESETS:
        options["weights_path"] = model
    return TensorParallelRunner(model_config_for(model), group, **options)


_active: TensorParallelRunner | None = None
_launched: TensorParallelRunner | None = None


def launched_rank() -> tuple[int, int] | None:
    """(rank, world size) when a launcher such as torchrun started this process as
    one of several ranks (RANK and WORLD_SIZE set, WORLD_SIZE > 1), else None."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def join_launched_group(spec: Mapping[str, Any] | None, timeout_s: float = DEFAULT_TIMEOUT_S,
                        device: str = "auto") -> TensorParallelRunner:
    """This rank's runner in a group a launcher started (rendezvous from the environment).

    Rank 0 passes the runner `spec` and broadcasts it as JSON bytes, so the other
    ranks need no arguments of their own; they pass None. The group lives for the
    process: a second call on rank 0 (an executor restart) resets and returns the
    same runner, since a launcher's ranks cannot be respawned from here.
    """
    global _launched
    if _launched is not None:
        _launched.reset()
        return _launched
    group = init_rank_group(spec.get("device", device) if spec else device, timeout_s)
    payload = group.broadcast_bytes(json.dumps(dict(spec)).encode() if group.rank == 0 else None)
    _launched = build_rank_runner(group, json.loads(payload))
    return _launched


def start_local_runner(
    tp: int, spec: Mapping[str, Any], timeout_s: float = DEFAULT_TIMEOUT_S, num_threads: int | None = None,
) -> TensorParallelRunner:
    """Spawn ranks 1..tp-1 on this machine, join them as rank 0, and return rank 0's runner.

    spec: model (preset name or checkpoint directory), device and the other
    `ModelRunner` keyword arguments, passed to every rank as JSON. A previous
    local group of this process is closed first.
    """
    global _active
    local_config(model_config_for(spec["model"]), tp)
    if _active is not None:
        _active.close()
        _active = None
    port = _free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(tp),
               LOCAL_WORLD_SIZE=str(tp))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    command = [sys.executable, "-m", WORKER_MODULE, "--spec", json.dumps(dict(spec)),
               "--timeout-s", str(timeout_s)]
    if num_threads is not None:
        command += ["--num-threads", str(num_threads)]
    processes: dict[int, subprocess.Popen] = {}
    try:
        for rank in range(1, tp):
            processes[rank] = subprocess.Popen(
                command, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
            )
        # Every rank of a local group is on this machine, so gloo talks over loopback
        # instead of whatever interface the host name happens to resolve to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        group = init_rank_group(spec.get("device", "auto"), timeout_s, f"tcp://127.0.0.1:{port}", 0, tp)
        try:
            runner = build_rank_runner(group, spec)
        except BaseException:
            dist.destroy_process_group()
            raise
    except BaseException:
        for process in processes.values():
            process.kill()
            process.wait()
        raise
    runner.processes = processes
    _active = runner
    return runner
