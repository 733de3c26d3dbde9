"""One prepared run of every GPU check, in stages, each result kept the moment it exists.

Stages, in order (each in its own try/except; a stage that would start too
close to the time budget is skipped and says so):

  env       versions, device, memory
  kernels   benchmarks/attention_check.py (Triton kernels against float64, then timings)
  ceilings  device copy bandwidth and bf16 matrix rate, measured; the workload's floor
  cadence   the nano workload through the scheduling core and the runner, qwen3-0.6b
            shapes with Cadence's own random bf16 weights: CUDA graphs on, then off;
            tokens/s, GPU busy and idle time, graph-on and graph-off outputs compared
  plain, balanced
            the workload again with torch's elementwise ops instead of the fused
            RMSNorm/SwiGLU/rotary kernels (on by default on CUDA), and with length-balanced
            decode attention: tokens/s against the default run, greedy tokens compared
  greedy    the same weights saved as a Hugging Face checkpoint: Cadence float32
            (graphs on and off) against transformers float32, and Cadence bf16
            against transformers float32, greedy, first requests x first tokens
  hf        transformers `generate` (and its continuous batching, time permitting) in
            bf16 on a slice of the workload, against Cadence on the same slice
  pytest    tests/gpu/test_cuda_graphs.py (graph capture and replay tests), time permitting

Writes $OUT/gpu_check.json after every stage and prints a short table last.
`--dry-run` runs the same code on a CPU with the tiny preset and a few requests
(padded eager decode standing in for graphs), so that the GPU run cannot fail on
a typo.

    OUT=/tmp/gpuout bash benchmarks/gpu_check.sh --dry-run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import attrs
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import nano_workload  # noqa: E402
import throughput  # noqa: E402

from cadence.gpu import ModelRunner, preset  # noqa: E402


@attrs.frozen
class Settings:
    """Sizes of one run: the full GPU check or the CPU dry run."""

    dry_run: bool
    device: str
    preset: str
    dtype: str
    attention_backend: str
    num_requests: int
    max_input: int
    max_output: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    gpu_memory_utilization: float
    hf_slice: int
    hf_slice_max_output: int
    greedy_requests: int
    greedy_tokens: int
    copy_bytes: int
    matmul_size: int
    kernel_timeout_s: float
    budget_s: float
    tp: int = 1

    @classmethod
    def make(cls, dry_run: bool, budget_s: float) -> Settings:
        """The GPU sizes, or the CPU dry-run sizes."""
        if dry_run:
            return cls(True, "cpu", "tiny", "float32", "sdpa", num_requests=12, max_input=48, max_output=24,
                       max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512,
                       gpu_memory_utilization=0.5, hf_slice=4, hf_slice_max_output=8, greedy_requests=3,
                       greedy_tokens=6, copy_bytes=16 << 20, matmul_size=256, kernel_timeout_s=120.0,
                       budget_s=budget_s)
        return cls(False, "cuda", "qwen3-0.6b", "bfloat16", "triton", num_requests=256, max_input=1024,
                   max_output=1024, max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=4096,
                   gpu_memory_utilization=0.45, hf_slice=32, hf_slice_max_output=128, greedy_requests=8,
                   greedy_tokens=32, copy_bytes=2 << 30, matmul_size=8192, kernel_timeout_s=110.0,
                   budget_s=budget_s)


def portable(text: str) -> str:
    """`text` without this machine's paths, so the record can be kept in the repository:
    the checkout becomes relative, the interpreter's prefix (also as a relative path, as
    pytest prints it) `<python>`, the temporary directory `<tmp>`."""
    text = text.replace(f"{REPO}/", "")
    text = re.sub(r"(?:\.\./)*/?" + re.escape(sys.prefix.lstrip("/")), "<python>", text)
    return text.replace(f"{tempfile.gettempdir()}/", "<tmp>/")


class Report:
    """The JSON record of the run, rewritten whole after every change so a timeout loses nothing kept."""

    def __init__(self, path: Path, budget_s: float) -> None:
        self.path = path
        self.budget_s = budget_s
        self.started = time.perf_counter()
        self.data: dict = {"started_unix": time.time(), "budget_s": budget_s, "stages": {}}

    def remaining_s(self) -> float:
        """Seconds left of the budget."""
        return self.budget_s - (time.perf_counter() - self.started)

    def save(self) -> None:
        """Write the record atomically, with this machine's paths taken out (`portable`)."""
        self.data["elapsed_s"] = time.perf_counter() - self.started
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(portable(json.dumps(self.data, indent=1, default=str)))
        os.replace(tmp, self.path)

    def run_stage(self, name: str, fn, *, needs_s: float, **kwargs) -> dict:
        """Run fn(record, **kwargs) as stage `name`, unless fewer than `needs_s` seconds are left."""
        record: dict = {}
        self.data["stages"][name] = record
        if self.remaining_s() < needs_s:
            record.update(status="skipped", reason=f"{self.remaining_s():.0f} s left, stage needs ~{needs_s:.0f} s")
            print(f"== {name}: skipped ({record['reason']})", flush=True)
            self.save()
            return record
        print(f"== {name} ({self.remaining_s():.0f} s of budget left)", flush=True)
        record["status"] = "running"
        self.save()
        start = time.perf_counter()
        try:
            fn(record, **kwargs)
            record["status"] = "ok"
        except Exception as error:  # a failed stage is recorded and the next one still runs
            record["status"] = "error"
            record["error"] = f"{type(error).__name__}: {error}"[:1000]
            record["traceback"] = traceback.format_exc()[-4000:]
            print(record["traceback"], flush=True)
        record["seconds"] = time.perf_counter() - start
        self.save()
        print(f"== {name}: {record['status']} in {record['seconds']:.1f} s", flush=True)
        return record


