"""Offline throughput: Cadence's three ways in against Hugging Face transformers `generate`, same weights.

One run loads a model (the built-in demo model with `--model demo`, a
checkpoint directory, or a preset with seeded random weights saved as a
checkpoint) into transformers and into Cadence, then, for each request count
of `--num-requests` (default 1 and 32), measures `--reps` rounds of

  core         the scheduling core (`Scheduler`) driving a `ModelRunner` in a
               plain offline loop, on a thread of its own as the executor would;
  llm          `LLM(...).generate(prompts, params)`, the offline API users call;
  engine       `open_engine` + one `generate` stream per prompt, the embedded API;
  hf-generate  `model.generate` on the same prompts in one left-padded batch
               (`--hf-batch-size`); a batch runs until its longest request is
               done, and only the requested tokens count as output;
  hf-cb        (only if listed in --engines) transformers' continuous batching.

Both sides run with their default settings (Cadence's executor picks its own
thread count; transformers runs on torch's default), each Cadence path paired
with the transformers run of the same round, the order of the paths rotating
from round to round. Every measurement prints one JSON line with its ratio to
that round's transformers figure; each (path, request count) ends with a
summary line of the median ratio. `--busy N` runs N busy-looping processes
beside the whole measurement (the "machine under load" condition).

Workloads draw the nano-vllm way (`nano_workload.scaled`): `--max-input 128
--max-output 128` gives prompt and output lengths U[12, 128], token ids folded
into the model's vocabulary; the smaller request counts take the first
requests of the largest.

    python benchmarks/throughput.py --model demo                       # quiet
    python benchmarks/throughput.py --model demo --busy 2              # two busy processes beside it
    python benchmarks/throughput.py --preset tiny --num-requests 32 --engines core,hf-generate,hf-cb
    python benchmarks/throughput.py --preset qwen3-0.6b --device cuda --dtype bfloat16 --num-requests 256 \
        --hf-slice 32 --engines core,hf-generate
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from busy import busy_processes  # noqa: E402
from nano_workload import Workload, scaled  # noqa: E402

from cadence.actors import LLM, EngineConfig, open_engine  # noqa: E402
from cadence.actors.cli import demo_model_dir  # noqa: E402
from cadence.gpu import ModelRunner, preset  # noqa: E402
from cadence.gpu.config import ModelConfig  # noqa: E402
from cadence.gpu.runner import DTYPES  # noqa: E402
from cadence.statemachine.config import CacheConfig, SchedulerConfig  # noqa: E402
from cadence.statemachine.request import Request  # noqa: E402
from cadence.statemachine.sampling import SamplingParams  # noqa: E402
from cadence.statemachine.scheduler import Scheduler  # noqa: E402

PAD_TOKEN_ID = 0
WARMUP_REQUESTS = 4
WARMUP_OUTPUT = 4


_OUT: list[Path] = []


def emit(**record) -> None:
    """Print one result as a JSON line (and append it to the --out file, if any)."""
    line = json.dumps(record)
    print(line, flush=True)
    for path in _OUT:
        with path.open("a") as out:
            out.write(line + "\n")


# --------------------------------------------------------------------------- models


def hf_config_dict(config: ModelConfig) -> dict:
    """A Hugging Face config.json for a Cadence model shape (Llama or Qwen3 family)."""
    hf = dict(
        model_type=config.architecture, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps, hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters=dict(rope_type="default", rope_theta=config.rope_theta),
        rope_theta=config.rope_theta,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_ids[0] if config.eos_token_ids else None,
        pad_token_id=PAD_TOKEN_ID,
        attention_bias=config.qkv_bias,
    )
    if config.rope_scaling is not None or config.sliding_window is not None:
        raise ValueError("benchmark presets use plain rotary embeddings and no sliding window")
    return hf


def build_hf_model(config: ModelConfig, seed: int):
    """A float32 transformers model of this shape with seeded random weights (its own initialiser)."""
    import transformers

    hf_config = transformers.AutoConfig.for_model(**hf_config_dict(config))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return model.eval()


def save_cadence_checkpoint(runner: ModelRunner, directory: Path) -> None:
    """Write the runner's weights and config as a Hugging Face checkpoint (names already match)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config_dict(runner.config), indent=1))
    tensors = {name: p.detach().to("cpu").contiguous() for name, p in runner.model.named_parameters()}
    save_file(tensors, str(directory / "model.safetensors"))


