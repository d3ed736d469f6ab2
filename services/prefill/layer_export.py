"""The prefill's layer listener: a request's last chunk leaves layer group by layer group while it computes.

One :class:`LayerExports` per engine (``exports_of``) sits in ``LLMEngine.layer_listeners``. A request's
stream is watched from its claim on, by the engine request id its sender was opened for (exact: the same id
the engine schedules it under). Before the forward of a watched request's last chunk (engine thread), when
its writer can send by layer group (``PageWriter.start_groups``: mooncake through host staging, native codec)
and its claim was sent, the pages ``on_chunk`` would write are handed to such a write instead (it stages
them at once, and submits nothing before decode acknowledged the claim); ``on_chunk`` then takes its handle
(``armed``) where it would have started the write, or deferred it for the claim. Otherwise nothing changes:
the chunk is written once computed, as before. An early request whose reservation (its writer) arrives after
its last chunk started computing cannot take this path.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import TYPE_CHECKING

from services.engine.kv_transport.base import KVSender
from services.engine.layer_groups import LayerSink
from services.engine.scheduler import ScheduledChunk

if TYPE_CHECKING:
    from services.engine.engine import LLMEngine
    from services.prefill.kv_stream import RequestKVStream


class LayerExports:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: weakref.WeakValueDictionary[str, RequestKVStream] = weakref.WeakValueDictionary()
        """Engine request id -> its stream (an entry ends with the stream)."""
        self._armed: weakref.WeakKeyDictionary[RequestKVStream, tuple[int, int, int, object]] = \
            weakref.WeakKeyDictionary()
        """stream -> (seq id, first block, block limit, write handle) of the write armed for its last chunk. The
        value never reaches the stream (the sink reads it through a weak reference), so an entry that ``take``
        never popped (the step raised) ends with the stream."""

    def watch(self, request_id: str, stream: RequestKVStream) -> None:
        with self._lock:
            self._streams[request_id] = stream

    def __call__(self, ch: ScheduledChunk) -> LayerSink | None:
        """Engine thread, before the step's forward (layer_groups.LayerListener)."""
        if not ch.sample:
            return None
        with self._lock:
            stream = self._streams.get(ch.seq.request_id)
        writer = None if stream is None else stream.writer
        start = getattr(writer, "start_groups", None)
        if stream is None or start is None or stream.claim_task is None or stream.ending:
            return None
        seq = ch.seq
        first, limit = stream.next_block, -(-(seq.num_computed_tokens + ch.num_new_tokens) // stream.block_size)
        if limit <= first:
            return None
        ref = weakref.ref(stream)
        try:
            sink = start(first, seq.block_table[first:limit], lambda: _cleared(ref()), stream.claim_wait_s)
        except Exception:  # the chunk's own write (on_chunk) meets the same condition and reports it
            return None
        if sink is not None:
            with self._lock:
                self._armed[stream] = (seq.seq_id, first, limit, sink.handle)
            wake = getattr(sink, "wake", None)
            if wake is not None:  # the claim's answer ends the sink's wait at once (it polls slowly otherwise)
                task = stream.claim_task
                with contextlib.suppress(RuntimeError):  # a closed loop: the request is ending anyway
                    stream.loop.call_soon_threadsafe(lambda: task.add_done_callback(lambda _: wake()))
        return sink

    def take(self, stream: RequestKVStream, ch: ScheduledChunk, first: int, limit: int) -> object | None:
        """Engine thread (``on_chunk``): the handle of the write armed for this chunk's pages, or None."""
        with self._lock:
            armed = self._armed.pop(stream, None)
        if armed is None:
            return None
        if armed[:3] != (ch.seq.seq_id, first, limit):  # on_chunk computes the same range: a bug if not
            raise RuntimeError(f"layer-group write armed for {armed[:3]}, chunk wants {(ch.seq.seq_id, first, limit)}")
        return armed[3]


def _cleared(stream: RequestKVStream | None) -> bool | None:
    """Any thread: True once decode acknowledged the stream's claim, False once it never will (or the stream is
    gone), None meanwhile."""
    if stream is None:
        return False
    if stream.claim_ok:
        return True
    task = stream.claim_task
    return False if stream.ending or task is None or task.done() else None


def _registered(engine: LLMEngine) -> LayerExports | None:
    """This module's listener among the engine's layer listeners, if one was registered."""
    return next((x for x in engine.layer_listeners if isinstance(x, LayerExports)), None)


def exports_of(engine: LLMEngine) -> LayerExports:
    """The engine's layer listener of this module (registered once, in ``engine.layer_listeners``)."""
    exports = _registered(engine)
    if exports is None:
        exports = LayerExports()
        engine.layer_listeners.append(exports)
    return exports


def watch(stream: RequestKVStream, sender: KVSender) -> None:
    """From the claim on, the stream's last chunk may leave layer group by layer group (module docstring)."""
    eng = None if stream.engine is None else stream.engine.llm
    if eng is not None and sender.request_id and getattr(eng, "layer_group", 0):
        exports_of(eng).watch(sender.request_id, stream)


def armed(stream: RequestKVStream, ch: ScheduledChunk, first: int, limit: int) -> object | None:
    """Engine thread: the layer-group write armed for the chunk's pages [first, limit), or None."""
    eng = None if stream.engine is None else stream.engine.llm
    exports = None if eng is None else _registered(eng)
    return None if exports is None else exports.take(stream, ch, first, limit)
