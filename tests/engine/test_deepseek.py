"""DeepSeek-V2/V3/V3.2 (multi-head latent attention, V3.2's sparse top-k indexer, MoE) vs transformers, fp32 on CPU, tiny random checkpoints
built in the test: the paged harness and the whole engine (scheduler, chunked prefill, the latent pages) give
transformers' logits within TINY_TOL and its greedy tokens up to the first near-tie; the pages hold exactly the
latent; what the engine does not implement is refused in one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.kv_layout import PageLayout
from services.engine.model_loader import load_model
from services.engine.models.deepseek import MLAAttention
from services.text.model.mla_config import MLAConfig, MLAConfigError
from services.text.model.random_shapes import random_arch
from services.text.sampling_params import SamplingParams
from tests.engine.test_moe_models import _ref_logits, assert_tokens_match_until_near_tie
from tests.moe_checkpoints import write_tiny_moe

pytestmark = pytest.mark.slow

DEEPSEEK = ("deepseek_v2", "deepseek_v3", "deepseek_v32")
CACHED = {"deepseek_v2": (32, 8), "deepseek_v3": (32, 8), "deepseek_v32": (32, 8)}
"""PageLayout.latent of each tiny checkpoint: kv_lora_rank, rope dims (the V3.2 index key is a region of its own)."""
INDEX_DIM = 16
"""index_head_dim of the tiny V3.2 checkpoint."""


@pytest.fixture(scope="module", params=DEEPSEEK)
def tiny_ds(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    transformers = pytest.importorskip("transformers")
    d = write_tiny_moe(tmp_path_factory.mktemp(request.param), request.param)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    return request.param, d, ref


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 23, 5)]


def test_deepseek_checkpoint_matches_transformers(tiny_ds: tuple[str, Path, Any], greedy: Any) -> None:
    model_type, d, ref = tiny_ds
    ours = load_model(str(d), torch.float32, "cpu")
    arch = ours.arch
    assert arch.architecture == "deepseek" and arch.mla is not None and arch.moe is not None
    assert (arch.num_kv_heads, arch.head_dim) == (1, sum(CACHED[model_type]) // 2)  # two planes of half
    kinds = [type(layer.mlp).__name__ for layer in ours.model.model.layers]
    assert kinds == ["MLP", "SparseMoeBlock"]  # first_k_dense_replace=1
    assert all(isinstance(layer.self_attn, MLAAttention) for layer in ours.model.model.layers)
    prompts = _prompts()
    gen, logits = greedy(ours.model, prompts, 24, chunk=16)  # chunks of 16: the cached-latent prefill path
    compared = [assert_tokens_match_until_near_tie(toks, lg, _ref_logits(ref, p, toks), f"{model_type} prompt {i}")
                for i, (p, toks, lg) in enumerate(zip(prompts, gen, logits, strict=True))]
    assert sum(compared) >= 36, f"{model_type}: only {compared} steps before a near-tie"


def test_deepseek_engine_greedy_equals_transformers(tiny_ds: tuple[str, Path, Any]) -> None:
    """The engine end to end: chunked prefill (13-token chunks), decode batches over several pages, logprobs."""
    model_type, d, ref = tiny_ds
    engine = LLMEngine(EngineConfig(model=str(d), dtype="float32", device="cpu", max_prefill_chunk=13,
                                    num_kv_blocks=64, block_size=16))
    prompts = _prompts()
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=True)
    toks: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    lps: dict[str, list[float]] = {r: [] for r in toks}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp, detokenize=False)
    while engine.has_work():
        for o in engine.step():
            toks[o.request_id].extend(o.new_token_ids)
            lps[o.request_id].extend(float(x) for x in o.new_logprobs)
    for i, p in enumerate(prompts):
        got = toks[f"r{i}"]
        assert len(got) == 20
        r = _ref_logits(ref, p, got)
        assert_tokens_match_until_near_tie(got, r, r, f"{model_type} engine prompt {i}")
        want = torch.log_softmax(r, -1).gather(1, torch.tensor(got)[:, None])[:, 0]
        assert (want - torch.tensor(lps[f"r{i}"])).abs().max() < 1e-4, f"{model_type} prompt {i}: logprobs differ"
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks


def test_pages_hold_exactly_the_latent_and_the_layout_says_so(tiny_ds: tuple[str, Path, Any]) -> None:
    model_type, d, _ = tiny_ds
    engine = LLMEngine(EngineConfig(model=str(d), dtype="float32", device="cpu", num_kv_blocks=8, block_size=16))
    layout = engine.layout
    cached = sum(CACHED[model_type])
    assert layout.latent == CACHED[model_type] and (layout.num_kv_heads, layout.head_dim) == (1, cached // 2)
    assert layout.regions[0].bytes_per_page == 2 * 16 * cached * 4  # layers x tokens x latent x fp32: no padding
    assert "latent c32+r8 " in layout.describe()
    index = layout.region("index")
    if model_type == "deepseek_v32":  # the index keys: a region of their own, one key per token and layer
        assert index is not None and index.name == f"index[L2 d{INDEX_DIM}]" and index.codec == "fp32"
        assert index.bytes_per_page == 2 * 16 * INDEX_DIM * 4 and "+index[L2 d16]:fp32 " in layout.describe()
    else:
        assert index is None and len(layout.regions) == 1
    plain = PageLayout.for_model(layout.model_id, 2, 1, cached // 2, 16, "fp32")
    assert plain.regions[0].bytes_per_page == layout.regions[0].bytes_per_page
    assert plain.fingerprint != layout.fingerprint
    from services.engine.convert import layout_from_pb, layout_to_pb

    assert layout_from_pb(layout_to_pb(layout)).fingerprint == layout.fingerprint


def test_random_deepseek_shapes(greedy: Any) -> None:
    with torch.device("meta"):
        from services.engine.models.registry import get_model_class

        arch = random_arch("deepseek-v2-lite")
        model = get_model_class(arch.architecture)(arch)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(15.71e9, rel=2e-3)  # DeepSeek-V2-Lite
    assert arch.mla is not None and arch.mla.latent_dim == 576 and arch.moe is not None
    tiny = load_model("random:tiny-deepseek", torch.float32, "cpu", seed=3)
    prompt = tiny.tokenizer.encode("latent attention")
    gen, lg = greedy(tiny.model, [prompt], 6)
    assert len(gen[0]) == 6 and torch.isfinite(lg[0]).all()


def test_v32_selection_decides_what_a_query_sees(tmp_path: Path, greedy: Any) -> None:
    """The indexer matters: with index_topk raised past the context the logits change (the tiny model's queries
    then see every key), so matching transformers above is not dense attention in disguise."""
    pytest.importorskip("transformers")
    d = write_tiny_moe(tmp_path, "deepseek_v32")
    sparse = load_model(str(d), torch.float32, "cpu")
    dense = load_model(str(d), torch.float32, "cpu")
    for layer in dense.model.model.layers:
        layer.self_attn.mla = dataclasses.replace(layer.self_attn.mla, index_topk=10_000)
    prompt = _prompts()[0]
    _, a = greedy(sparse.model, [prompt], 2)
    _, b = greedy(dense.model, [prompt], 2)
    assert (a[0] - b[0]).abs().max() > 1e-3


def test_mla_config_validates() -> None:
    with pytest.raises(MLAConfigError, match="all three positive"):
        MLAConfig(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=8,
                  index_n_heads=2, index_head_dim=16)
    with pytest.raises(MLAConfigError, match="q_lora_rank must be set"):
        MLAConfig(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_n_heads=2,
                  index_head_dim=16, index_topk=4)
    with pytest.raises(MLAConfigError, match="must be even"):
        MLAConfig(kv_lora_rank=31, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    with pytest.raises(MLAConfigError, match="qk_rope_head_dim=7"):
        MLAConfig(kv_lora_rank=32, qk_rope_head_dim=7, qk_nope_head_dim=16, v_head_dim=16)
    assert MLAConfig(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16).scale == 24 ** -0.5


@pytest.mark.parametrize("chunk", [None, 16])
def test_expanded_prefill_form_matches_transformers(tiny_ds: tuple[str, Path, Any], greedy: Any,
                                                    chunk: int | None) -> None:
    """Prompts that start at position 0 in the expanded form (per-head K/V from the step's latents: the usual prefill
    form), decode rows and chunks after a prefix (chunk=16) in the latent space: transformers' logits and greedy
    tokens as before. V3.2 keeps its sparse latent path for every row."""
    model_type, d, ref = tiny_ds
    ours = load_model(str(d), torch.float32, "cpu")
    ours.model.set_prefill_form("expanded")
    prompts = _prompts()
    gen, logits = greedy(ours.model, prompts, 24, chunk=chunk)
    compared = [assert_tokens_match_until_near_tie(toks, lg, _ref_logits(ref, p, toks), f"{model_type} prompt {i}")
                for i, (p, toks, lg) in enumerate(zip(prompts, gen, logits, strict=True))]
    assert sum(compared) >= 36, f"{model_type}: only {compared} steps before a near-tie"


def test_chunks_after_a_prefix_take_the_expanded_form(tiny_ds: tuple[str, Path, Any], greedy: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of at least ``min_expanded_chunk`` tokens after a cached prefix attend expanded too: the prefix's
    latents read back from the pool and expanded with the chunk's own, causal from the chunk's first position; a
    step holding a shorter chunk after a prefix stays latent. 32-token chunks of 96 / 70 / 64-token prompts (the
    tiny widths' threshold is 32): step 2 expands the three prompts over their 32 cached tokens; step 3 holds
    prompt 1's 6-token tail, so it stays latent; transformers' logits and greedy tokens either way. V3.2 never
    expands."""
    import services.engine.models.deepseek as ds

    model_type, d, ref = tiny_ds
    ours = load_model(str(d), torch.float32, "cpu")
    ours.model.set_prefill_form("expanded")
    assert {layer.self_attn.min_expanded_chunk for layer in ours.model.model.layers} == {32}
    prefixes: list[int] = []
    real = ds.cached_latents

    def spy(ctx: Any, layer: int, row: int, tokens: int) -> torch.Tensor:
        prefixes.append(tokens)
        return real(ctx, layer, row, tokens)

    monkeypatch.setattr(ds, "cached_latents", spy)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (96, 70, 64)]
    gen, logits = greedy(ours.model, prompts, 16, chunk=32)
    if model_type == "deepseek_v32":
        assert prefixes == []
    else:  # step 2: three prompts after 32 tokens, in each of the 2 layers; step 3 holds a 6-token chunk: latent
        assert sorted(set(prefixes)) == [32] and len(prefixes) == 3 * 2, prefixes
    compared = [assert_tokens_match_until_near_tie(toks, lg, _ref_logits(ref, p, toks), f"{model_type} prompt {i}")
                for i, (p, toks, lg) in enumerate(zip(prompts, gen, logits, strict=True))]
    assert sum(compared) >= 24, f"{model_type}: only {compared} steps before a near-tie"


