"""How many threads torch's CPU kernels may use while a runner computes.

torch splits each matrix product and elementwise kernel across an OpenMP team
whose threads spin at every barrier. When the model's products are small, or
other processes want the same cores, a team member waiting for a core stalls
every kernel of the step: on a 2-core machine shared with two busy processes a
decode step of a small model took 30-100 times longer with 2 threads than with
1. So the runner sets its own count before its first kernel, in the thread that
runs the model, instead of inheriting torch's default (every core).

The "auto" policy: 1 thread for models whose per-token work is too small to
split profitably, else half the cores this process may run on, so that a few
competing processes still leave every team member a core.
"""

from __future__ import annotations

import os

import torch

from cadence.statemachine.errors import ConfigError

from .config import ModelConfig

AUTO = "auto"
# Multiply-adds per generated token under which one thread runs a step fastest:
# a product of that model takes tens of microseconds, the order of a team's
# start-up and barrier cost.
SMALL_MODEL_MACS = 50_000_000
# Share of the usable cores the auto policy takes for larger models.
CORE_SHARE = 2


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def macs_per_token(config: ModelConfig) -> int:
    """Multiply-adds of the weight products for one token: projections, MLP and the output head."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    attention = config.hidden_size * (2 * q_size + 2 * kv_size)
    mlp = 3 * config.hidden_size * config.intermediate_size
    return config.num_layers * (attention + mlp) + config.hidden_size * config.vocab_size


def auto_num_threads(config: ModelConfig, num_cores: int) -> int:
    """The "auto" policy's thread count for `config` on `num_cores` usable cores."""
    if macs_per_token(config) < SMALL_MODEL_MACS:
        return 1
    return max(1, num_cores // CORE_SHARE)


def resolve_num_threads(value: int | str | None, config: ModelConfig, device: torch.device) -> int | None:
    """The thread count to set for `value` ("auto", an int >= 1, or None to leave torch's own).

    On an accelerator the host threads only launch kernels, so "auto" leaves them alone there.
    """
    if value is None:
        return None
    if value == AUTO:
        return auto_num_threads(config, usable_cores()) if device.type == "cpu" else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"num_threads must be 'auto' or an integer >= 1, got {value!r}")
    return value


def set_num_threads(num_threads: int | None) -> None:
    """Set torch's intra-op thread count from the calling thread (None: leave it).

    torch keeps one count per thread, taken from a process-wide default when a
    thread runs its first kernel: the calling thread and threads that have not
    yet run one get `num_threads`; threads that already have keep theirs. The
    inter-op pool is left alone: the runner starts no inter-op work.
    """
    if num_threads is not None and torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