def load_hf(directory: Path, device: str, dtype: torch.dtype):
    """The checkpoint in `directory` as a transformers model, with EOS switched off for generation."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model


# --------------------------------------------------------------------------- Cadence


def run_cadence(runner: ModelRunner, workload: Workload, *, temperature: float, max_num_seqs: int,
                max_num_batched_tokens: int, seed: int = 0) -> dict:
    """Push the workload through the scheduling core and the runner; outputs and timings."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=runner.max_model_len),
        CacheConfig(num_blocks=runner.num_blocks, block_size=runner.block_size),
    )
    params: dict[str, SamplingParams] = {}
    eos = frozenset(runner.eos_token_ids)
    for i, (prompt, num_out) in enumerate(zip(workload.prompts, workload.output_lens)):
        request_id = f"req-{i}"
        params[request_id] = SamplingParams(
            temperature=temperature, max_tokens=num_out, ignore_eos=True,
            seed=None if temperature == 0 else seed + i,
        )
        scheduler.add_request(Request(request_id, prompt, params[request_id].limits(eos)))
    outputs: dict[str, list[int]] = {rid: [] for rid in params}
    runner.reset()
    timer = runner.gpu_timer
    if timer is not None:
        timer.reset()
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    num_steps = num_decode_steps = 0
    start = time.perf_counter()
    while scheduler.has_work():
        plan = scheduler.schedule()
        if plan.is_empty:
            raise RuntimeError(f"step {plan.step_id}: empty plan with {scheduler.num_waiting} waiting "
                               f"and {scheduler.num_running} running")
        result = runner.execute(plan, {d.request_id: params[d.request_id] for d in plan.new_requests})
        for event in scheduler.update(plan, result):
            outputs[event.request_id].extend(event.token_ids)
        num_steps += 1
        num_decode_steps += plan.total_num_scheduled_tokens == len(plan.num_scheduled_tokens)
    seconds = time.perf_counter() - start
    num_tokens = sum(len(v) for v in outputs.values())
    record = dict(num_output_tokens=num_tokens, seconds=seconds, tokens_per_s=num_tokens / seconds,
                  num_steps=num_steps, num_decode_steps=num_decode_steps,
                  num_preemptions=getattr(scheduler.stats(), "num_preemptions", None))
    if timer is not None:
        record.update(gpu_busy_s=timer.busy_s, gpu_idle_s=seconds - timer.busy_s,
                      host_gap_ms_per_step=(seconds - timer.busy_s) / max(num_steps, 1) * 1e3)
    if num_tokens != workload.num_output_tokens:
        raise RuntimeError(f"Cadence produced {num_tokens} tokens, the workload asks {workload.num_output_tokens}")
    return dict(record=record, outputs=outputs)


def warm_up_cadence(runner: ModelRunner, workload: Workload, **options) -> None:
    """Compile kernels and settle allocations on a few short requests."""
    run_cadence(runner, workload.head(WARMUP_REQUESTS).capped(WARMUP_OUTPUT), **options)


# --------------------------------------------------------------------------- transformers


def _generation_config(model, max_new_tokens: int, temperature: float):
    import transformers

    config = transformers.GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=temperature > 0, pad_token_id=PAD_TOKEN_ID,
        eos_token_id=None, bos_token_id=model.config.bos_token_id,
    )
    if temperature > 0:
        config.temperature = temperature
        config.top_k = 0
        config.top_p = 1.0
    return config


@torch.inference_mode()
def run_hf_generate(model, workload: Workload, *, batch_size: int, temperature: float,
                    collect: bool = False) -> dict:
    """`model.generate` on left-padded batches in workload order; only requested tokens count."""
    device = model.device
    outputs: dict[str, list[int]] = {}
    num_generated = 0
    _sync(device)
    start = time.perf_counter()
    for first in range(0, workload.num_requests, batch_size):
        prompts = workload.prompts[first : first + batch_size]
        lengths = workload.output_lens[first : first + batch_size]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), PAD_TOKEN_ID, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        max_new = max(lengths)
        out = model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                             generation_config=_generation_config(model, max_new, temperature))
        num_generated += (out.shape[1] - width) * len(prompts)
        if collect:
            new_tokens = out[:, width:].tolist()
            for row, n in enumerate(lengths):
                outputs[f"req-{first + row}"] = new_tokens[row][:n]
    _sync(device)
    seconds = time.perf_counter() - start
    num_tokens = workload.num_output_tokens
    record = dict(num_output_tokens=num_tokens, num_generated_tokens=num_generated, seconds=seconds,
                  tokens_per_s=num_tokens / seconds, batch_size=batch_size)
    return dict(record=record, outputs=outputs)


