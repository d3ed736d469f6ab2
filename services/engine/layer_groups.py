"""Layer-group hooks of one eager forward: a chunk's KV may leave layer group by layer group while it computes.

A *layer listener* (``LLMEngine.layer_listeners``) is called on the engine thread before a step's model call,
once per scheduled chunk; it returns a :class:`LayerSink` for a chunk whose pages it wants group by group
(a prefill whose last chunk streams to decode), or None. The runner then calls every sink's ``group_done(a,
b)`` on the engine thread right after it launched layers [a, b) of the forward (``--kv-export-layer-group``
layers per group): on GPU the group's K/V writes are queued on the compute stream ahead of anything the sink
queues on a side stream after waiting for it; on CPU they are done. Groups come in order and cover every
layer exactly once; the last ends at the model's layer count. A forward that raises calls ``abandon()``
instead of the remaining groups. Decode CUDA graphs never carry sinks (the engine plans groups for
multi-token chunks only, and a model without the hook gets every group at once after its forward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from services.engine.scheduler import ScheduledChunk


class LayerSink(Protocol):
    def group_done(self, first_layer: int, end_layer: int) -> None:
        """Engine thread: layers [first_layer, end_layer) of the chunk are computed (GPU: queued)."""

    def abandon(self) -> None:
        """Engine thread: the forward failed; no further group comes."""


LayerListener = Callable[["ScheduledChunk"], "LayerSink | None"]
"""Called before the model call for each chunk of a step (engine thread; blocks held, nothing computed)."""


class LayerGroups:
    """One forward's sinks, called after every ``size`` layers (the last group may be shorter)."""

    def __init__(self, sinks: list[LayerSink], num_layers: int, size: int) -> None:
        assert sinks and num_layers > 0 and size > 0
        self.sinks, self.num_layers, self.size = sinks, num_layers, size
        self.next = 0
        """First layer not yet handed to the sinks."""

    def after_layer(self, layer: int) -> None:
        """The model's hook: layer ``layer`` (0-based) was launched."""
        end = layer + 1
        if end - self.next >= self.size or end == self.num_layers:
            self._hand(end)

    def _hand(self, end: int) -> None:
        first, self.next = self.next, end
        for sink in self.sinks:
            sink.group_done(first, end)

    @contextlib.contextmanager
    def hooked(self, model: torch.nn.Module) -> Iterator[None]:
        """Hook ``model``'s layer loop for one forward (a model without ``layer_hook`` gets all groups after it)."""
        has_hook = hasattr(model, "layer_hook")
        if has_hook:
            model.layer_hook = self.after_layer
        try:
            yield
        except BaseException:
            for sink in self.sinks:
                sink.abandon()
            raise
        finally:
            if has_hook:
                model.layer_hook = None
        while self.next < self.num_layers:  # a forward that never reached the hook (or its last layers)
            self._hand(min(self.num_layers, self.next + self.size))


def plan(listeners: list[LayerListener], chunks: list[ScheduledChunk], num_layers: int, size: int
         ) -> LayerGroups | None:
    """The step's layer groups, or None when no listener wants a chunk (or the setting is off: ``size`` 0).
    Only multi-token chunks (prefill) are offered: decode steps and their CUDA graphs never change. A listener
    that raises fails the step: the sinks made before it are abandoned first (as when the forward fails)."""
    if not listeners or size <= 0:
        return None
    sinks: list[LayerSink] = []
    try:
        for ch in chunks:
            for lis in listeners if ch.num_new_tokens > 1 else ():
                if (s := lis(ch)) is not None:
                    sinks.append(s)
    except BaseException:
        for s in sinks:
            s.abandon()
        raise
    return LayerGroups(sinks, num_layers, size) if sinks else None
