"""A model of vLLM V1's scheduling rules, replayed on Cadence's workload traces.

This is not vLLM: it is a small re-implementation, written for this project, of
the rules by which vLLM's V1 scheduler (v0.10/v0.11, FCFS or priority policy,
chunked prefill on, no speculative decoding, no KV connector) picks the tokens of each
step and manages its paged KV cache. It lets us estimate what vLLM's scheduler
does on our traces (steps, preemptions, recomputation) without a GPU.

Rules modelled (checked against vllm/v1/core/sched/scheduler.py `schedule()`,
vllm/v1/core/kv_cache_manager.py `get_computed_blocks()` / `allocate_slots()`,
single_type_kv_cache_manager.py and block_pool.py of v0.11.0):

* Token budget `max_num_batched_tokens` per step. Running requests first, in
  list order: each gets min(tokens not yet computed, budget) (chunked prefill,
  long_prefill_token_threshold 0), capped so the position stays below
  max_model_len.
* Slots are allocated for the tokens scheduled now only. When that fails, the
  LAST request of the running list is preempted (FCFS: the latest admitted):
  its blocks are freed, num_computed_tokens drops to 0 (recompute) and it goes
  to the FRONT of the waiting queue; then allocation is retried. If the request
  being scheduled is itself the one preempted, the running pass stops.
* Waiting requests are only looked at when nothing was preempted this step,
  while budget remains and fewer than max_num_seqs are running. Each gets a
  prefix-cache lookup (full blocks only, at most num_tokens - 1 tokens, so one
  token is always computed), then slots for the hit blocks plus the chunk
  scheduled now (never the whole prompt up front). No watermark: the check is
  `blocks needed (counting hit blocks that sit in the free queue) <= free
  blocks`. The first request that does not fit stops admission (head of line).
* The block pool holds num_gpu_blocks blocks, one of which is the reserved null
  block. Free blocks form an LRU queue; allocation pops from its head and drops
  the popped block's cached hash. A request's blocks are freed in reverse order
  (tail blocks evicted first). With prefix caching, every block that becomes
  full (prompt or generated tokens) is registered under a chained hash of its
  tokens right when its tokens are scheduled; identical blocks are not
  de-duplicated. Hits may come from blocks in use or in the free queue, for new
  and for preempted (resuming) requests alike.
* A request whose known tokens are not all computed after a step (a partial
  prefill) gets no sampled token.
* Priority policy (`--policy priority`): the waiting queue is a heap ordered by
  (priority, arrival time), lower first; a preempted request goes back into
  that heap rather than to the front. When a running request's allocation
  fails, the victim is the running request with the largest (priority, arrival
  time), wherever it sits in the running list; if it was already scheduled in
  this step its tokens go back to the budget. The running pass walks the list
  by index, so removing an earlier entry shifts the rest (as vLLM's loop does).
  Trace arrivals share steps, so arrival time is (arrival_step, id).
* vLLM's admission never reads max_tokens: the `--max-tokens generous` mode
  (declared limit max_model_len - prompt, EOS at the real length) schedules
  exactly as `exact` does; the flag exists so both benchmarks report both modes.

The driver is the one of benchmarks/scheduler_overhead.py `replay()`: requests
join at their arrival step; after each step every scheduled request whose known
tokens are all computed gets its next trace token; a request finishes after
exactly output_len tokens (EOS ignored); when nothing is live the step counter
jumps to the next arrival.

    python benchmarks/vllm_model.py                       # every preset
    python benchmarks/vllm_model.py --preset nano --no-prefix-caching
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import statistics
import sys
from collections import OrderedDict, deque

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import PRESETS, engine_config, generate, output_token, prompt_tokens  # noqa: E402


POLICIES = ("fcfs", "priority")
MAX_TOKENS_MODES = ("exact", "generous")


def _order(req: "Req") -> tuple:
    return req.order


def wait_figures(waits: list[tuple[int, int]]) -> dict:
    """Median, p99 and longest wait (steps from arrival to first admission), the
    median wait of priority-0 requests, and the longest wait of the lowest
    priority (the largest value: on the `starve` preset, its victim's wait), from
    (priority, wait) pairs."""
    all_waits = sorted(w for _, w in waits)
    high = [w for p, w in waits if p == 0]
    lowest = max(p for p, _ in waits)
    return {"median_wait": statistics.median(all_waits),
            "p99_wait": all_waits[int(0.99 * (len(all_waits) - 1))],
            "max_wait": all_waits[-1],
            "median_wait_priority0": statistics.median(high) if high else None,
            "max_wait_lowest_priority": max(w for p, w in waits if p == lowest)}


class Req:
    """One request's scheduling state (the fields vLLM's Request keeps that matter here)."""

    __slots__ = ("rid", "rec", "tokens", "num_tokens", "output_len", "num_output", "num_computed",
                 "blocks", "num_cached_blocks", "hashes", "preempted", "num_preemptions",
                 "order", "first_step")

    def __init__(self, rid: int, rec: dict, tokens: list[int] | None):
        self.rid = rid
        self.rec = rec
        self.tokens = tokens                  # prompt + generated ids; None without prefix caching
        self.num_tokens = rec["prompt_len"]   # prompt + generated so far
        self.output_len = rec["output_len"]
        self.num_output = 0
        self.num_computed = 0
        self.blocks: list[int] = []
        self.num_cached_blocks = 0            # leading blocks already registered in the cache
        self.hashes: list[int] = []           # chained keys of this request's full blocks
        self.preempted = False                # in the waiting queue after a preemption
        self.num_preemptions = 0
        # Priority order: (priority, arrival), lower first; the largest is the victim.
        self.order = (rec["priority"], rec["arrival_step"], rid)
        self.first_step: int | None = None    # the step of its first admission

    def __lt__(self, other: "Req") -> bool:
        return self.order < other.order


class BlockPool:
    """Paged KV blocks: reference counts, an LRU free queue, a hash -> blocks map."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self.ref = [0] * num_blocks
        self.key: list[int | None] = [None] * num_blocks
        # Block 0 is vLLM's null block: never handed out.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.cached: dict[int, list[int]] = {}   # chained key -> blocks holding it, oldest first
        self.intern: dict[tuple, int] = {}        # (parent key, block tokens) -> key
        self.max_in_use = 0

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    def in_use(self) -> int:
        return self.usable - len(self.free)

    def take(self, n: int) -> list[int]:
        """Pop n blocks from the head of the free queue, evicting their cached hashes."""
        free, ref, key, cached = self.free, self.ref, self.key, self.cached
        out = []
        for _ in range(n):
            b = free.popitem(last=False)[0]
            k = key[b]
            if k is not None:
                holders = cached[k]
                holders.remove(b)
                if not holders:
                    del cached[k]
                key[b] = None
            ref[b] = 1
            out.append(b)
        used = self.usable - len(free)
        if used > self.max_in_use:
            self.max_in_use = used
        return out

    def touch(self, hits: list[int]) -> None:
        free, ref = self.free, self.ref
        for b in hits:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1
        used = self.usable - len(free)
        if used > self.max_in_use:
            self.max_in_use = used

    def release(self, blocks: list[int]) -> None:
        """Free a request's blocks, tail first, so the tail is evicted first."""
        free, ref = self.free, self.ref
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None

    def hashes_upto(self, req: Req, n: int) -> list[int]:
        """The request's chained block keys for its first n full blocks."""
        hs = req.hashes
        if len(hs) < n:
            bs, toks, intern = self.block_size, req.tokens, self.intern
            parent = hs[-1] if hs else -1
            for i in range(len(hs), n):
                k = (parent, tuple(toks[i * bs:(i + 1) * bs]))
                parent = intern.get(k)
                if parent is None:
                    parent = intern[k] = len(intern)
                hs.append(parent)
        return hs

    def lookup(self, req: Req) -> list[int]:
        """Longest run of cached full blocks, leaving at least one token to compute."""
        n = (req.num_tokens - 1) // self.block_size
        if n <= 0:
            return []
        cached = self.cached
        hits = []
        for k in self.hashes_upto(req, n)[:n]:
            holders = cached.get(k)
            if holders is None:
                break
            hits.append(holders[0])
        return hits

    def register(self, req: Req, num_tokens: int) -> None:
        """Cache the request's blocks that are full once num_tokens are computed."""
        full = num_tokens // self.block_size
        start = req.num_cached_blocks
        if full <= start:
            return
        hs = self.hashes_upto(req, full)
        key, cached, blocks = self.key, self.cached, req.blocks
        for i in range(start, full):
            b, k = blocks[i], hs[i]
            key[b] = k
            holders = cached.get(k)
            if holders is None:
                cached[k] = [b]
            else:
                holders.append(b)
        req.num_cached_blocks = full