def synchronize(device: str) -> None:
    """Wait for the device (no-op on CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    """Return cached device memory after dropping a model."""
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- stages


def stage_env(record: dict, s: Settings) -> None:
    """Versions and the device."""
    import triton
    import transformers

    record.update(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
                  transformers=transformers.__version__, cuda_available=torch.cuda.is_available(),
                  settings=attrs.asdict(s))
    if s.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        record.update(device_name=props.name, multiprocessors=props.multi_processor_count,
                      memory_total_gib=total / 2**30, memory_free_gib=free / 2**30,
                      cuda=torch.version.cuda)
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,"
                                  "memory.used,temperature.gpu", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            record["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        except Exception as error:  # the tool is optional
            record["nvidia_smi"] = f"unavailable: {error}"


def stage_kernels(record: dict, s: Settings, report: Report) -> None:
    """The Triton kernel checks and timings, as JSON lines from attention_check.py."""
    command = [sys.executable, str(HERE / "attention_check.py")] + (["--smoke"] if s.dry_run else [])
    timeout = max(10.0, min(s.kernel_timeout_s, report.remaining_s() - 150))
    record.update(command=" ".join(command), timeout_s=timeout)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        stdout, stderr, record["returncode"] = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        stderr = expired.stderr.decode() if isinstance(expired.stderr, bytes) else (expired.stderr or "")
        record["returncode"] = "timeout"
    lines = []
    for line in stdout.splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    checks = [line for line in lines if "check" in line]
    record.update(lines=lines, num_checks=len(checks), num_checks_failed=sum(not c.get("ok") for c in checks),
                  stderr_tail=stderr[-2000:])
    for line in lines:
        print(json.dumps(line), flush=True)
    if record["returncode"] != 0:
        raise RuntimeError(f"attention_check.py ended with {record['returncode']}; "
                           f"{record['num_checks_failed']} of {len(checks)} checks failed")


def _time_ms(fn, device: str, repeats: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of fn, with device events on CUDA."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def workload_floor(config, workload, *, bytes_per_s: float, flop_per_s: float, dtype_bytes: int = 2) -> dict:
    """The least time the workload can take on this device: bytes over bandwidth, FLOPs over matrix rate.

    Decode reads every weight once per step (at least max output - 1 steps) and each
    request's KV once per generated token; prefill costs 2 FLOPs per weight per prompt
    token plus causal attention. `floor_s` overlaps the two perfectly (max);
    `phased_floor_s` adds decode bytes and prefill FLOPs, which run in separate steps.
    """
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    body = c.num_layers * per_layer
    head = c.vocab_size * c.hidden_size
    kv_per_token = c.kv_bytes_per_token(dtype_bytes)
    prompts = [len(p) for p in workload.prompts]
    outputs = list(workload.output_lens)
    decode_steps = max(outputs) - 1
    weight_bytes = (body + head) * dtype_bytes * decode_steps
    kv_read = sum((o - 1) * p + (o - 1) * o // 2 for p, o in zip(prompts, outputs)) * kv_per_token
    kv_write = sum(p + o - 1 for p, o in zip(prompts, outputs)) * kv_per_token
    decode_bytes = weight_bytes + kv_read + kv_write
    prefill_flops = 2 * body * sum(prompts) + 4 * q * c.num_layers * sum(p * (p + 1) // 2 for p in prompts)
    decode_flops = 2 * (body + head) * sum(outputs)
    bytes_s, flops_s = decode_bytes / bytes_per_s, (prefill_flops + decode_flops) / flop_per_s
    floor_s = max(bytes_s, flops_s)
    phased_s = bytes_s + prefill_flops / flop_per_s
    total_out = sum(outputs)
    return dict(weight_bytes_per_step=(body + head) * dtype_bytes, decode_steps=decode_steps,
                kv_bytes_per_token=kv_per_token, decode_bytes=decode_bytes, kv_read_bytes=kv_read,
                prefill_flops=prefill_flops, decode_flops=decode_flops, bytes_s=bytes_s, flops_s=flops_s,
                floor_s=floor_s, phased_floor_s=phased_s, ceiling_tokens_per_s=total_out / floor_s,
                phased_ceiling_tokens_per_s=total_out / phased_s)


def copy_bytes_per_s(device: str, num_bytes: int) -> tuple[float, float]:
    """(median ms, bytes read plus written per second) of a device-to-device copy of num_bytes."""
    src = torch.randn(num_bytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), device)
    return ms, 2 * src.numel() * src.element_size() / (ms * 1e-3)


def matmul_flop_per_s(device: str, n: int) -> tuple[float, float]:
    """(median ms, FLOP/s) of an n x n x n bf16 matrix product on random data."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = _time_ms(lambda: a @ b, device)
    return ms, 2 * n**3 / (ms * 1e-3)


