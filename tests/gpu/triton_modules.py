"""Cadence's Triton modules as the tests use them: compiled on a CUDA GPU, else run by
Triton's CPU interpreter, which must be switched on before a module's kernels are made."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def load(name: str, kernel: str) -> ModuleType:
    """`cadence.gpu.<name>`, with `kernel` (one of its kernels) interpreted on a CPU."""
    if not HAS_CUDA:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    module = importlib.import_module(f"cadence.gpu.{name}")
    if not HAS_CUDA and not type(getattr(module, kernel)).__name__.startswith("Interpreted"):
        # Imported earlier in this process, before the interpreter was switched on.
        module = importlib.reload(module)
    return module
