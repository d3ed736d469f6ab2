"""The channel between a service's front process and its engine-core process: typed frames over a Unix
socket pair the front creates (never a listening socket, never pickle).

A frame is ``<u32 body length><u32 payload length>``, a msgpack body (a list whose first item is the frame
type), then the raw payload (page bytes, PAGES frames only). Both lengths are bounded; a frame that breaks
a bound or does not parse ends the channel (:class:`WireError`), and the peer sees the channel close.

Front -> core: CONFIG (first: the engine config, logging and the core's role), ADD, RESERVE, IMPORT_DONE,
ABORT, PAGES, TRACE, and a prefill's PREFIX, ADMIT (its kvstore pages as the payload), RELEASE (each with a call
id answered by one REPLY), TAKEN (a prefill front has read the pages of the chunks an OUT frame announced), STOP.
Core -> front: HELLO (the model's fixed facts, once loaded) or FATAL (why the core cannot run, then it exits),
OUT (one step's outputs of every request, the step's record and, from a prefill core, the chunks it computed),
STATS, REPLY.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from services.engine.engine import RequestOutput
from services.engine.sequence import FinishReason
from services.text.sampling_params import Sampled, SamplingParams, TopLogprobs

# Front -> core
CONFIG, ADD, RESERVE, IMPORT_DONE, ABORT, PAGES, TRACE, STOP = range(8)
PREFIX, ADMIT, RELEASE, TAKEN = range(8, 12)
"""A prefill core's: cached prefix blocks of a prompt; admit a prompt (with kvstore pages); free the blocks held
past a prompt's end; the pages of the last OUT frame's chunks are read."""
# Core -> front
HELLO, FATAL, OUT, STATS, REPLY = range(100, 105)

HEADER = struct.Struct("<II")
MAX_BODY = 64 << 20
"""Largest msgpack body (bytes): a step's outputs of thousands of requests with top logprobs fit many times."""
MAX_PAYLOAD = 4 << 30
"""Largest page payload of one PAGES frame (bytes)."""
SOCKET_BUFFER = 4 << 20
"""SO_SNDBUF / SO_RCVBUF asked for on both ends (bytes)."""


class WireError(RuntimeError):
    """A frame broke the channel's format (the channel is closed after it)."""


def tune(sock: socket.socket) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:  # a smaller limit (net.core.wmem_max) is fine
            pass


def encode(body: list[Any], payload: bytes | memoryview = b"") -> list[bytes | memoryview]:
    """The parts of one frame, to be written in order."""
    packed = msgpack.packb(body, use_bin_type=True)
    if len(packed) > MAX_BODY or len(payload) > MAX_PAYLOAD:
        raise WireError(f"frame too large: body {len(packed)} bytes (max {MAX_BODY}), payload {len(payload)} "
                        f"bytes (max {MAX_PAYLOAD})")
    return [HEADER.pack(len(packed), len(payload)), packed, payload] if len(payload) else \
        [HEADER.pack(len(packed), 0) + packed]


def decode_header(header: bytes) -> tuple[int, int]:
    n, p = HEADER.unpack(header)
    if n > MAX_BODY or p > MAX_PAYLOAD or n == 0:
        raise WireError(f"bad frame header: body {n} bytes, payload {p} bytes")
    return n, p


def decode_body(body: bytes) -> list[Any]:
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=True)
    except Exception as e:  # msgpack raises several types for malformed input
        raise WireError(f"frame body does not parse: {e}") from None
    if not isinstance(msg, list) or not msg or not isinstance(msg[0], int):
        raise WireError("frame body is not a typed list")
    return msg


