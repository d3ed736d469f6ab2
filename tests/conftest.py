"""Suite-wide setup: without a GPU, Triton kernels run under the CPU interpreter.

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit picks the interpreter at
decoration time); the root conftest is imported before every test module."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
