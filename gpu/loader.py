"""Load weights from a local Hugging Face directory of safetensors files.

Tensors are read one at a time (`iter_checkpoint_tensors`) and copied into the
parameter of the same name, so peak host memory is one tensor, and a sharded
loader can later read only its slice of each tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from .config import read_json
from .errors import (
    CheckpointError,
    CheckpointFileNotFoundError,
    MissingWeightError,
    UnexpectedWeightError,
    WeightShapeError,
)
from .model import CausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some exporters save that this model derives itself.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
MAX_NAMES_IN_ERROR = 5


def checkpoint_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index lists, or the single file."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointFileNotFoundError(f"model directory {directory} does not exist")
    index_path = directory / INDEX_FILE
    if index_path.exists():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path} has no weight_map")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for path in files:
            if not path.is_file():
                raise CheckpointFileNotFoundError(f"shard {path.name} listed in {index_path} does not exist")
        return files
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointFileNotFoundError(f"no *.safetensors weights in {directory}")
    return files


def iter_checkpoint_tensors(directory: str | Path) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """Yield (file, tensor name, tensor on CPU) for every tensor of the checkpoint, one at a time."""
    for path in checkpoint_files(directory):
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None
        with handle:
            for name in handle.keys():
                yield path, name, handle.get_tensor(name)


@torch.no_grad()
def load_weights(model: CausalLM, directory: str | Path) -> None:
    """Copy every checkpoint tensor into the model parameter of the same name.

    Casts to the parameter's dtype and device. Raises WeightShapeError,
    UnexpectedWeightError or MissingWeightError naming the tensor.
    """
    params = dict(model.named_parameters())
    missing = set(params)
    for path, name, tensor in iter_checkpoint_tensors(directory):
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied: the head reads the embedding matrix
        param = params.get(name)
        if param is None:
            raise UnexpectedWeightError(
                f"{path.name}: tensor {name!r} has no matching parameter in a "
                f"{model.config.architecture} model with this config"
            )
        if tuple(tensor.shape) != tuple(param.shape):
            raise WeightShapeError(
                f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(param.shape)}"
            )
        param.copy_(tensor)
        missing.discard(name)
    if missing:
        names = sorted(missing)
        shown = ", ".join(names[:MAX_NAMES_IN_ERROR])
        more = f" and {len(names) - MAX_NAMES_IN_ERROR} more" if len(names) > MAX_NAMES_IN_ERROR else ""
        raise MissingWeightError(f"checkpoint {directory} lacks {len(names)} tensors: {shown}{more}")