def stage_ceilings(record: dict, s: Settings, workload) -> None:
    """Measured copy bandwidth and bf16 matrix rate, and the workload's floor under them."""
    copy_ms, bytes_per_s = copy_bytes_per_s(s.device, s.copy_bytes)
    matmul_ms, flop_per_s = matmul_flop_per_s(s.device, s.matmul_size)
    free_memory(s.device)
    record.update(copy_gb=2 * s.copy_bytes / 1e9, copy_ms=copy_ms, copy_gb_per_s=bytes_per_s / 1e9,
                  matmul_n=s.matmul_size, matmul_ms=matmul_ms, matmul_tflop_per_s=flop_per_s / 1e12)
    record["floor"] = workload_floor(preset(s.preset), workload, bytes_per_s=bytes_per_s, flop_per_s=flop_per_s,
                                     dtype_bytes=2 if s.dtype == "bfloat16" else 4)


def _cadence_options(s: Settings) -> dict:
    return dict(max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens)


def _make_runner(s: Settings, *, dtype: str, weights: Path | None = None, num_blocks: int | None = None,
                 max_num_seqs: int | None = None, fused_elementwise: bool | None = None,
                 balanced_decode_attention: bool = False) -> ModelRunner:
    if s.tp > 1:
        # Ranks 1..tp-1 are spawned on this machine; decode graphs are not used with tp > 1.
        from cadence.gpu import parallel
        spec = dict(model=str(weights) if weights is not None else s.preset, num_blocks=num_blocks,
                    block_size=16, device=s.device, dtype=dtype, attention_backend=s.attention_backend,
                    max_num_seqs=max_num_seqs or s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                    max_model_len=s.max_model_len, gpu_memory_utilization=s.gpu_memory_utilization,
                    use_cuda_graphs=False, seed=0)
        return parallel.start_local_runner(s.tp, spec, num_threads=1 if s.dry_run else None)
    # The CPU dry run stands in for the GPU: plain products (as on CUDA), so the weights
    # stay as parameters and the greedy stage can save them as a checkpoint.
    graphs = dict(use_cuda_graphs=True) if s.device == "cuda" else dict(pad_decode_batches=True, cpu_path="eager")
    options = dict(
        num_blocks=num_blocks, block_size=16, device=s.device, dtype=dtype, attention_backend=s.attention_backend,
        max_num_seqs=max_num_seqs or s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
        max_model_len=s.max_model_len, gpu_memory_utilization=s.gpu_memory_utilization, **graphs,
        fused_elementwise=fused_elementwise, balanced_decode_attention=balanced_decode_attention,
    )
    if weights is None:
        return ModelRunner(preset(s.preset), seed=0, **options)
    return ModelRunner.from_pretrained(weights, **options)


