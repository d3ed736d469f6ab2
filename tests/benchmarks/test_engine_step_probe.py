"""benchmarks/engine_step_probe.py classes every step of an engine point: the prompts' tokens land in steps that
carry prompt tokens, and every request's output after its first token in decode steps."""

from __future__ import annotations

from benchmarks import engine_step_probe


def test_every_token_lands_in_one_class() -> None:
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="random:tiny-llama", dtype="float32", device="cpu", max_model_len=256))
    classes = engine_step_probe.run_round(engine, 40, 5, 6, True, seed=3)
    prompt = classes["with prompt tokens"]
    decode = classes["decode graphed"] + classes["decode eager"]
    assert prompt and decode and not classes["decode graphed"]  # no CUDA graphs on CPU
    assert sum(t for _, t, _ in prompt) + sum(t for _, t, _ in decode) == 6 * 40 + 6 * 4  # prompts + later tokens
    assert all(t == n for _, t, n in decode)  # one token per decode row