@torch.inference_mode()
def run_hf_continuous(model, workload: Workload, *, temperature: float, timeout_s: float = 600.0) -> dict:
    """transformers' continuous batching manager, one request per prompt with its own output length."""
    if not hasattr(model, "init_continuous_batching"):
        return dict(skipped="this transformers has no continuous batching (init_continuous_batching)")
    config = _generation_config(model, max(workload.output_lens), temperature)
    _sync(model.device)
    start = time.perf_counter()
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    results = {}
    try:
        for i, (prompt, num_out) in enumerate(zip(workload.prompts, workload.output_lens)):
            manager.add_request(input_ids=list(prompt), request_id=f"req-{i}", max_new_tokens=num_out)
        deadline = time.perf_counter() + timeout_s
        while len(results) < workload.num_requests and time.perf_counter() < deadline:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                break
    finally:
        manager.stop(block=True, timeout=10)
    _sync(model.device)
    seconds = time.perf_counter() - start
    errors = [r.error for r in results.values() if getattr(r, "error", None)]
    num_tokens = sum(len(r.generated_tokens) for r in results.values())
    record = dict(num_output_tokens=num_tokens, seconds=seconds, tokens_per_s=num_tokens / seconds,
                  num_finished=len(results), num_errors=len(errors), first_error=errors[0] if errors else None)
    outputs = {rid: list(r.generated_tokens) for rid, r in results.items()}
    return dict(record=record, outputs=outputs)


@torch.inference_mode()
def hf_greedy_reference(model, workload: Workload) -> dict[str, list[int]]:
    """Greedy tokens per request, one request at a time (no padding)."""
    outputs = {}
    for i, (prompt, num_out) in enumerate(zip(workload.prompts, workload.output_lens)):
        input_ids = torch.tensor([prompt], device=model.device)
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             generation_config=_generation_config(model, num_out, 0.0))
        outputs[f"req-{i}"] = out[0, len(prompt):].tolist()
    return outputs


def compare_tokens(got: dict[str, list[int]], expected: dict[str, list[int]]) -> dict:
    """How many sequences agree token for token, and where the others first differ."""
    first_differences = {}
    for rid, want in expected.items():
        have = got.get(rid, [])
        index = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), None)
        if index is None and len(have) != len(want):
            index = min(len(have), len(want))
        if index is not None:
            first_differences[rid] = index
    return dict(num_compared=len(expected), num_identical=len(expected) - len(first_differences),
                first_differences=first_differences)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- Cadence's ways in

CADENCE_PATHS = ("core", "llm", "engine")
HF_ENGINES = ("hf-generate", "hf-cb")


class ModelThread:
    """One thread that builds and drives a `ModelRunner`, as the in-process executor's model thread does.

    The runner sets its thread count from the thread that builds it; keeping it
    off the main thread leaves transformers (run on the main thread) on torch's default.
    """

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cadence-model")

    def call(self, fn, *args, **kwargs):
        """Run `fn` on the model thread and return its result."""
        return self._pool.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        """Join the thread."""
        self._pool.shutdown()


def sampling_params(workload: Workload, temperature: float, seed: int) -> list[SamplingParams]:
    """One request's parameters per prompt: its drawn output length, EOS ignored."""
    return [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True,
                           seed=None if temperature == 0 else seed + i)
            for i, n in enumerate(workload.output_lens)]


def output_token_ids(result) -> list[int]:
    """The generated ids of one `LLM.generate` result (Cadence's RequestResult or vLLM's RequestOutput)."""
    outputs = getattr(result, "outputs", None)
    return list(outputs[0].token_ids) if outputs else list(result.token_ids)


def engine_config(args: argparse.Namespace, directory: str) -> EngineConfig:
    """The engine of the `llm` and `engine` paths: the real executor in this process, else defaults."""
    limits = {name: getattr(args, name) for name in ("max_num_seqs", "max_num_batched_tokens")
              if getattr(args, name) is not None}
    return EngineConfig.from_kwargs(executor="inprocess", model=directory, device=args.device, dtype=args.dtype,
                                    seed=args.seed, **limits)


