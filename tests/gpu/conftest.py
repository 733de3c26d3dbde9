"""Shared fixtures for the executor tests: tiny Hugging Face checkpoints and a hand-driven plan builder."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch

from cadence.gpu.runner import ModelRunner
from cadence.statemachine.plan import NewRequestData, StepPlan, StepResult
from cadence.statemachine.sampling import SamplingParams

VOCAB_SIZE = 256
TINY = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
# One checkpoint per switch of the model family.
KINDS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64),
    )),
    "linear-rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
    )),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=1)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=4)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, rope_parameters=dict(
        rope_type="default", rope_theta=1_000_000.0))),
}


def build_hf_model(kind: str, seed: int = 0):
    """A random-weight float32 transformers model of `kind`, every parameter (biases, norms) non-trivial."""
    import transformers

    config_class, model_class, extra = KINDS[kind]
    config = getattr(transformers, config_class)(**{**TINY, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    model.config._attn_implementation = "eager"
    return model


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """kind -> (checkpoint directory, the transformers model saved there); built once per kind."""
    cache: dict[str, tuple[Path, object]] = {}

    def get(kind: str):
        if kind not in cache:
            model = build_hf_model(kind)
            directory = tmp_path_factory.mktemp(kind)
            model.save_pretrained(directory)
            cache[kind] = (directory, model)
        return cache[kind]

    return get


@torch.no_grad()
def hf_greedy(model, prompt: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation by full recomputation, and the log-softmax at each generated step."""
    tokens = list(prompt)
    logprobs = []
    for _ in range(num_tokens):
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
        logprobs.append(logits.log_softmax(-1))
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):], logprobs


def random_prompts(lengths, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> list[list[int]]:
    """Prompts of the given lengths, token ids drawn from [3, vocab_size)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


@attrs.define
class DrivenRequest:
    """A request as the test scheduler tracks it."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    tokens: list[int]
    num_computed_tokens: int = 0
    block_ids: list[int] = attrs.Factory(list)
    outputs: list[int] = attrs.Factory(list)
    logprobs: list[list[tuple[int, float]]] = attrs.Factory(list)
    cached_prefix: tuple[list[int], int] | None = None
    resumed: bool = False


class PlanDriver:
    """A minimal scheduler for tests: FCFS under a token budget, LIFO block reuse, prefix sharing, preemption.

    It builds each `StepPlan` by hand, checks that the runner samples exactly
    for the requests that reached the end of their tokens, and finishes a
    request after `max_tokens` outputs.
    """

    def __init__(self, runner: ModelRunner, token_budget: int = 1024) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.token_budget = token_budget
        self.free_blocks = list(range(runner.num_blocks))[::-1]
        self.refcount: dict[int, int] = {}
        self.requests: dict[str, DrivenRequest] = {}
        self.waiting: list[DrivenRequest] = []
        self.running: list[DrivenRequest] = []
        self.step_id = 0
        self.finished_ids: list[str] = []
        self.preempted_ids: list[str] = []
        self.plans: list[StepPlan] = []

    def add(self, request_id: str, prompt: list[int], params: SamplingParams,
            share_prefix_of: str | None = None, num_cached_tokens: int = 0) -> None:
        """Queue a request; with `share_prefix_of`, its first tokens are prefix-cache hits on that request's blocks."""
        request = DrivenRequest(request_id, list(prompt), params, list(prompt))
        if share_prefix_of is not None:
            owner = self.requests[share_prefix_of]
            assert num_cached_tokens % self.block_size == 0
            assert owner.num_computed_tokens >= num_cached_tokens
            assert owner.tokens[:num_cached_tokens] == prompt[:num_cached_tokens]
            request.cached_prefix = (owner.block_ids[: num_cached_tokens // self.block_size], num_cached_tokens)
        self.requests[request_id] = request
        self.waiting.append(request)

    def preempt(self, request_id: str) -> None:
        """Drop a running request's blocks; it recomputes from scratch when readmitted."""
        request = self.requests[request_id]
        self.running.remove(request)
        self._free(request)
        request.num_computed_tokens = 0
        request.resumed = True
        request.cached_prefix = None
        self.preempted_ids.append(request_id)
        self.waiting.insert(0, request)

    def step(self) -> StepResult:
        """Schedule, execute one plan, and apply its result."""
        budget = self.token_budget
        scheduled: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        new_requests: list[NewRequestData] = []
        for request in self.running:
            n = min(len(request.tokens) - request.num_computed_tokens, budget)
            if n == 0:
                continue
            delta = self._allocate(request, request.num_computed_tokens + n)
            if delta:
                new_block_ids[request.request_id] = delta
            scheduled[request.request_id] = n
            budget -= n
        while self.waiting and budget > 0:
            request = self.waiting.pop(0)
            if request.cached_prefix is not None:
                blocks, num_cached = request.cached_prefix
                for block in blocks:
                    self.refcount[block] += 1
                request.block_ids = list(blocks)
                request.num_computed_tokens = num_cached
            n = min(len(request.tokens) - request.num_computed_tokens, budget)
            self._allocate(request, request.num_computed_tokens + n)
            new_requests.append(NewRequestData(
                request.request_id, list(request.tokens), len(request.prompt),
                list(request.block_ids), request.num_computed_tokens, request.resumed,
            ))
            scheduled[request.request_id] = n
            budget -= n
            self.running.append(request)
        plan = StepPlan(
            step_id=self.step_id,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            new_requests=new_requests,
            new_block_ids=new_block_ids,
            preempted_ids=self.preempted_ids,
            finished_ids=self.finished_ids,
            resumed_ids=[r.request_id for r in new_requests if r.resumed],
        )
        self.plans.append(plan)
        self.step_id += 1
        self.finished_ids, self.preempted_ids = [], []
        result = self.runner.execute(plan, {r.request_id: self.requests[r.request_id].params for r in new_requests})
        expected = set()
        for request_id, n in scheduled.items():
            request = self.requests[request_id]
            request.num_computed_tokens += n
            if request.num_computed_tokens == len(request.tokens):
                expected.add(request_id)
        assert set(result.sampled_token_ids) == expected
        for request_id, tokens in result.sampled_token_ids.items():
            request = self.requests[request_id]
            request.tokens += tokens
            request.outputs += tokens
            if result.logprobs and request_id in result.logprobs:
                request.logprobs += result.logprobs[request_id]
            if len(request.outputs) >= request.params.max_tokens:
                self.running.remove(request)
                self._free(request)
                self.finished_ids.append(request_id)
        return result

    def run(self, max_steps: int = 1000) -> dict[str, list[int]]:
        """Step until every request has finished; outputs per request."""
        for _ in range(max_steps):
            if not self.waiting and not self.running:
                return {rid: r.outputs for rid, r in self.requests.items()}
            self.step()
        raise AssertionError("requests did not finish")

    def _allocate(self, request: DrivenRequest, num_tokens: int) -> list[int]:
        needed = -(-num_tokens // self.block_size) - len(request.block_ids)
        assert needed <= len(self.free_blocks), "test sized too small: out of KV blocks"
        delta = [self.free_blocks.pop() for _ in range(max(needed, 0))]
        for block in delta:
            self.refcount[block] = 1
        request.block_ids += delta
        return delta

    def _free(self, request: DrivenRequest) -> None:
        for block in request.block_ids:
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self.free_blocks.append(block)
        request.block_ids = []


@pytest.fixture
def plan_driver():
    """Factory: PlanDriver(runner, token_budget)."""
    return PlanDriver
