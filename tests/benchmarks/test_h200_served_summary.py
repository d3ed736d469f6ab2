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
