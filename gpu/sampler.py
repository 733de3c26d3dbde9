"""Pick the next token of every request in one batched pass over the logits.

Order of operations per row, as in Hugging Face generation: the token mask of
a structured output (a bitmask of the allowed tokens), stop tokens masked while
`min_tokens` is not reached (unless that would leave a constrained row no
token: the grammar wins), `allowed_token_ids`, `logit_bias` and `bad_words`
(vLLM's logits processors), penalties, temperature, top-k, top-p, min-p, then a
draw. Penalties follow the usual conventions: the repetition penalty
covers prompt and output tokens, presence and frequency penalties only output
tokens.

Draws use the exponential-race form of categorical sampling
(argmax(p / E), E ~ Exp(1)), so each row needs only its own noise. A row with a
seed draws its noise from a generator re-seeded from (seed, number of tokens
already generated): its samples depend on nothing else in the batch and survive
preemption. Logprobs are those of the raw model distribution (before
penalties, temperature and filters).
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from cadence.statemachine.sampling import SamplingParams

MASK64 = (1 << 64) - 1


@attrs.define(slots=True)
class SamplerOutput:
    """Sampled token per row, and per row either None or [(sampled, lp), (top1, lp1), ...]."""

    token_ids: list[int]
    logprobs: list[list[tuple[int, float]] | None]


def token_seed(seed: int, index: int) -> int:
    """A 64-bit generator seed for the `index`-th generated token of a request seeded `seed`."""
    x = (seed * 0x9E3779B97F4A7C15 + index + 1) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _token_table(rows: Sequence[Sequence[int]], vocab_size: int, device) -> torch.Tensor:
    """Count of each token per row, [N, vocab_size] float32."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width + 1), vocab_size, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    counts = torch.zeros(len(rows), vocab_size + 1, device=device)
    ids = ids.to(device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab_size]


