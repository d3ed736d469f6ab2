"""CompiledDecode.compile_seconds (pdserve_decode_step_compile_seconds, "spent compiling so far") counts a
failed compile's time too."""

from __future__ import annotations

import pytest
import torch

from services.engine.cpu.compiled_decode import _COMPILE_ERRORS, CompiledDecode


def test_a_failed_compile_still_counts_its_seconds() -> None:
    # A module without the decoder's parts: Dynamo traces the variant and fails (Unsupported) at model.rotary.
    cd = CompiledDecode(torch.nn.Linear(1, 1), torch.zeros(1, 2, 4, 16, 1, 4), max_batch=1)
    with pytest.raises(_COMPILE_ERRORS):
        cd.compile(1, cd.kv_cache)
    assert cd.compile_seconds > 0.0
