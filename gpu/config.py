"""Model shape and features, read from a Hugging Face config.json or a preset.

One `ModelConfig` describes every supported member of the Llama family; the
switches (`qkv_bias`, `qk_norm`, `tie_word_embeddings`, rope scaling) are what
tell Llama 2/3, Mistral, Qwen2 and Qwen3 apart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import attrs

from cadence.statemachine.errors import ConfigError

from .errors import CheckpointError, CheckpointFileNotFoundError, UnsupportedArchitectureError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


def _positive(instance, attribute, value) -> None:
    if value <= 0:
        raise ConfigError(f"{attribute.name} must be > 0, got {value!r}")


@attrs.frozen
class RopeScaling:
    """How rotary frequencies are rescaled for long context.

    rope_type "linear" divides every frequency by `factor`; "llama3" divides low
    frequencies by `factor`, keeps high ones, and blends in between.
    """

    rope_type: str = attrs.field(validator=attrs.validators.in_(ROPE_TYPES[1:]))
    factor: float = attrs.field(default=1.0, validator=_positive)
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@attrs.frozen
class ModelConfig:
    """The shape and feature switches of one Llama-family decoder.

    architecture: the Hugging Face `model_type` (llama, mistral, qwen2, qwen3).
    qkv_bias / o_bias / mlp_bias: whether those projections carry a bias.
    qk_norm: RMSNorm over each head of q and k before rotary (Qwen3).
    sliding_window: attention window of the checkpoint, if any; `max_model_len`
      is capped to it, since within the window full attention is exact.
    eos_token_ids: from config.json and generation_config.json, merged.
    """

    architecture: str = attrs.field(validator=attrs.validators.in_(SUPPORTED_MODEL_TYPES))
    vocab_size: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    num_layers: int = attrs.field(validator=_positive)
    num_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    rms_norm_eps: float = attrs.field(default=1e-6, validator=_positive)
    rope_theta: float = attrs.field(default=10000.0, validator=_positive)
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = attrs.field(default=4096, validator=_positive)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    dtype: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def max_model_len(self) -> int:
        """Longest sequence this model computes exactly."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    def kv_bytes_per_token(self, element_size: int, num_kv_heads: int | None = None) -> int:
        """Bytes one token's keys and values take across all layers, at `element_size`
        bytes an element, for `num_kv_heads` KV heads (default: all of them; a tensor-
        parallel rank holds its share)."""
        heads = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        return 2 * self.num_layers * heads * self.head_dim * element_size

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], source: str = CONFIG_FILE) -> ModelConfig:
        """Build from a parsed Hugging Face config.json; `source` names it in errors."""
        model_type = _model_type(hf, source)
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedArchitectureError(
                f"{source}: hidden_act {hf['hidden_act']!r} is not supported (only 'silu')"
            )
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden_size = int(hf["hidden_size"])
            rope_theta, rope_scaling = _rope(hf, source)
            return cls(
                architecture=model_type,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
                o_bias=model_type in ("llama", "mistral") and bool(hf.get("attention_bias", False)),
                mlp_bias=bool(hf.get("mlp_bias", False)),
                qk_norm=model_type == "qwen3",
                sliding_window=_sliding_window(hf, model_type),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=_token_ids(hf.get("eos_token_id")),
                dtype=hf.get("dtype") or hf.get("torch_dtype"),
            )
        except KeyError as exc:
            raise CheckpointError(f"{source}: required field {exc.args[0]!r} is missing") from None
        except ConfigError as exc:
            raise CheckpointError(f"{source}: {exc}") from None

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> ModelConfig:
        """Read config.json (and generation_config.json's eos ids) from a model directory."""
        directory = Path(directory)
        path = directory / CONFIG_FILE
        config = cls.from_hf_config(read_json(path), source=str(path))
        generation_path = directory / GENERATION_CONFIG_FILE
        if generation_path.exists():
            extra = _token_ids(read_json(generation_path).get("eos_token_id"))
            merged = config.eos_token_ids + tuple(t for t in extra if t not in config.eos_token_ids)
            config = attrs.evolve(config, eos_token_ids=merged)
        return config


# Multiply-adds per generated token under which a model counts as small: one thread
# runs its step fastest (a product takes tens of microseconds, the order of a team's
# start-up and barrier cost), and a CPU server gives it a smaller token budget a step.
SMALL_MODEL_MACS = 50_000_000


def macs_per_token(config: ModelConfig) -> int:
    """Multiply-adds of the weight products for one token: projections, MLP and the output head."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    attention = config.hidden_size * (2 * q_size + 2 * kv_size)
    mlp = 3 * config.hidden_size * config.intermediate_size
    return config.num_layers * (attention + mlp) + config.hidden_size * config.vocab_size


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON file, raising CheckpointError naming the file when it is absent or invalid."""
    if not path.is_file():
        raise CheckpointFileNotFoundError(f"{path} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None


def _model_type(hf: Mapping[str, Any], source: str) -> str:
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    if model_type is None:
        by_class = {f"{t.capitalize()}ForCausalLM": t for t in SUPPORTED_MODEL_TYPES}
        model_type = next((by_class[a] for a in architectures if a in by_class), None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        described = model_type or ", ".join(architectures) or "no model_type"
        raise UnsupportedArchitectureError(
            f"{source}: architecture {described!r} is not supported; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def _rope(hf: Mapping[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    # Newer configs nest everything under rope_parameters; older ones use
    # rope_theta at top level and rope_scaling (keyed "type" or "rope_type").
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedArchitectureError(f"{source}: partial_rotary_factor is not supported")
    if rope_type not in ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    fields = {f.name for f in attrs.fields(RopeScaling)} - {"rope_type"}
    return theta, RopeScaling(rope_type=rope_type, **{k: v for k, v in merged.items() if k in fields})


def _sliding_window(hf: Mapping[str, Any], model_type: str) -> int | None:
    if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
        return None
    window = hf.get("sliding_window")
    return int(window) if window else None


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "qwen3-0.6b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=True,
        qk_norm=True, bos_token_id=151643, eos_token_ids=(151645, 151643), dtype="bfloat16",
    ),
}


def preset(name: str) -> ModelConfig:
    """A named model shape for random-weight runs and benchmarks."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]
