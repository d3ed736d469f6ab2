"""Pages with a draft region through the page API, prefill engine -> decode engine, in one process.

The prefill engine (draft set, no speculation) computes the prompt and both regions; its pages go
through ``pages_of(...).export`` (native or fp8-e4m3 target codec, the configured draft codec) into a
decode engine's reservation, which then speculates. Greedy output must equal plain decoding.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.kv_layout import FP8_CODEC
from services.engine.kv_pages import pages_of
from services.engine.scheduler import ScheduledChunk
from services.text.sampling_params import SamplingParams

TINY = "random:tiny-llama"
BS = 4
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)


def _engine(k: int, draft: str = "layers:1", **kw: object) -> LLMEngine:
    cfg = dict(model=TINY, dtype="float32", num_kv_blocks=64, block_size=BS, max_prefill_chunk=8)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg, draft_model=draft, spec_tokens=k))  # type: ignore[arg-type]


def _handoff(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], rid: str, codec: str | None) -> list[int]:
    """Prefill computes the prompt; its pages (blocks decode lacks) land in decode's reservation."""
    seq, cached = decode.add_kv_import(rid, prompt, GREEDY, detokenize=False)
    got: dict[str, object] = {}

    def listener(ch: ScheduledChunk, sampled) -> None:
        if ch.sample:
            n = -(-len(ch.seq.token_ids) // BS)
            got["pages"] = pages_of(prefill).export(ch.seq.block_table[cached:n], codec).wait()
            got["first"] = sampled.token

    prefill.chunk_listeners.append(listener)
    prefill.add_request(rid, prompt, dataclasses.replace(GREEDY, max_tokens=1), detokenize=False)
    while prefill.has_work():
        prefill.step()
    prefill.chunk_listeners.remove(listener)
    pages = got["pages"]
    assert isinstance(pages, torch.Tensor) and pages.dtype == torch.uint8
    layout = prefill.fp8_layout if codec == FP8_CODEC else prefill.layout
    assert pages.shape[1] == layout.page_bytes  # both regions, exactly as the layout says
    pages_of(decode).import_pages(seq.block_table[cached:len(pages) + cached], pages, codec)
    out = list(decode.kv_import_done(rid, int(got["first"]), None)[0].new_token_ids)  # type: ignore[index]
    while decode.has_work():
        for o in decode.step():
            out.extend(o.new_token_ids)
    return out


@pytest.mark.parametrize("codec", [None, FP8_CODEC])
@pytest.mark.parametrize("draft_codec", ["fp8-e4m3", "native"])
def test_disaggregated_greedy_equals_plain(codec: str | None, draft_codec: str) -> None:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 255, (n,), generator=g).tolist() for n in (23, 9)]
    plain = _engine(0, "")
    want = plain.generate(prompts, GREEDY)
    prefill = _engine(0, draft_kv_codec=draft_codec)
    decode = _engine(3, draft_kv_codec=draft_codec)
    assert prefill.layout.fingerprint == decode.layout.fingerprint
    if codec is None:
        for i, p in enumerate(prompts):
            assert _handoff(prefill, decode, p, f"r{i}", codec) == want[i]
        # Prefix hit at decode: the first prompt's full blocks are cached, only the rest is sent.
        assert _handoff(prefill, decode, prompts[0], "again", codec) == want[0]
        assert decode.block_manager.num_prefix_hit_tokens > 0
    else:  # fp8 target KV changes the numbers: only check it runs and speculates
        out = _handoff(prefill, decode, prompts[0], "fp8", codec)
        assert len(out) == GREEDY.max_tokens
    assert decode.runner.spec.stats.steps > 0


def test_kvstore_shaped_pages_round_trip() -> None:
    """What the kvstore keeps (export with the cache's codec) restores both regions bit for bit."""
    eng = _engine(0, draft_kv_codec="native")
    eng.generate([list(range(1, 30))], SamplingParams(max_tokens=1, temperature=0))
    pages = pages_of(eng).export([0, 1, 2]).wait()
    assert pages.shape == (3, *pages_of(eng).page_shape) and pages.dtype == pages_of(eng).dtype
    spec = eng.runner.spec
    before = eng.runner.kv_cache[:, :, :3].clone(), spec.kv_cache[:, :, :3].clone()
    eng.runner.kv_cache.zero_()
    spec.kv_cache.zero_()
    pages_of(eng).import_pages([0, 1, 2], pages)
    assert torch.equal(eng.runner.kv_cache[:, :, :3], before[0]) and torch.equal(spec.kv_cache[:, :, :3], before[1])
    assert before[1].abs().sum() > 0  # the draft region was really written by the prefill's mirror pass
