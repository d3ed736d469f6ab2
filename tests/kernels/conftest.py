"""Kernel tests run on the GPU when there is one, else under the Triton CPU interpreter.

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit picks the interpreter at
decoration time), so this runs at conftest import, ahead of the test modules.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