class BlockingChannel:
    """The core's end: blocking sends (one lock: the step loop and the reader thread both send) and
    receives (the reader thread only)."""

    def __init__(self, sock: socket.socket) -> None:
        import threading

        self.sock = sock
        tune(sock)
        self._send_lock = threading.Lock()

    def send(self, body: list[Any], payload: bytes | memoryview = b"") -> None:
        parts = encode(body, payload)
        with self._send_lock:
            for part in parts:
                self.sock.sendall(part)

    def _exactly(self, n: int) -> bytearray | None:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                return None
            got += k
        return buf

    def recv(self) -> tuple[list[Any], bytearray] | None:
        """The next frame (body, payload), or None once the peer closed the channel."""
        header = self._exactly(HEADER.size)
        if header is None:
            return None
        n, p = decode_header(bytes(header))
        body = self._exactly(n)
        payload = self._exactly(p) if p else bytearray()
        if body is None or payload is None:
            return None
        return decode_body(bytes(body)), payload


# --- typed values ---

def params_to_wire(p: SamplingParams) -> list[Any]:
    return [p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed, list(p.stop), list(p.stop_token_ids),
            p.ignore_eos, p.logprobs, p.top_logprobs]


def params_from_wire(v: list[Any]) -> SamplingParams:
    (max_tokens, temperature, top_k, top_p, seed, stop, stop_ids, ignore_eos, logprobs, top_logprobs) = v
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                          stop=stop, stop_token_ids=stop_ids, ignore_eos=ignore_eos, logprobs=logprobs,
                          top_logprobs=top_logprobs)


def top_to_wire(t: TopLogprobs | None) -> list[Any] | None:
    return None if t is None else [list(t.token_ids), list(t.logprobs)]


def top_from_wire(v: list[Any] | None) -> TopLogprobs | None:
    return None if v is None else TopLogprobs(tuple(v[0]), tuple(v[1]))


def output_to_wire(o: RequestOutput) -> list[Any]:
    tops = o.new_top_logprobs
    return [o.request_id, o.new_token_ids, o.new_text, o.new_logprobs,
            [top_to_wire(t) for t in tops] if tops else tops, o.finished,
            o.finish_reason.value if o.finish_reason is not None else None, o.num_prompt_tokens,
            o.num_cached_tokens, o.num_output_tokens, o.first_token_time, o.spec_proposed, o.spec_accepted,
            o.spec_synthetic]


_FINISH = {r.value: r for r in FinishReason}


def output_from_wire(v: list[Any]) -> RequestOutput:
    (rid, ids, text, lps, tops, finished, reason, n_prompt, n_cached, n_out, first_t, proposed, accepted,
     synthetic) = v
    return RequestOutput(rid, ids, text, lps, [top_from_wire(t) for t in tops] if tops else tops, finished,
                         _FINISH[reason] if reason is not None else None, n_prompt, n_cached, n_out, first_t,
                         proposed, accepted, synthetic)


# --- a prefill core's computed chunks ---

@dataclass
class ChunkSeq:
    """What a prefill front reads of a computed chunk's sequence (Sequence's fields of those names)."""

    request_id: str
    num_computed_tokens: int
    """Tokens computed before the chunk."""
    num_cached_tokens: int
    block_table: list[int]


@dataclass
class ComputedChunk:
    """A chunk a prefill core computed, as its front's chunk listeners read it (ScheduledChunk's fields)."""

    seq: ChunkSeq
    num_new_tokens: int
    sample: bool
    """The prompt's last chunk: the first token was sampled."""


def chunk_to_wire(seq: Any, num_new_tokens: int, sample: bool, sampled: Sampled | None) -> list[Any]:
    s = None if sampled is None else [sampled.token, sampled.logprob, top_to_wire(sampled.top)]
    return [seq.request_id, seq.num_computed_tokens, seq.num_cached_tokens, list(seq.block_table), num_new_tokens,
            sample, s]


def chunk_from_wire(v: list[Any]) -> tuple[ComputedChunk, Sampled | None]:
    rid, computed, cached, table, n, sample, s = v
    chunk = ComputedChunk(ChunkSeq(str(rid), int(computed), int(cached), [int(b) for b in table]), int(n), bool(sample))
    return chunk, None if s is None else Sampled(int(s[0]), s[1], top_from_wire(s[2]))