def timed_record(outputs: dict[str, list[int]], seconds: float, workload: Workload) -> dict:
    """The record of one run, after checking it produced every requested token."""
    num_tokens = sum(len(v) for v in outputs.values())
    if num_tokens != workload.num_output_tokens:
        raise RuntimeError(f"produced {num_tokens} tokens, the workload asks {workload.num_output_tokens}")
    return dict(record=dict(num_output_tokens=num_tokens, seconds=seconds, tokens_per_s=num_tokens / seconds),
                outputs=outputs)


def run_llm(llm: LLM, workload: Workload, *, temperature: float, seed: int = 0) -> dict:
    """The workload through `LLM.generate`, every prompt in one call."""
    params = sampling_params(workload, temperature, seed)
    prompts = [list(p) for p in workload.prompts]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    outputs = {f"req-{i}": output_token_ids(r) for i, r in enumerate(results)}
    return timed_record(outputs, seconds, workload)


def run_engine(config: EngineConfig, workload: Workload, *, temperature: float, seed: int = 0) -> dict:
    """The workload through `open_engine`: one stream per prompt, all submitted at once.

    The engine starts (and warms up on a few short requests) before the clock does.
    """
    params = sampling_params(workload, temperature, seed)
    warm_up = workload.head(WARMUP_REQUESTS).capped(WARMUP_OUTPUT)

    async def submit_all(engine, load: Workload, load_params) -> dict[str, list[int]]:
        outputs: dict[str, list[int]] = {}

        async def collect(index: int, stream) -> None:
            outputs[f"req-{index}"] = list((await stream.collect()).token_ids)

        streams = [engine.generate(list(p), sp).enqueue() for p, sp in zip(load.prompts, load_params)]
        async with trio.open_nursery() as nursery:
            for index, stream in enumerate(streams):
                nursery.start_soon(collect, index, stream)
        return outputs

    async def main() -> dict:
        async with open_engine(config) as engine:
            await submit_all(engine, warm_up, sampling_params(warm_up, temperature, seed))
            start = time.perf_counter()
            outputs = await submit_all(engine, workload, params)
            return timed_record(outputs, time.perf_counter() - start, workload)

    return trio.run(main)


# --------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="'demo' (the built-in demo model) or a checkpoint directory; default: --preset")
    parser.add_argument("--preset", default="tiny", choices=["tiny", "qwen3-0.6b"],
                        help="random-weight model when --model is not given (default tiny)")
    parser.add_argument("--num-requests", default="1,32",
                        help="comma-separated request counts, each measured on its own (default 1,32)")
    parser.add_argument("--max-input", type=int, default=128)
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3, help="rounds per request count (default 3)")
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="busy-looping processes to run beside the measurement (default 0)")
    parser.add_argument("--engines", default="core,llm,engine,hf-generate",
                        help=f"any of {', '.join(CADENCE_PATHS + HF_ENGINES)} (default: all but hf-cb)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, ...; auto: fp32 on CPU, bf16 on GPU")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; nano-vllm uses 0.6")
    parser.add_argument("--attention-backend", default="auto",
                        help="core path: auto (the runner's default), reference, sdpa or triton")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="core path: eager decode steps")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the scheduler's")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the scheduler's")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="core path: KV blocks (default: profiled on CUDA, the engine's default on CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--hf-slice", type=int, default=None,
                        help="send only the first N requests through transformers (rates compared as rates)")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--hf-threads", type=int, default=None,
                        help="torch threads for transformers (default: torch's default)")
    parser.add_argument("--check-greedy", type=int, default=0, metavar="K",
                        help="compare the core path's greedy tokens with transformers' (one request at a "
                             "time) for the first K requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also append every JSON line to this file")
    return parser.parse_args(argv)


def prepare_model(args: argparse.Namespace, device: str, tmp: str) -> tuple[str, ModelConfig]:
    """The checkpoint directory both sides load, and its config (a preset is saved there first)."""
    if args.model is not None:
        directory = demo_model_dir() if args.model == "demo" else args.model
        return directory, ModelConfig.from_pretrained(directory)
    config = preset(args.preset)
    start = time.perf_counter()
    build_hf_model(config, args.seed).save_pretrained(tmp)
    emit(event="hf-model-built", seconds=time.perf_counter() - start, directory=tmp)
    return tmp, config