class VllmModel:
    """The scheduler: running list, waiting queue (FCFS deque or priority heap), block pool."""

    def __init__(self, engine: dict, prefix_caching: bool = True, policy: str = "fcfs"):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.priority = policy == "priority"
        self.max_num_seqs = engine["max_num_seqs"]
        self.max_batched = engine["max_num_batched_tokens"]
        self.max_model_len = engine["max_model_len"]
        self.bs = engine["block_size"]
        if not engine.get("chunked_prefill", True):
            raise ValueError("only chunked prefill is modelled")
        self.caching = prefix_caching
        self.pool = BlockPool(engine["num_gpu_blocks"], self.bs, prefix_caching)
        self.running: list[Req] = []
        self.waiting: deque[Req] = deque()
        self.heap: list[Req] = []  # the waiting queue under the priority policy
        self.num_preemptions = 0
        self.num_recompute_tokens = 0
        self.num_prefix_hit_tokens = 0     # hits on first admission
        self.num_resume_hit_tokens = 0     # hits on admission after a preemption
        self.num_scheduled_tokens = 0

    def add(self, req: Req) -> None:
        if self.priority:
            heapq.heappush(self.heap, req)
        else:
            self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.heap)

    def num_waiting(self) -> int:
        return len(self.heap) if self.priority else len(self.waiting)

    def _allocate(self, req: Req, n: int, hits: list[int]) -> bool:
        """vLLM's allocate_slots: room for the hit blocks plus n new tokens, or None."""
        pool = self.pool
        bs = self.bs
        computed = req.num_computed + len(hits) * bs
        need_slots = min(computed + n, self.max_model_len)
        have = len(req.blocks) + len(hits)
        new = -(-need_slots // bs) - have
        revived = 0
        if hits:
            ref = pool.ref
            for b in hits:
                if ref[b] == 0:
                    revived += 1
        if new + revived > len(pool.free):
            return False
        if not req.blocks:
            # New to the cache manager (admitted or resumed): its hit blocks are
            # already registered, the rest are not.
            req.num_cached_blocks = len(hits)
        if hits:
            pool.touch(hits)
            req.blocks.extend(hits)
        if new > 0:
            req.blocks.extend(pool.take(new))
        if self.caching:
            pool.register(req, min(computed + n, req.num_tokens))
        return True

    def _preempt(self, victim: Req) -> None:
        self.pool.release(victim.blocks)
        victim.blocks = []
        victim.num_cached_blocks = 0
        self.num_preemptions += 1
        self.num_recompute_tokens += victim.num_computed
        victim.num_computed = 0
        victim.preempted = True
        victim.num_preemptions += 1
        if self.priority:
            heapq.heappush(self.heap, victim)
        else:
            self.waiting.appendleft(victim)

    def schedule(self) -> dict[Req, int]:
        """One step's plan: request -> tokens; advances num_computed like vLLM does."""
        budget = self.max_batched
        scheduled: dict[Req, int] = {}
        running = self.running
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed, budget,
                    self.max_model_len - 1 - req.num_computed)
            if n <= 0:
                i += 1
                continue
            ok = True
            while not self._allocate(req, n, []):
                if self.priority:
                    victim = max(running, key=_order)
                    running.remove(victim)
                    budget += scheduled.pop(victim, 0)
                else:
                    victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    ok = False
                    break
            if not ok:
                break
            scheduled[req] = n
            budget -= n
            i += 1
        if not preempted:
            waiting = self.heap if self.priority else self.waiting
            while waiting and budget > 0 and len(running) < self.max_num_seqs:
                req = waiting[0]
                hits = self.pool.lookup(req) if self.caching and req.num_computed == 0 else []
                num_hit = len(hits) * self.bs
                n = min(req.num_tokens - req.num_computed - num_hit, budget)
                if not self._allocate(req, n, hits):
                    break
                if self.priority:
                    heapq.heappop(waiting)
                else:
                    waiting.popleft()
                running.append(req)
                req.num_computed += num_hit
                if req.preempted:
                    self.num_resume_hit_tokens += num_hit
                    req.preempted = False
                else:
                    self.num_prefix_hit_tokens += num_hit
                scheduled[req] = n
                budget -= n
        for req, n in scheduled.items():
            req.num_computed += n
            self.num_scheduled_tokens += n
        return scheduled

    def finish(self, req: Req) -> None:
        self.pool.release(req.blocks)
        req.blocks = []
        self.running.remove(req)

    def check(self) -> None:
        """Block accounting: reference counts match holders; free queue and in-use are disjoint."""
        pool = self.pool
        counts = [0] * pool.num_blocks
        for req in self.running:
            assert len(set(req.blocks)) == len(req.blocks), f"request {req.rid} holds a block twice"
            assert len(req.blocks) * self.bs >= req.num_computed
            for b in req.blocks:
                counts[b] += 1
        for req in (*self.waiting, *self.heap):
            assert not req.blocks
        assert counts[0] == 0, "null block handed out"
        for b in range(1, pool.num_blocks):
            assert counts[b] == pool.ref[b], f"block {b}: ref {pool.ref[b]} held by {counts[b]}"
            assert (b in pool.free) == (counts[b] == 0), f"block {b} free-queue membership wrong"
        assert pool.in_use() <= pool.usable
        for k, holders in pool.cached.items():
            for b in holders:
                assert pool.key[b] == k


