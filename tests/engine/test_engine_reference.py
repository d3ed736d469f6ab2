"""Engine logits and greedy tokens vs transformers on the same weights (fp32), through the whole
engine: scheduler (chunked prefill, odd budgets, prefix-cache hits) + model runner + paged KV.

Logits are read at the sampler's input (the engine's final fp32 logits per sampled row) and
compared with one teacher-forced transformers forward over prompt + generated tokens.

Tolerances (max |logit difference| over the vocabulary, prefill + 20 decode steps):
  * GGUF SmolLM2-135M, fp32: 5e-4 (|logits| reach ~40; measured ~5e-5: fp32 summation order over 30
    layers differs between the paged path and transformers' SDPA).
  * tiny random Qwen3 (2 layers, hidden 64), fp32: 2e-5 (|logits| ~3; measured ~2e-6).
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.model_loader import load_model
from services.engine.sampler import Sampled, SamplingRow
from services.text.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

DECODE_STEPS = 20
TOL = {"gguf": 5e-4, "qwen3": 2e-5}
PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press into a system that could "
    "produce books quickly and cheaply.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Paris, London and Rome are",
    "Water boils at a temperature of",
]


@dataclass
class Ref:
    """One model as the engine loads it and as transformers loads it, plus a way to make prompts."""

    name: str
    loaded: Any
    hf: Any
    prompts: list[list[int]]


class LogitRecorder:
    """Wraps an engine's sampler; records each sampled row's fp32 logits under its SamplingParams.

    Each request gets its own SamplingParams object, so identity maps rows to requests."""

    def __init__(self, engine: LLMEngine) -> None:
        self.inner = engine.runner.sampler
        self.rows: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._alive: list[SamplingParams] = []  # ids stay unique while the recorder lives
        engine.runner.sampler = self  # type: ignore[assignment]

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[Sampled]:
        for i, row in enumerate(rows):
            if id(row.params) not in self.rows:
                self._alive.append(row.params)
            self.rows[id(row.params)].append(logits[i].detach().float().clone())
        return self.inner.sample(logits, rows)

    def of(self, params: SamplingParams) -> torch.Tensor:
        return torch.stack(self.rows[id(params)])


def _engine(ref: Ref, **kw: Any) -> tuple[LLMEngine, LogitRecorder]:
    cfg = dict(dtype="float32", num_kv_blocks=64, block_size=16)
    cfg.update(kw)
    engine = LLMEngine(EngineConfig(**cfg), loaded=ref.loaded)
    return engine, LogitRecorder(engine)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@torch.no_grad()
def _hf_logits(hf: Any, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' logits at the positions that predicted each generated token (teacher-forced)."""
    seq = prompt + generated[:-1]
    out = hf(torch.tensor([seq])).logits[0].float()
    return out[len(prompt) - 1:]


def _check(ref: Ref, engine: LLMEngine, rec: LogitRecorder, prompts: list[list[int]],
           params: list[SamplingParams]) -> list[list[int]]:
    outs = engine.generate(prompts, params)
    for i, (p, sp, out) in enumerate(zip(prompts, params, outs, strict=True)):
        assert len(out) == sp.max_tokens
        ours = rec.of(sp)
        assert ours.shape[0] == sp.max_tokens  # prefill row + one per decode step
        theirs = _hf_logits(ref.hf, p, out)
        diff = (ours - theirs).abs().max().item()
        assert diff < TOL[ref.name], f"{ref.name} prompt {i}: max |logit diff| {diff:.2e}"
        assert out == theirs.argmax(-1).tolist()
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
    return outs


# --- models ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_ref(our_gguf_model: Any, hf_gguf_model: Any) -> Ref:
    tok = our_gguf_model.tokenizer
    return Ref("gguf", our_gguf_model, hf_gguf_model, [tok.encode(p) for p in PROMPTS])


@pytest.fixture(scope="module")
def qwen3_ref(tiny_qwen3_dir: Path) -> Ref:
    transformers = pytest.importorskip("transformers")
    loaded = load_model(str(tiny_qwen3_dir), torch.float32, "cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_dir), dtype=torch.float32).eval()
    assert hf.config.model_type == "qwen3" and loaded.arch.qk_norm
    g = torch.Generator().manual_seed(0)
    vocab = loaded.arch.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (37, 5, 70, 16)]
    return Ref("qwen3", loaded, hf, prompts)