def hf_dtype(name: str, device: str) -> torch.dtype:
    """transformers' dtype: the one Cadence runs (`--dtype`, or its default for the device)."""
    if name != "auto":
        return DTYPES[name]
    return torch.float32 if device == "cpu" else torch.bfloat16


class Measure:
    """The runs of one request count: each engine asked for, warm, timed on demand."""

    def __init__(self, args: argparse.Namespace, directory: str, device: str, engines: set[str]) -> None:
        self.args, self.directory, self.device, self.engines = args, directory, device, engines
        self.model_thread = ModelThread()
        self.runner = None
        self.llm = None
        self.hf = load_hf(Path(directory), device, hf_dtype(args.dtype, device))
        if "core" in engines or args.check_greedy:
            self.runner = self.model_thread.call(self._build_runner)
        if "llm" in engines:
            self.llm = LLM(**_config_kwargs(engine_config(args, directory)))

    def _build_runner(self) -> ModelRunner:
        args = self.args
        runner = ModelRunner.from_pretrained(
            self.directory, num_blocks=args.num_blocks or (None if self.device == "cuda" else CacheConfig().num_blocks),
            block_size=args.block_size, device=self.device, dtype=args.dtype,
            attention_backend=args.attention_backend, max_num_seqs=args.max_num_seqs or SchedulerConfig().max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens or SchedulerConfig().max_num_batched_tokens,
            gpu_memory_utilization=args.gpu_memory_utilization,
            use_cuda_graphs=False if args.no_cuda_graphs else None,
        )
        if self.device == "cuda":
            runner.enable_gpu_timing()
        return runner

    def _core_options(self) -> dict:
        args = self.args
        return dict(temperature=args.temperature, seed=args.seed,
                    max_num_seqs=args.max_num_seqs or SchedulerConfig().max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens or SchedulerConfig().max_num_batched_tokens)

    def describe(self) -> dict:
        """What each side runs with."""
        runner = self.runner
        return dict(
            hf_threads=torch.get_num_threads(),
            cadence_threads=None if runner is None else runner.num_threads,
            attention_backend=None if runner is None else runner.backend.name,
            cuda_graphs=None if runner is None else runner.use_cuda_graphs,
            dtype=None if runner is None else str(runner.dtype),
        )

    def warm_up(self, workload: Workload) -> None:
        """Compile kernels and settle allocations on a few short requests, on every side."""
        small = workload.head(WARMUP_REQUESTS).capped(WARMUP_OUTPUT)
        if self.runner is not None:
            self.model_thread.call(run_cadence, self.runner, small, **self._core_options())
        if self.llm is not None:
            run_llm(self.llm, small, temperature=self.args.temperature, seed=self.args.seed)
        run_hf_generate(self.hf, small, batch_size=self.args.hf_batch_size, temperature=self.args.temperature)

    def run(self, engine: str, workload: Workload) -> dict:
        """One timed run of `engine` on `workload`."""
        args = self.args
        if engine == "core":
            return self.model_thread.call(run_cadence, self.runner, workload, **self._core_options())
        if engine == "llm":
            return run_llm(self.llm, workload, temperature=args.temperature, seed=args.seed)
        if engine == "engine":
            return run_engine(engine_config(args, self.directory), workload, temperature=args.temperature,
                              seed=args.seed)
        hf_workload = workload if args.hf_slice is None else workload.head(args.hf_slice)
        if engine == "hf-generate":
            return run_hf_generate(self.hf, hf_workload, batch_size=args.hf_batch_size,
                                   temperature=args.temperature, collect=True)
        return run_hf_continuous(self.hf, hf_workload, temperature=args.temperature)

    def close(self) -> None:
        """Stop the LLM's engine and the model thread."""
        if self.llm is not None:
            self.llm.close()
        self.model_thread.close()


def _config_kwargs(config: EngineConfig) -> dict:
    """The LLM keywords that rebuild `config` (the scheduler limits flat, as LLM takes them)."""
    kwargs = dict(executor=config.executor, model=config.model, device=config.device, dtype=config.dtype,
                  seed=config.seed)
    defaults = SchedulerConfig()
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        if getattr(config.scheduler, name) != getattr(defaults, name):
            kwargs[name] = getattr(config.scheduler, name)
    return kwargs


