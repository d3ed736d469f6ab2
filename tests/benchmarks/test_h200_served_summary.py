"""benchmarks/h200_served.py's comparison: a served point counts against the engine phase only when its prompts
were the engine's length (the server's usage counts), and bench serve's ``byte`` tokenizer cuts prompts to the
token count random models see."""

from __future__ import annotations

import random

from benchmarks import h200_served
from benchmarks.serve.tokens import WordText, load_tokenizer


def _result(prompt_tokens: int) -> dict:
    served = {"mode": "colocated", "shape": "1024x256", "concurrency": 64, "logprobs": True,
              "throughput": {"output_tok_s": 1000.0}, "ttft_s": {"p50": 0.1, "p90": 0.2}, "tpot_s": {"p50": 0.01},
              "requests": {"failed": 0, "completed": 64}, "prompt_tokens_per_request": prompt_tokens}
    engine = {"shape": "1024x256", "concurrency": 64, "logprobs": True, "output_tok_s": 2000.0}
    return {"engine": {"points": [engine]}, "served": [served]}


def test_a_served_point_with_other_prompt_lengths_gets_no_ratio() -> None:
    (same,) = h200_served.summarize(_result(1023))
    assert same["served_over_engine"] == 0.5
    (other,) = h200_served.summarize(_result(4815))  # words counted byte by byte: not the engine's work
    assert other["served_over_engine"] is None and other["prompt_tokens_per_request"] == 4815


def test_byte_tokenizer_cuts_prompts_to_the_token_count() -> None:
    tok = load_tokenizer("byte")
    assert tok is not None
    text = WordText(tok)
    for n in (16, 1024, 8192):
        got = len(tok.encode(text.text(n, random.Random(n)), add_special_tokens=False))
        assert n - 1 <= got <= n, (n, got)  # an edge space may be stripped


def test_one_gpu_pd_ceiling_adds_prefill_alone_and_full_batch_decode() -> None:
    point = {"requests": 512, "batch": 256, "full_batch_decode_step_ms": 20.0}
    # 512 prompts at 30 ms each (15.36 s) + 512 x 256 / 256 steps at 20 ms (10.24 s) for 131072 tokens
    assert abs(h200_served.time_sharing_ceiling(point, 0.030, 256) - 131072 / 25.6) < 1e-6
    assert h200_served.time_sharing_ceiling(point, None, 256) is None
    assert h200_served.time_sharing_ceiling({**point, "full_batch_decode_step_ms": None}, 0.03, 256) is None


def test_the_ceiling_divides_1p1d_rows_only() -> None:
    result = _result(1030)
    result["engine"]["points"][0]["one_gpu_pd_ceiling_tok_s"] = 1250.0
    result["served"].append({**result["served"][0], "mode": "1p1d"})
    colocated, pd = h200_served.summarize(result)
    assert colocated["one_gpu_pd_ceiling_tok_s"] is None and pd["one_gpu_pd_ceiling_tok_s"] == 1250.0


def test_engine_point_counts_every_output_token() -> None:
    """The engine phase's point (prompts alone too: one output token each, its wall time the prefill's)."""
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="random:tiny-llama", dtype="float32", device="cpu", max_model_len=256))
    r = h200_served.engine_point(engine, 48, 3, 2, True, 4, seed=1)
    assert r["output_tokens"] == 12 and r["requests"] == 4 and r["wall_s"] > 0 and not engine.has_work()
    alone = h200_served.engine_point(engine, 48, 1, 4, False, 4, seed=2)
    assert alone["output_tokens"] == 4 and alone["steps"]["steps"] >= 1


def test_warmup_point_size() -> None:
    ns = h200_served._args(["--concurrency", "256,512,64"])
    assert h200_served.warmup_requests(ns, 1024) == 256  # capped at 256 requests
    assert h200_served.warmup_requests(ns, 8192) == 36  # 300K prompt tokens
    assert h200_served.warmup_requests(h200_served._args(["--concurrency", "16"]), 1024) == 16
    assert h200_served.warmup_requests(h200_served._args(["--warmup-prompt-tokens", "0"]), 1024) == 0
