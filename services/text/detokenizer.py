"""Streaming text out of a token stream: UTF-8-safe deltas and stop strings that span deltas."""

from __future__ import annotations

from collections.abc import Sequence

from services.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5
"""Prompt tokens decoded in front of the output so leading-space / merge context matches a full decode."""


class IncrementalDetokenizer:
    """`add(token_id) -> delta`: the concatenated deltas equal `decode(output_ids)` (special tokens skipped).

    Invariant: text is emitted only once the decoded window ends in a complete character, i.e. never
    while it ends in U+FFFD (a partial multi-byte UTF-8 sequence); `flush()` releases what is held.
    Cost per token is O(window), independent of the output length.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids)
        # ids[prefix_offset:read_offset] decode to text already emitted (or prompt context);
        # ids[read_offset:] are held back.
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - _CONTEXT_TOKENS, 0)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT) or not full.startswith(prefix):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever is still held (at the end of generation), even if it is an incomplete character."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        delta = full[len(prefix):] if full.startswith(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


class StopChecker:
    """Feeds text deltas, emits text safe to show, and stops at the earliest stop string.

    Invariants: emitted text never contains a stop string nor anything after one; text is held back
    only while its tail is a proper prefix of some stop string (at most max(len(stop)) - 1 chars).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._buffer = ""
        self.stopped = False
        self.matched: str | None = None
        """The stop string that ended the output."""

    def feed(self, delta: str) -> str:
        """Returns the text to emit now; after a stop, sets `stopped` and returns ''."""
        if self.stopped:
            return ""
        buf = self._buffer + delta
        hits = [(i, -len(s), s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            idx, _, stop = min(hits)
            self.stopped, self.matched, self._buffer = True, stop, ""
            return buf[:idx]
        keep = 0
        for k in range(min(self.max_hold, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        self._buffer = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """At the end of generation without a stop: release the held tail."""
        out, self._buffer = ("" if self.stopped else self._buffer), ""
        return out
