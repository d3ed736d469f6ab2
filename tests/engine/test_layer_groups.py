"""The per-layer-group hook of an eager forward (services/engine/layer_groups.py) with the page API's layer-range
export (kv_pages.py), through the real engine: each group's export, made inside the forward right after the
group was launched, holds exactly that group's layers of the chunk's final pages; groups cover every layer once
in order; tokens do not change; decode steps never carry sinks. CPU here, and on a GPU (marked) where the
export waits on the compute stream for the group it was called after."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.kv_pages import PageExport, pages_of
from services.engine.scheduler import ScheduledChunk
from services.text.sampling_params import SamplingParams

PROMPT = [(i * 31) % 250 + 1 for i in range(70)]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class _Collect:
    """A LayerSink exporting each group of one chunk's pages as the forward hands it over."""

    def __init__(self, engine: LLMEngine, blocks: list[int]) -> None:
        self.pages, self.blocks = pages_of(engine), blocks
        self.groups: list[tuple[tuple[int, int], PageExport]] = []
        self.abandoned = False

    def group_done(self, first_layer: int, end_layer: int) -> None:
        self.groups.append(((first_layer, end_layer), self.pages.export(self.blocks, None, None,
                                                                        (first_layer, end_layer))))

    def abandon(self) -> None:
        self.abandoned = True


def _run(device: str, size: int) -> None:
    cfg = EngineConfig(model="random:tiny-llama", dtype="float32" if device == "cpu" else "bfloat16", device=device,
                       num_kv_blocks=32, max_prefill_chunk=32, kv_export_layer_group=size,
                       kv_export_layer_group_cpu=True)
    eng = LLMEngine(cfg)
    layers = eng.runner.num_layers
    sinks: list[_Collect] = []
    whole: list[torch.Tensor] = []
    offered: list[int] = []

    def listener(ch: ScheduledChunk) -> _Collect | None:
        offered.append(ch.num_new_tokens)
        if not ch.sample:
            return None
        end = ch.seq.num_computed_tokens + ch.num_new_tokens
        sinks.append(_Collect(eng, ch.seq.block_table[:-(-end // cfg.block_size)]))
        return sinks[-1]

    def after(ch: ScheduledChunk, _sampled) -> None:  # blocks still held: the chunk's final pages
        if sinks and ch.sample and len(whole) < len(sinks):
            whole.append(pages_of(eng).export(sinks[-1].blocks).wait().clone())

    eng.layer_listeners.append(listener)
    eng.chunk_listeners.append(after)
    got = eng.generate([PROMPT], GREEDY)[0]
    assert len(sinks) == 1 and not sinks[0].abandoned  # the prompt's last chunk only
    assert all(n > 1 for n in offered)  # decode steps (one token) are never offered
    spans = [g for g, _ in sinks[0].groups]
    assert spans == [(a, min(a + size, layers)) for a in range(0, layers, size)]
    staged = torch.cat([e.wait() for _, e in sinks[0].groups], dim=1)
    assert torch.equal(staged, whole[0])
    plain = LLMEngine(EngineConfig(model="random:tiny-llama", dtype=cfg.dtype, device=device, num_kv_blocks=32,
                                   max_prefill_chunk=32, kv_export_layer_group=0))
    assert plain.generate([PROMPT], GREEDY)[0] == got


@pytest.mark.parametrize("size", [1, 3])
def test_cpu_groups_export_the_chunks_final_pages_layer_by_layer(size: int) -> None:
    _run("cpu", size)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("size", [1, 4])
def test_gpu_groups_export_the_chunks_final_pages_layer_by_layer(size: int) -> None:
    _run("cuda", size)


def test_without_the_cpu_switch_no_listener_is_asked_on_cpu() -> None:
    eng = LLMEngine(EngineConfig(model="random:tiny-llama", dtype="float32", num_kv_blocks=32, max_prefill_chunk=32))
    asked: list[int] = []
    eng.layer_listeners.append(lambda ch: asked.append(ch.num_new_tokens))
    eng.generate([PROMPT], GREEDY)
    assert eng.layer_group == 0 and asked == []


def test_a_listener_raising_fails_the_step_after_abandoning_the_sinks_made_before_it() -> None:
    """A sink a listener already made is abandoned (its write closes) when a later listener raises in ``plan``:
    nothing would ever hand it a group otherwise."""
    eng = LLMEngine(EngineConfig(model="random:tiny-llama", dtype="float32", num_kv_blocks=32, max_prefill_chunk=32,
                                 kv_export_layer_group=2, kv_export_layer_group_cpu=True))
    sinks: list[_Collect] = []

    def first(ch: ScheduledChunk) -> _Collect | None:
        if ch.sample:
            sinks.append(_Collect(eng, ch.seq.block_table[:1]))
            return sinks[-1]
        return None

    def second(ch: ScheduledChunk) -> None:
        if ch.sample:
            raise RuntimeError("injected: listener failed")

    eng.layer_listeners += [first, second]
    with pytest.raises(RuntimeError, match="injected"):
        eng.generate([PROMPT], GREEDY)
    assert len(sinks) == 1 and sinks[0].abandoned and sinks[0].groups == []