def replay(records: list[dict], engine: dict, prefix_caching: bool = True, check: bool = False,
           policy: str = "fcfs", on_plan=None) -> dict:
    """Run one trace through the model with scheduler_overhead.replay()'s driver rules;
    `on_plan`, if given, is called with each step's {request id: tokens} that schedules any."""
    model = VllmModel(engine, prefix_caching, policy)
    pending = []
    for r in records:
        toks = prompt_tokens(r) if prefix_caching else None
        pending.append((r["arrival_step"], Req(r["id"], r, toks)))
    admitted = list(pending)
    pending.reverse()
    step = 0
    steps = 0
    max_batch = 0
    finished: dict = {}
    running = model.running
    while pending or model.has_work():
        if not model.has_work() and pending and pending[-1][0] > step:
            step = pending[-1][0]
        while pending and pending[-1][0] <= step:
            model.add(pending.pop()[1])
        plan = model.schedule()
        if on_plan is not None and plan:
            on_plan({str(req.rid): n for req, n in plan.items()})
        for req in plan:
            if req.first_step is None:
                req.first_step = step
        done = []
        for req in plan:
            if req.num_computed == req.num_tokens:
                if req.tokens is not None:
                    req.tokens.append(output_token(req.rec, req.num_output))
                req.num_output += 1
                req.num_tokens += 1
                if req.num_output >= req.output_len or req.num_tokens >= model.max_model_len:
                    done.append(req)
        for req in done:
            finished[req.rid] = req.num_output
            model.finish(req)
        if check:
            model.check()
        if plan:
            steps += 1
            max_batch = max(max_batch, len(plan))
        elif not running and model.num_waiting() and not pending:
            raise RuntimeError("stuck: the head waiting request can never fit the KV cache")
        step += 1
    wrong = [r["id"] for r in records if finished.get(r["id"]) != r["output_len"]]
    waits = wait_figures([(req.rec["priority"], req.first_step - req.rec["arrival_step"])
                          for _, req in admitted])
    prompt_total = sum(r["prompt_len"] for r in records)
    output_total = sum(r["output_len"] for r in records)
    return {
        "steps": steps,
        "logical_steps": step,
        "tokens_scheduled": model.num_scheduled_tokens,
        "tokens_over_prompt_plus_output": round(model.num_scheduled_tokens / (prompt_total + output_total), 4),
        "preemptions": model.num_preemptions,
        "recompute_tokens": model.num_recompute_tokens,
        "prefix_hit_tokens": model.num_prefix_hit_tokens,
        "resume_hit_tokens": model.num_resume_hit_tokens,
        "max_blocks_in_use": model.pool.max_in_use,
        "max_batch": max_batch,
        **waits,
        "finished_ok": not wrong,
        "num_wrong": len(wrong),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", choices=sorted(PRESETS))
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--policy", default="fcfs", choices=POLICIES)
    ap.add_argument("--max-tokens", default="exact", choices=MAX_TOKENS_MODES,
                    help="declared max_tokens: exact, or generous (max_model_len - prompt, EOS "
                         "at the real length); vLLM's admission reads neither")
    args = ap.parse_args(argv)
    for name in args.preset or list(PRESETS):
        out = replay(generate(name), engine_config(name), not args.no_prefix_caching,
                     policy=args.policy)
        print(json.dumps({"bench": "vllm_model", "preset": name, "policy": args.policy,
                          "max_tokens": args.max_tokens,
                          "prefix_caching": not args.no_prefix_caching, **out}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
