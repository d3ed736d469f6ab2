"""Speculative decoding on MoE targets: greedy output identical to decoding without it, with a draft of the
same family (the target's first layer, ``layers:1``, whose MLP is the MoE block)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_spec_decode import GREEDY, _engine, _prompts
from tests.moe_checkpoints import write_tiny_moe


@pytest.mark.slow
@pytest.mark.parametrize("model", ["random:tiny-mixtral", "qwen2_moe", "glm4_moe"])
def test_moe_greedy_with_a_same_family_draft_equals_plain_decoding(model: str, tmp_path: Path) -> None:
    # qwen2_moe: shared expert + gate, its layer 1 dense (the draft's layer 0 routes); glm4_moe: layer 0 dense
    # (first_k_dense_replace), partial RoPE: the draft's one layer is the dense one
    draft_layer = "MLP" if model == "glm4_moe" else "SparseMoeBlock"
    if not model.startswith("random:"):
        pytest.importorskip("transformers")
        model = str(write_tiny_moe(tmp_path / model, model))
    baseline = _engine(0, model=model).generate(_prompts(), GREEDY)
    for k in (1, 3):
        eng = _engine(k, "layers:1", model=model)
        assert type(eng.runner.model.model.layers[0].mlp).__name__ == draft_layer
        assert eng.generate(_prompts(), GREEDY) == baseline, k
        st = eng.runner.spec.stats
        assert st.steps > 0 and st.proposed > 0 and st.accepted > 0
        eng.scheduler.check_invariants()
        assert eng.block_manager.num_free_blocks == eng.runner.num_blocks


@pytest.mark.parametrize("draft", ["layers:1", "self"])
def test_a_draft_with_an_indexer_is_refused_at_start(draft: str, tmp_path: Path) -> None:
    """DeepSeek-V3.2 as its own draft (its first layer, or the same checkpoint): the draft's sparse attention would
    need an index-key pool of its own, so the engine refuses it in one line at start instead of failing in the
    draft's first forward."""
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.engine.spec.draft import DraftConfigError

    model = write_tiny_moe(tmp_path, "deepseek_v32")
    spec = "layers:1" if draft == "layers:1" else str(model)
    with pytest.raises(DraftConfigError, match=r"sparse attention \(an indexer, index_head_dim\) is not supported"):
        LLMEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64, draft_model=spec, spec_tokens=3))