def main(argv=None) -> int:
    """Measure every engine asked for at every request count; one JSON line per run and per summary."""
    args = parse_args(argv)
    if args.out is not None:
        _OUT.append(args.out)
    if args.hf_threads:
        torch.set_num_threads(args.hf_threads)
    torch.get_num_threads()  # fixes this (transformers') thread's count before any runner sets the default
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(CADENCE_PATHS + HF_ENGINES))
    if unknown:
        raise SystemExit(f"--engines: unknown {', '.join(unknown)}; choose from {', '.join(CADENCE_PATHS + HF_ENGINES)}")
    paths = [e for e in engines if e in CADENCE_PATHS]
    hf_engines = [e for e in engines if e in HF_ENGINES] or ["hf-generate"]
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    args.device = device
    sizes = sorted({int(n) for n in args.num_requests.split(",")})
    with tempfile.TemporaryDirectory(prefix="cadence-throughput-") as tmp:
        directory, config = prepare_model(args, device, tmp)
        largest = scaled(sizes[-1], args.max_input, args.max_output,
                         max_token_id=min(config.vocab_size - 1, 10000), seed=args.seed)
        measure = Measure(args, directory, device, set(engines))
        try:
            emit(event="setup", model=args.model or args.preset, device=device, temperature=args.temperature,
                 busy=args.busy, cpus=len(os.sched_getaffinity(0)), load_avg_1m=round(os.getloadavg()[0], 2),
                 **measure.describe())
            measure.warm_up(largest)
            with busy_processes(args.busy):
                for size in sizes:
                    compare(measure, largest.head(size), paths, hf_engines, args)
            if args.check_greedy and measure.runner is not None:
                check_greedy(measure, largest.head(args.check_greedy), args)
        finally:
            measure.close()
    return 0


def compare(measure: Measure, workload: Workload, paths: list[str], hf_engines: list[str],
            args: argparse.Namespace) -> None:
    """`args.reps` rounds on one workload; each path's rate over transformers' rate of the same round."""
    ratios: dict[tuple[str, str], list[float]] = {}
    emit(event="workload", busy=args.busy, **workload.summary())
    for rep in range(args.reps):
        # The paths' order rotates so that none always runs first or last in a round.
        shift = rep % max(len(paths), 1)
        order = paths[shift:] + paths[:shift]
        results = {}
        for engine in hf_engines[:1] + order + hf_engines[1:]:
            try:
                result = measure.run(engine, workload)
            except Exception as error:  # report and go on: the other engines still stand
                emit(engine=engine, num_requests=workload.num_requests, rep=rep,
                     error=f"{type(error).__name__}: {error}"[:500])
                continue
            if "skipped" in result:
                emit(engine=engine, skipped=result["skipped"])
                continue
            results[engine] = result
        for engine, result in results.items():
            record = dict(result["record"])
            if engine in CADENCE_PATHS:
                for hf in hf_engines:
                    if hf in results:
                        ratio = record["tokens_per_s"] / results[hf]["record"]["tokens_per_s"]
                        record[f"over_{hf}"] = round(ratio, 3)
                        ratios.setdefault((engine, hf), []).append(ratio)
                if args.temperature == 0 and "hf-generate" in results and args.hf_slice is None:
                    same = compare_tokens(result["outputs"], results["hf-generate"]["outputs"])
                    record["greedy_identical_to_hf"] = f"{same['num_identical']}/{same['num_compared']}"
            emit(engine=engine, num_requests=workload.num_requests, rep=rep, busy=args.busy, **record)
    for (engine, hf), values in ratios.items():
        emit(summary=True, engine=engine, versus=hf, num_requests=workload.num_requests, busy=args.busy,
             median_ratio=round(statistics.median(values), 3), ratios=[round(v, 3) for v in values])


def check_greedy(measure: Measure, sample: Workload, args: argparse.Namespace) -> None:
    """The core path's greedy tokens against transformers' greedy tokens, one request at a time."""
    got = measure.model_thread.call(run_cadence, measure.runner, sample,
                                    **dict(measure._core_options(), temperature=0.0))["outputs"]
    expected = hf_greedy_reference(measure.hf, sample)
    emit(check="greedy-vs-hf", dtype=str(measure.runner.dtype), **compare_tokens(got, expected))


if __name__ == "__main__":
    raise SystemExit(main())