def test_a_prefix_cache_hit_expands_the_cached_prefix(tiny_ds: tuple[str, Path, Any],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine with prefix caching: a second prompt sharing the first's 64-token head computes only its 48-token
    tail, expanded over the 64 cached latents it reads back from the pool (blocks the first request filled);
    transformers' greedy tokens for both. V3.2 reads no latents back (its sparse latent path, never expanded)."""
    import services.engine.models.deepseek as ds

    model_type, d, ref = tiny_ds
    engine = LLMEngine(EngineConfig(model=str(d), dtype="float32", device="cpu", num_kv_blocks=64, block_size=16,
                                    enable_prefix_caching=True))
    prefixes: list[int] = []
    real = ds.cached_latents
    monkeypatch.setattr(ds, "cached_latents", lambda ctx, layer, row, n: prefixes.append(n) or real(ctx, layer, row, n))
    g = torch.Generator().manual_seed(11)
    head = torch.randint(0, 512, (64,), generator=g).tolist()
    prompts = [head + torch.randint(0, 512, (n,), generator=g).tolist() for n in (20, 48)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = [engine.generate([p], sp)[0] for p in prompts]
    # The second prompt, in each of the 2 layers (V3.2: none).
    assert prefixes == ([] if model_type == "deepseek_v32" else [64, 64]), prefixes
    for i, (p, got) in enumerate(zip(prompts, outs, strict=True)):
        r = _ref_logits(ref, p, got)
        assert_tokens_match_until_near_tie(got, r, r, f"{model_type} prefix-cache prompt {i}")


def test_mla_prefill_form_is_chosen_and_refused_where_it_does_not_apply() -> None:
    """--mla-prefill auto: expanded (on every device); a form other than auto for a model without latent attention (or with
    V3.2's indexer) is refused at start in one line."""
    from services.engine.config import EngineConfigError

    eng = LLMEngine(EngineConfig(model="random:tiny-deepseek", dtype="float32", num_kv_blocks=16))
    assert eng.runner.mla_prefill == "expanded"
    assert all(layer.self_attn.expanded_prefill for layer in eng.runner.model.model.layers)
    # On CPU every chunk after a prefix too (CPU_MIN_EXPANDED_CHUNK: measured faster from 2 new tokens).
    assert {layer.self_attn.min_expanded_chunk for layer in eng.runner.model.model.layers} == {1}
    absorbed = LLMEngine(EngineConfig(model="random:tiny-deepseek", dtype="float32", num_kv_blocks=16,
                                      mla_prefill="absorbed"))
    assert not any(layer.self_attn.expanded_prefill for layer in absorbed.runner.model.model.layers)
    with pytest.raises(EngineConfigError, match=r"^--mla-prefill / PDSERVE_MLA_PREFILL=expanded: .*leave it auto$"):
        LLMEngine(EngineConfig(model="random:tiny-llama", dtype="float32", num_kv_blocks=16, mla_prefill="expanded"))


def test_a_prompt_arriving_while_another_decodes_attends_expanded_beside_the_decode_row(
        tiny_ds: tuple[str, Path, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A step holding a decode row and a new prompt: the decode row in the latent space, the prompt expanded (the
    backend attends the decode rows only, AttentionSpec.decode_only); both give transformers' tokens. V3.2 keeps
    its sparse latent path for every row (never expanded)."""
    model_type, d, ref = tiny_ds
    from services.engine.models import deepseek

    mixed: list[int] = []
    real = deepseek.MLAAttention._expanded

    def spy(self, *args):
        mixed.append(args[-1].meta.num_decode)
        return real(self, *args)

    monkeypatch.setattr(deepseek.MLAAttention, "_expanded", spy)
    engine = LLMEngine(EngineConfig(model=str(d), dtype="float32", device="cpu", num_kv_blocks=64, block_size=16))
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first, second = _prompts()[0], _prompts()[1]
    toks: dict[str, list[int]] = {"a": [], "b": []}
    engine.add_request("a", first, sp, detokenize=False)
    for _ in range(3):  # "a" prefilled and decoding
        for o in engine.step():
            toks[o.request_id].extend(o.new_token_ids)
    engine.add_request("b", second, sp, detokenize=False)
    while engine.has_work():
        for o in engine.step():
            toks[o.request_id].extend(o.new_token_ids)
    if model_type == "deepseek_v32":
        assert mixed == []
    else:
        assert any(nd == 1 for nd in mixed), mixed  # the step of "b"'s prompt held "a"'s decode row
    for rid, p in (("a", first), ("b", second)):
        r = _ref_logits(ref, p, toks[rid])
        assert_tokens_match_until_near_tie(toks[rid], r, r, f"{model_type} {rid}")
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