def restricted(params: SamplingParams) -> bool:
    """Whether a row has allowed_token_ids, logit_bias or bad words to apply."""
    return bool(params.logit_bias or params.allowed_token_ids is not None or params.bad_words_token_ids)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Logits [N, V] with every token not allowed by `bitmask` set to -inf.

    bitmask: int32 [N, ceil(V / 32)] on the logits' device; bit t % 32 of word
    t // 32 allows token t (a row of all ones, -1, allows everything).
    """
    vocab_size = logits.shape[1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab_size].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """Penalised copy of logits [N, V]; penalty tensors are [N] float.

    A token seen in prompt or output has a positive logit divided by the
    repetition penalty, a negative one multiplied; each output occurrence
    subtracts `frequency_penalty`, any occurrence `presence_penalty` once.
    """
    vocab_size = logits.shape[1]
    output_counts = _token_table(output_token_ids, vocab_size, logits.device)
    seen = (_token_table(prompt_token_ids, vocab_size, logits.device) + output_counts) > 0
    rep = repetition_penalty[:, None]
    repeated = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, repeated, logits)
    return logits - frequency_penalty[:, None] * output_counts - presence_penalty[:, None] * (output_counts > 0)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Logits [N, V] with filtered-out tokens set to -inf; filters are [N] tensors.

    top_k 0 keeps all (ties with the k-th logit are kept); top-p keeps the
    smallest most-probable set whose probability reaches top_p (at least one
    token); min-p drops tokens less probable than min_p times the most probable.
    """
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size).long()
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p of 1 disables the filter; the threshold above 1 avoids rounding in the cumsum.
    threshold = torch.where(top_p < 1.0, top_p, 2.0)[:, None]
    drop = mass_before >= threshold
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    sorted_logits = sorted_logits.masked_fill(probs < min_p[:, None] * probs[:, :1], float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    """Samples one token per row of a logits batch, each row with its own parameters."""

    def __init__(self, eos_token_ids: Sequence[int] = (), seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = torch.device(device)
        self._generator = torch.Generator(self.device).manual_seed(seed)
        self._seeded = torch.Generator(self.device)

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        token_bitmask: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Sample from float32 logits [N, V]; row i uses params[i] and its token history.

        token_bitmask: the allowed tokens of each row (see `apply_token_bitmask`), on
        the CPU or the logits' device; None allows every token.
        """
        raw = logits
        if token_bitmask is not None:
            logits = apply_token_bitmask(logits, token_bitmask.to(logits.device, non_blocking=True))
            constrained = logits
        logits = self._mask_stop_tokens(logits, params, output_token_ids)
        if token_bitmask is not None and logits is not constrained:
            # min_tokens masked the only tokens the grammar allows (its end): the grammar wins.
            emptied = torch.isneginf(logits).all(dim=-1, keepdim=True)
            logits = torch.where(emptied, constrained, logits)
        logits = self._restrict(logits, params, output_token_ids)
        logits = self._penalise(logits, params, prompt_token_ids, output_token_ids)
        tokens = logits.argmax(dim=-1)
        if not all(p.greedy for p in params):
            greedy = torch.tensor([p.greedy for p in params], device=logits.device)
            tokens = torch.where(greedy, tokens, self._draw(logits, params, output_token_ids))
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, self._logprobs(raw, params, token_ids))

    def _mask_stop_tokens(self, logits, params, output_token_ids) -> torch.Tensor:
        rows, cols = [], []
        for i, (p, out) in enumerate(zip(params, output_token_ids)):
            if len(out) < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                rows += [i] * len(stops)
                cols += sorted(stops)
        if not rows:
            return logits
        logits = logits.clone()
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
        return logits

    def _restrict(self, logits, params, output_token_ids) -> torch.Tensor:
        """Rows with allowed_token_ids keep only those; logit_bias is added; a bad
        word's last token is banned where the output ends with the rest of it."""
        rows = [i for i, p in enumerate(params) if restricted(p)]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            p, row = params[i], logits[i]
            if p.allowed_token_ids is not None:
                keep = torch.full_like(row, float("-inf"))
                allowed = torch.tensor(p.allowed_token_ids, device=row.device)
                keep[allowed] = row[allowed]
                row = logits[i] = keep
            if p.logit_bias:
                tokens = torch.tensor([token for token, _ in p.logit_bias], device=row.device)
                row[tokens] += torch.tensor([bias for _, bias in p.logit_bias], device=row.device,
                                            dtype=row.dtype)
            output = output_token_ids[i]
            for word in p.bad_words_token_ids:
                prefix = word[:-1]
                if not prefix or (len(output) >= len(prefix)
                                  and list(output[len(output) - len(prefix):]) == list(prefix)):
                    row[word[-1]] = float("-inf")
        return logits

    def _penalise(self, logits, params, prompt_token_ids, output_token_ids) -> torch.Tensor:
        rows = [
            i for i, p in enumerate(params)
            if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        ]
        if not rows:
            return logits
        index = torch.tensor(rows, device=logits.device)

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(params[i], name) for i in rows], device=logits.device)

        penalised = apply_penalties(
            logits[index],
            [prompt_token_ids[i] for i in rows],
            [output_token_ids[i] for i in rows],
            column("repetition_penalty"),
            column("presence_penalty"),
            column("frequency_penalty"),
        )
        logits = logits.clone()
        logits[index] = penalised
        return logits

    def _draw(self, logits, params, output_token_ids) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
        logits = logits / temperature[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            logits = apply_top_k_top_p_min_p(
                logits,
                torch.tensor([p.top_k for p in params], device=device),
                torch.tensor([p.top_p for p in params], device=device),
                torch.tensor([p.min_p for p in params], device=device),
            )
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self._generator)
        for i, p in enumerate(params):
            if p.seed is not None and not p.greedy:
                self._seeded.manual_seed(token_seed(p.seed, len(output_token_ids[i])))
                noise[i].exponential_(generator=self._seeded)
        # An exact zero draw would turn 0/0 into NaN, which argmax prefers.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)

    def _logprobs(self, raw, params, token_ids) -> list[list[tuple[int, float]] | None]:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list[list[tuple[int, float]] | None] = [None] * len(params)
        if not rows:
            return result
        num_top = max(params[i].logprobs for i in rows)
        index = torch.tensor(rows, device=raw.device)
        logprobs = raw[index].float().log_softmax(dim=-1)
        sampled = torch.tensor([token_ids[i] for i in rows], device=raw.device)
        sampled_lp = logprobs.gather(1, sampled[:, None])[:, 0].tolist()
        top_lp, top_ids = logprobs.topk(num_top, dim=-1)
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
        for j, i in enumerate(rows):
            n = params[i].logprobs
            result[i] = [(token_ids[i], sampled_lp[j])] + list(zip(top_ids[j][:n], top_lp[j][:n]))
        return result
