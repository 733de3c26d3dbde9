"""Offline throughput on the nano-vllm workload: Cadence against Hugging Face transformers, same weights.

One run builds a random-weight model with transformers (seeded), saves it as a
checkpoint in a temporary directory, loads that checkpoint into Cadence, and
pushes the workload through

  cadence      the scheduling core (`Scheduler`) driving a `ModelRunner` in a
               plain offline loop: add every request, then schedule, execute,
               update until done;
  hf-generate  `model.generate` on left-padded batches (`--hf-batch-size`);
               a batch runs until its longest request is done, and only the
               requested tokens count as output;
  hf-cb        transformers' continuous batching manager, where the installed
               version has one (skipped with the reason printed otherwise).

Each engine prints one JSON line (output tokens, seconds, tokens/s, and its
ratio to Cadence). `--hf-slice N` sends only the first N requests through the
transformers engines: their rates are then compared as rates. `--check-greedy
K` compares Cadence's greedy tokens with transformers' greedy tokens for the
first K requests (the throughput runs themselves use `--temperature`, greedy by
default; nano-vllm uses 0.6, which changes no count since EOS is ignored).

Scaling for CPU runs: `--preset tiny --num-requests 32 --max-input 128
--max-output 128` draws the nano workload's way with every length bound divided
by 8 (prompt and output lengths U[12, 128]) and token ids folded into the tiny
vocabulary.

    python benchmarks/throughput.py --preset tiny --num-requests 32 --max-input 128 --max-output 128
    python benchmarks/throughput.py --preset qwen3-0.6b --device cuda --dtype bfloat16 --hf-slice 32
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nano_workload import Workload, scaled  # noqa: E402

from cadence.gpu import ModelRunner, preset  # noqa: E402
from cadence.gpu.config import ModelConfig  # noqa: E402
from cadence.statemachine.config import CacheConfig, SchedulerConfig  # noqa: E402
from cadence.statemachine.request import Request  # noqa: E402
from cadence.statemachine.sampling import SamplingParams  # noqa: E402
from cadence.statemachine.scheduler import Scheduler  # noqa: E402

PAD_TOKEN_ID = 0
WARMUP_REQUESTS = 4
WARMUP_OUTPUT = 4


def emit(**record) -> None:
    """Print one result as a JSON line."""
    print(json.dumps(record), flush=True)


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


# --------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny", "qwen3-0.6b"])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-input", type=int, default=1024)
    parser.add_argument("--max-output", type=int, default=1024)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, ...; auto: fp32 on CPU, bf16 on GPU")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; nano-vllm uses 0.6")
    parser.add_argument("--attention-backend", default="auto", help="auto: triton on CUDA, sdpa on CPU")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None, help="default: profiled on CUDA, sized to fit on CPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--hf-slice", type=int, default=None,
                        help="send only the first N requests through transformers")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--engines", default="cadence,hf-generate,hf-cb")
    parser.add_argument("--check-greedy", type=int, default=0, metavar="K")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's); 1 avoids spin-wait contention on shared cores")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Run the engines asked for and print one JSON line each."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engines = set(args.engines.split(","))
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    config = preset(args.preset)
    workload = scaled(args.num_requests, args.max_input, args.max_output,
                      max_token_id=min(config.vocab_size - 1, 10000))
    emit(event="workload", preset=args.preset, device=device, temperature=args.temperature,
         threads=torch.get_num_threads(), **workload.summary())
    backend = args.attention_backend
    if backend == "auto":
        backend = "triton" if device == "cuda" else "sdpa"
    num_blocks = args.num_blocks
    if num_blocks is None and device == "cpu":
        num_blocks = sum(-(-(len(p) + o) // args.block_size) for p, o in zip(workload.prompts, workload.output_lens))
    with tempfile.TemporaryDirectory(prefix="cadence-throughput-") as tmp:
        start = time.perf_counter()
        hf_model = build_hf_model(config, args.seed)
        hf_model.save_pretrained(tmp)
        emit(event="hf-model-built", seconds=time.perf_counter() - start, directory=tmp)
        cadence = None
        if "cadence" in engines or args.check_greedy:
            start = time.perf_counter()
            runner = ModelRunner.from_pretrained(
                tmp, num_blocks=num_blocks, block_size=args.block_size, device=device, dtype=args.dtype,
                attention_backend=backend, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=min(args.max_model_len, config.max_model_len),
                gpu_memory_utilization=args.gpu_memory_utilization,
                use_cuda_graphs=False if args.no_cuda_graphs else None,
            )
            if device == "cuda":
                runner.enable_gpu_timing()
            emit(event="cadence-ready", seconds=time.perf_counter() - start, num_blocks=runner.num_blocks,
                 cuda_graphs=runner.use_cuda_graphs, attention_backend=backend, dtype=str(runner.dtype))
            options = dict(temperature=args.temperature, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed)
            warm_up_cadence(runner, workload, **options)
            cadence = run_cadence(runner, workload, **options)
            emit(engine="cadence", **cadence["record"])
        hf_dtype = runner.dtype if cadence is not None else torch.float32
        hf_model = hf_model.to(device=device, dtype=hf_dtype)
        hf_model.generation_config.eos_token_id = None
        hf_model.generation_config.pad_token_id = PAD_TOKEN_ID
        hf_workload = workload if args.hf_slice is None else workload.head(args.hf_slice)
        for engine in ("hf-generate", "hf-cb"):
            if engine not in engines:
                continue
            try:
                if engine == "hf-generate":
                    result = run_hf_generate(hf_model, hf_workload, batch_size=args.hf_batch_size,
                                             temperature=args.temperature)
                else:
                    result = run_hf_continuous(hf_model, hf_workload, temperature=args.temperature)
            except Exception as error:  # report and go on: the other engines still stand
                emit(engine=engine, error=f"{type(error).__name__}: {error}"[:500])
                continue
            if "skipped" in result:
                emit(engine=engine, skipped=result["skipped"])
                continue
            record = result["record"]
            if cadence is not None:
                record["cadence_over_this"] = cadence["record"]["tokens_per_s"] / record["tokens_per_s"]
            emit(engine=engine, num_requests=hf_workload.num_requests, **record)
        if args.check_greedy and cadence is not None:
            sample = workload.head(args.check_greedy)
            if args.temperature == 0:
                got = {rid: cadence["outputs"][rid] for rid in list(cadence["outputs"])[: args.check_greedy]}
            else:
                got = run_cadence(runner, sample, temperature=0.0, max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens)["outputs"]
            expected = hf_greedy_reference(hf_model, sample)
            emit(check="greedy-vs-hf", dtype=str(hf_dtype), **compare_tokens(got, expected))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