@pytest.fixture(params=["gguf", "qwen3"])
def ref(request: pytest.FixtureRequest) -> Ref:
    return request.getfixturevalue(f"{request.param}_ref")


# --- logits ---------------------------------------------------------------------------------------


def test_logits_match_at_prefill_and_20_decode_steps(ref: Ref) -> None:
    engine, rec = _engine(ref)
    params = [_greedy(DECODE_STEPS + 1) for _ in ref.prompts]
    _check(ref, engine, rec, ref.prompts, params)


@pytest.mark.parametrize(("chunk", "budget"), [(7, 11), (13, 29)])
def test_logits_match_with_odd_prefill_chunks(ref: Ref, chunk: int, budget: int) -> None:
    engine, rec = _engine(ref, max_prefill_chunk=chunk, max_num_batched_tokens=budget)
    params = [_greedy(DECODE_STEPS + 1) for _ in ref.prompts]
    chunks_seen: list[int] = []
    schedule = engine.scheduler.schedule

    def spy() -> Any:
        out = schedule()
        chunks_seen.extend(c.num_new_tokens for c in out.chunks if c.num_new_tokens > 1)
        assert out.num_batched_tokens <= budget
        return out

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    _check(ref, engine, rec, ref.prompts, params)
    assert max(chunks_seen) == chunk  # prompts were really split at the odd size
    assert any(c not in (1, chunk) for c in chunks_seen)  # and budget leftovers made odd partial chunks


@pytest.mark.parametrize("chunk", [512, 7])
def test_logits_match_with_prefix_cache_hits(ref: Ref, chunk: int) -> None:
    engine, rec = _engine(ref, max_prefill_chunk=chunk, enable_prefix_caching=True)
    first = ref.prompts[0]
    assert len(first) >= 34
    _check(ref, engine, rec, [first], [_greedy(3)])
    # Shares the first two full blocks (32 tokens) with the first prompt, then diverges.
    second = first[:35] + ref.prompts[1] + ref.prompts[3]
    params = _greedy(DECODE_STEPS + 1)
    engine.add_request("second", second, params, detokenize=False)
    out: list[int] = []
    cached = 0
    while engine.has_work():
        for o in engine.step():
            out += o.new_token_ids
            cached = o.num_cached_tokens
    assert cached == 32
    theirs = _hf_logits(ref.hf, second, out)
    diff = (rec.of(params) - theirs).abs().max().item()
    assert diff < TOL[ref.name], f"max |logit diff| with a prefix hit: {diff:.2e}"
    assert out == theirs.argmax(-1).tolist()
    # Whole-prompt hit: all full blocks of the same prompt again (the last token is always recomputed).
    third = _greedy(2)
    engine.add_request("third", second, third, detokenize=False)
    while engine.has_work():
        for o in engine.step():
            cached = o.num_cached_tokens
    assert cached == (len(second) - 1) // 16 * 16 > 32
    assert (rec.of(third)[0] - rec.of(params)[0]).abs().max().item() < TOL[ref.name]


# --- greedy tokens and the chat answer -------------------------------------------------------------


@torch.no_grad()
def _hf_greedy(hf: Any, prompt: list[int], steps: int) -> list[int]:
    """transformers' own incremental greedy decoding with its KV cache, EOS not special."""
    # transformers 5 renamed the forward's cache argument; the output field kept its name.
    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    out = hf(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = hf(torch.tensor([[tokens[-1]]]), use_cache=True, **{key: out.past_key_values})
    return tokens


def test_greedy_32_tokens_equal_transformers(gguf_ref: Ref) -> None:
    engine, _ = _engine(gguf_ref, max_prefill_chunk=13, max_num_batched_tokens=40)
    ours = engine.generate(gguf_ref.prompts, _greedy(32))  # all prompts in one batch
    for p, got in zip(gguf_ref.prompts, ours, strict=True):
        assert got == _hf_greedy(gguf_ref.hf, p, 32), gguf_ref.loaded.tokenizer.decode(p)


def test_chat_capital_of_france_is_paris(gguf_ref: Ref) -> None:
    tok = gguf_ref.loaded.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompt = tok.encode(chat, add_special_tokens=False)
    engine, _ = _engine(gguf_ref)
    engine.add_request("chat", prompt, SamplingParams(temperature=0.0, max_tokens=32))
    text = ""
    while engine.has_work():
        for o in engine.step():
            text += o.new_text
            reason = o.finish_reason
    assert "Paris" in text, text
    assert reason is not None and reason.value == "stop"  # it ends with EOS, not the length limit