def _blocks_for(workload, block_size: int = 16) -> int:
    return sum(-(-(len(p) + o) // block_size) for p, o in zip(workload.prompts, workload.output_lens)) + 16


def _timed_run(runner: ModelRunner, workload, s: Settings, temperature: float = 0.0) -> dict:
    throughput.warm_up_cadence(runner, workload, temperature=temperature, **_cadence_options(s))
    return throughput.run_cadence(runner, workload, temperature=temperature, **_cadence_options(s))


def stage_cadence(record: dict, s: Settings, report: Report, workload, slice_workload, shared: dict) -> None:
    """The workload through Cadence with graphs on and off; saves the weights for the later stages."""
    start = time.perf_counter()
    runner = _make_runner(s, dtype=s.dtype, num_blocks=_blocks_for(workload) if s.device == "cpu" else None)
    if s.device == "cuda":
        runner.enable_gpu_timing()
    graphs = runner.decode_graphs
    record.update(init_s=time.perf_counter() - start, num_blocks=runner.num_blocks,
                  kv_cache_gib=runner.num_blocks * runner.kv_block_bytes() / 2**30, dtype=str(runner.dtype),
                  graph_batch_sizes=list(graphs.batch_sizes) if graphs else None,
                  graphs_captured=bool(graphs and graphs.captured),
                  fused_elementwise=runner.fused_elementwise)
    report.save()
    on = _timed_run(runner, workload, s)
    record["graphs_on"] = on["record"]
    print(json.dumps({"cadence_graphs_on": on["record"]}), flush=True)
    report.save()
    shared["cadence_run_outputs"] = {rid: on["outputs"][rid][: s.greedy_tokens]
                                      for rid in list(on["outputs"])[: s.greedy_requests]}
    shared["cadence_tokens_per_s"] = on["record"]["tokens_per_s"]
    floor = report.data["stages"].get("ceilings", {}).get("floor")
    if floor:
        record["graphs_on"]["fraction_of_floor"] = floor["floor_s"] / on["record"]["seconds"]
    sliced = _timed_run(runner, slice_workload, s)
    record["slice_graphs_on"] = sliced["record"]
    shared["cadence_slice_tokens_per_s"] = sliced["record"]["tokens_per_s"]
    report.save()
    if s.tp > 1:
        # A sharded model cannot be saved whole: the greedy and transformers stages skip.
        record["tp"] = s.tp
        runner.close()
        del runner, graphs
        free_memory(s.device)
        return
    if report.remaining_s() > 150 or s.dry_run:
        runner.decode_graphs = None
        off = _timed_run(runner, workload, s)
        runner.decode_graphs = graphs
        record["graphs_off"] = off["record"]
        record["graphs_speedup"] = on["record"]["tokens_per_s"] / off["record"]["tokens_per_s"]
        record["graphs_on_vs_off_outputs"] = throughput.compare_tokens(on["outputs"], off["outputs"])
        record["graphs_on_vs_off_outputs"]["first_differences"] = dict(
            list(record["graphs_on_vs_off_outputs"]["first_differences"].items())[:20])
        print(json.dumps({"cadence_graphs_off": off["record"]}), flush=True)
        report.save()
    else:
        record["graphs_off"] = "skipped: too little time left"
    checkpoint = Path(tempfile.mkdtemp(prefix="cadence-gpu-check-"))
    throughput.save_cadence_checkpoint(runner, checkpoint)
    shared["checkpoint"] = checkpoint
    del runner, graphs
    free_memory(s.device)


def stage_variant(record: dict, s: Settings, workload, shared: dict, **options) -> None:
    """The workload again with runner `options` (graphs on): throughput against the default
    run of the cadence stage, and greedy tokens against it."""
    if s.device != "cuda" or s.tp > 1:
        record["detail"] = "not run: needs one CUDA device (the CPU interpreter is far too slow)"
        return
    record["options"] = options
    runner = _make_runner(s, dtype=s.dtype, **options)
    variant = _timed_run(runner, workload, s)
    record["variant"] = variant["record"]
    default_rate = shared.get("cadence_tokens_per_s")
    if default_rate:
        record["variant_over_default"] = variant["record"]["tokens_per_s"] / default_rate
    reference = shared.get("cadence_run_outputs") or {}
    record["variant_vs_default_outputs"] = throughput.compare_tokens(
        {rid: variant["outputs"][rid][: s.greedy_tokens] for rid in reference}, reference)
    print(json.dumps({"cadence_variant": options, **variant["record"]}), flush=True)
    del runner
    free_memory(s.device)


# Runner options measured against the default graphs-on run, each a stage of its own.
VARIANTS = {
    "plain": dict(fused_elementwise=False),
    "balanced": dict(balanced_decode_attention=True),
    # The default again, last: how far the same run drifts between the first stage and the last.
    "default_again": dict(),
}


def stage_greedy(record: dict, s: Settings, workload, shared: dict) -> None:
    """Greedy tokens of Cadence float32 (graphs on and off) and bf16 against transformers float32."""
    checkpoint = shared["checkpoint"]
    sample = workload.head(s.greedy_requests).capped(s.greedy_tokens)
    runner = _make_runner(s, dtype="float32", weights=checkpoint, num_blocks=_blocks_for(sample),
                          max_num_seqs=max(16, s.greedy_requests))
    options = dict(max_num_seqs=max(16, s.greedy_requests), max_num_batched_tokens=s.max_num_batched_tokens)
    fp32_on = throughput.run_cadence(runner, sample, temperature=0.0, **options)["outputs"]
    graphs, runner.decode_graphs = runner.decode_graphs, None
    fp32_off = throughput.run_cadence(runner, sample, temperature=0.0, **options)["outputs"]
    runner.decode_graphs = graphs
    del runner, graphs
    free_memory(s.device)
    plain = {}
    if (s.device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1") and s.tp == 1:
        # torch's elementwise ops in place of the fused kernels, float32 and the run's dtype.
        for dtype in dict.fromkeys(("float32", s.dtype)):
            runner = _make_runner(s, dtype=dtype, weights=checkpoint, num_blocks=_blocks_for(sample),
                                  max_num_seqs=max(16, s.greedy_requests), fused_elementwise=False)
            plain[dtype] = throughput.run_cadence(runner, sample, temperature=0.0, **options)["outputs"]
            del runner
            free_memory(s.device)
    hf = throughput.load_hf(checkpoint, s.device, torch.float32)
    expected = throughput.hf_greedy_reference(hf, sample)
    del hf
    free_memory(s.device)
    record.update(
        compared=f"{s.greedy_requests} requests x {s.greedy_tokens} tokens, greedy; transformers float32 "
                 f"from the checkpoint Cadence saved",
        cadence_fp32_graphs_vs_hf_fp32=throughput.compare_tokens(fp32_on, expected),
        cadence_fp32_eager_vs_hf_fp32=throughput.compare_tokens(fp32_off, expected),
        cadence_fp32_graphs_vs_eager=throughput.compare_tokens(fp32_on, fp32_off),
        **{f"cadence_{'fp32' if dtype == 'float32' else 'run_dtype'}_plain_ops_vs_hf_fp32":
           throughput.compare_tokens(outputs, expected) for dtype, outputs in plain.items()},
    )
    run_outputs = shared.get("cadence_run_outputs")
    if run_outputs:
        record["cadence_run_dtype_vs_hf_fp32"] = throughput.compare_tokens(run_outputs, expected)
        record["run_dtype"] = s.dtype


def stage_hf(record: dict, s: Settings, report: Report, slice_workload, shared: dict) -> None:
    """transformers generate (and continuous batching, time permitting) on the slice, bf16."""
    hf = throughput.load_hf(shared["checkpoint"], s.device, torch.bfloat16 if s.device == "cuda" else torch.float32)
    cadence_rate = shared.get("cadence_slice_tokens_per_s")
    throughput.run_hf_generate(hf, slice_workload.head(2).capped(4), batch_size=2, temperature=0.0)  # warm-up
    generate = throughput.run_hf_generate(hf, slice_workload, batch_size=s.hf_slice, temperature=0.0)["record"]
    record["hf_generate"] = generate
    if cadence_rate:
        record["cadence_over_hf_generate"] = cadence_rate / generate["tokens_per_s"]
    print(json.dumps({"hf_generate": generate}), flush=True)
    report.save()
    if report.remaining_s() > 90:
        try:
            cb = throughput.run_hf_continuous(hf, slice_workload, temperature=0.0,
                                              timeout_s=min(120.0, report.remaining_s() - 60))
            record["hf_continuous"] = cb.get("record", cb)
            if cadence_rate and "record" in cb and cb["record"]["tokens_per_s"]:
                record["cadence_over_hf_continuous"] = cadence_rate / cb["record"]["tokens_per_s"]
        except Exception as error:  # optional engine: record why and go on
            record["hf_continuous"] = f"error: {type(error).__name__}: {error}"[:500]
    else:
        record["hf_continuous"] = "skipped: too little time left"
    del hf
    free_memory(s.device)


def stage_pytest(record: dict, s: Settings, report: Report) -> None:
    """The graph and balanced-decode tests of the suite (their GPU half runs only on a GPU)."""
    command = [sys.executable, "-m", "pytest", "tests/gpu/test_cuda_graphs.py",
               "tests/gpu/test_balanced_decode.py", "-q", "-x", "-p", "no:cacheprovider"]
    timeout = max(10.0, report.remaining_s() - 10)
    try:
        # The GPU machine has no use for the CPU kernels: no minute of compiling them first.
        env = {**os.environ, "CADENCE_PREBUILD_CPU_KERNELS": "0"}
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
        record.update(returncode=done.returncode, tail=(done.stdout + done.stderr)[-3000:])
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        record.update(returncode="timeout", tail=out[-3000:])
    print(record["tail"][-1500:], flush=True)
    if record["returncode"] != 0:
        raise RuntimeError(f"pytest ended with {record['returncode']}")


# --------------------------------------------------------------------------- summary


def summary_rows(data: dict) -> list[tuple[str, str, str]]:
    """(stage, status, key figures) per stage."""
    stages = data["stages"]
    rows = []

    def figures(name: str) -> str:
        r = stages.get(name, {})
        try:
            if name == "kernels":
                return f"{r.get('num_checks', 0) - r.get('num_checks_failed', 0)}/{r.get('num_checks', 0)} checks ok"
            if name == "ceilings":
                f = r["floor"]
                return (f"copy {r['copy_gb_per_s']:.0f} GB/s, bf16 {r['matmul_tflop_per_s']:.0f} TFLOP/s; "
                        f"floor {f['floor_s']:.2f} s = {f['ceiling_tokens_per_s']:.0f} tok/s "
                        f"(phased {f['phased_floor_s']:.2f} s)")
            if name == "cadence":
                on = r["graphs_on"]
                text = f"graphs on {on['tokens_per_s']:.0f} tok/s in {on['seconds']:.2f} s"
                if "gpu_idle_s" in on:
                    text += f" (GPU idle {on['gpu_idle_s']:.2f} s)"
                if isinstance(r.get("graphs_off"), dict):
                    off = r["graphs_off"]
                    text += f"; off {off['tokens_per_s']:.0f} tok/s"
                    if "gpu_idle_s" in off:
                        text += f" (idle {off['gpu_idle_s']:.2f} s)"
                return text
            if name in VARIANTS:
                if "variant" not in r:
                    return r.get("detail", "")
                same = r["variant_vs_default_outputs"]
                text = f"{r['variant']['tokens_per_s']:.0f} tok/s"
                if "variant_over_default" in r:
                    text += f" (x{r['variant_over_default']:.2f} of default)"
                return text + f"; greedy {same['num_identical']}/{same['num_compared']} identical"
            if name == "greedy":
                parts = []
                for key in ("cadence_fp32_graphs_vs_hf_fp32", "cadence_fp32_graphs_vs_eager",
                            "cadence_run_dtype_vs_hf_fp32", "cadence_fp32_plain_ops_vs_hf_fp32",
                            "cadence_run_dtype_plain_ops_vs_hf_fp32"):
                    if key in r:
                        same = f"{r[key]['num_identical']}/{r[key]['num_compared']}"
                        parts.append(f"{key.replace('cadence_', '')} {same}")
                return "; ".join(parts)
            if name == "hf":
                text = f"generate {r['hf_generate']['tokens_per_s']:.0f} tok/s"
                if "cadence_over_hf_generate" in r:
                    text += f", cadence x{r['cadence_over_hf_generate']:.2f}"
                cb = r.get("hf_continuous")
                if isinstance(cb, dict) and "tokens_per_s" in cb:
                    text += f"; continuous {cb['tokens_per_s']:.0f} tok/s"
                return text
            if name == "pytest":
                return r.get("tail", "").strip().splitlines()[-1] if r.get("tail") else ""
            if name == "env":
                return f"{r.get('device_name', 'cpu')} torch {r.get('torch')} triton {r.get('triton')}"
        except (KeyError, TypeError, IndexError, ZeroDivisionError):
            return r.get("error", r.get("reason", ""))[:100]
        return ""

    for name, r in stages.items():
        text = figures(name) if r.get("status") == "ok" else r.get("error", r.get("reason", ""))[:160]
        rows.append((name, r.get("status", "?"), text))
    return rows


def with_tp(s: Settings, tp: int) -> Settings:
    """The settings with `tp` ranks for the Cadence stage."""
    if tp < 1:
        raise SystemExit(f"--tp must be >= 1, got {tp}")
    return attrs.evolve(s, tp=tp)


def main(argv=None) -> int:
    """Run the stages and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny preset, a few requests")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="seconds after which no stage starts (each also needs an estimate of its own time)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu_check_out")
    parser.add_argument("--skip", default="", help="comma-separated stages to leave out")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks for the Cadence stage (one GPU each, on this machine)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry-run on a CPU")
    if args.dry_run:
        torch.set_num_threads(1)  # shared CPU cores: OpenMP spin-waits would dominate
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    s = with_tp(Settings.make(args.dry_run, args.budget_s), args.tp)
    report = Report(out / "gpu_check.json", args.budget_s)
    skip = set(filter(None, args.skip.split(",")))
    vocab = preset(s.preset).vocab_size
    workload = nano_workload.scaled(s.num_requests, s.max_input, s.max_output,
                                    max_token_id=min(vocab - 1, nano_workload.MAX_TOKEN_ID))
    slice_workload = workload.head(s.hf_slice).capped(s.hf_slice_max_output)
    report.data["workload"] = workload.summary()
    report.data["slice"] = slice_workload.summary()
    shared: dict = {}
    stages = [
        ("env", stage_env, 0, dict(s=s)),
        ("kernels", stage_kernels, 200, dict(s=s, report=report)),
        ("ceilings", stage_ceilings, 150, dict(s=s, workload=workload)),
        ("cadence", stage_cadence, 120, dict(s=s, report=report, workload=workload,
                                             slice_workload=slice_workload, shared=shared)),
        *((name, stage_variant, 60, dict(s=s, workload=workload, shared=shared, **options))
          for name, options in VARIANTS.items()),
        ("greedy", stage_greedy, 60, dict(s=s, workload=workload, shared=shared)),
        ("hf", stage_hf, 45, dict(s=s, report=report, slice_workload=slice_workload, shared=shared)),
        ("pytest", stage_pytest, 60, dict(s=s, report=report)),
    ]
    needs_checkpoint = {"greedy", "hf"}
    for name, fn, needs_s, kwargs in stages:
        if name in skip:
            report.data["stages"][name] = {"status": "skipped", "reason": "--skip"}
            continue
        if name in needs_checkpoint and "checkpoint" not in shared:
            report.data["stages"][name] = {"status": "skipped", "reason": "no checkpoint (the cadence stage failed, or ran with --tp > 1)"}
            continue
        report.run_stage(name, fn, needs_s=0 if args.dry_run else needs_s, **kwargs)
    if "checkpoint" in shared:
        shutil.rmtree(shared["checkpoint"], ignore_errors=True)
    report.data["summary"] = [dict(stage=a, status=b, figures=c) for a, b, c in summary_rows(report.data)]
    report.save()
    print(f"\nresults: {report.path} ({report.data['elapsed_s']:.0f} s)")
    for stage, status, text in summary_rows(report.data):
        print(f"{stage:<9} {status:<8} {text}")
    return 0 if all(r.get("status") in ("ok", "skipped") for r in report.data["stages"].values()) else 1


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # A library's generation thread left running must not hold the process open past the report.
    os._exit(exit_code)
