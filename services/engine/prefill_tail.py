"""The prefill tail rule: how a prompt whose KV streams out is cut near its end.

A prefill that streams KV (chunked transfer on) sends each chunk's pages while the next chunk computes,
so only the LAST chunk's transfer is exposed after compute ends. The rule shrinks that last chunk: once
at most ``2 * max_prefill_chunk`` tokens remain, each piece is half of what remains (rounded up to whole
KV blocks, so every piece but the last ends on a page boundary and its pages leave at once), until at
most ``floor`` tokens remain; those are the last piece. The exposed transfer is then that of <= ``floor``
tokens instead of up to ``max_prefill_chunk``.

Why halving: piece i's transfer (t s/token * n_i) must end before piece i+1's compute (c s/token *
n_{i+1}) does, i.e. n_{i+1} / n_i >= t / c. Halving (ratio 1/2) hides it while t <= c / 2. Figures
(docs/reports/performance-history-2026-12-01.md, random Llama-3-8B on one H200): c ~ 31 us/token at 8K (248 ms / 8000 tokens);
fp8-e4m3 KV is 67.6 KB/token, so t <= c / 2 needs >= 4.4 GB/s (bf16, 131 KB/token: >= 8.5 GB/s). Below
that a backlog builds up, but the same bytes start moving earlier than they would unsplit, so
splitting exposes no more than not splitting (bar one step's overhead per extra piece). A floor of 256 tokens is 17 MB of fp8 KV (~5 ms at 3.2 GB/s, one
TCP engine), under the goal of <= 5% of 8K compute (~12.5 ms); smaller pieces stop paying: one step of
an 8B model reads its 16 GB of weights (~3.5 ms on an H200) whatever the piece size, and the engine
thread takes ~14 ms to launch one eager step (~23 ms while transfer engines run on the same host), so
pieces under ~600-1000 tokens are launch-bound (``applies``; benchmarks/tail_probe.py). Floor 1024 at
8K measured TTFT 1.12x colocated against 1.16x at 256 but exposed 6.2% of compute against 4.4%.
"""

from __future__ import annotations


def tail_piece(remaining: int, floor: int, block_size: int) -> int:
    """Tokens of the next piece when ``remaining`` prompt tokens are left to compute (before the chunk
    and step-budget caps). ``floor`` <= 0: the rule is off (everything that remains)."""
    if floor <= 0 or remaining <= floor:
        return remaining
    half = -(-remaining // 2)
    return min(remaining, -(-half // block_size) * block_size)


# Which streams get the rule: those whose writer overlaps compute (``PageWriter.overlaps_compute``: the
# mooncake writers, the tensor-parallel rank-to-rank one over mooncake included). Measured on the H200 at 8K
# tokens, chunked, tail 256 (docs/reports/performance-history-2026-12-01.md): mooncake
# (network, host-staged) exposed 12.0 ms instead of 41.8 (fp8); cuda-ipc already exposes ~3.5 ms without
# it and the extra pieces only added compute (292.7 ms against 256.4, TTFT 1.20x against 1.06x
# colocated); grpc is bound by its byte rate, where the cut changes nothing but adds pieces (compute
# 1.14x in-process). A tensor-parallel rank-to-rank writer (parallel/rank_writes.py) starts each rank's
# writes on the engine threads and waits for them in the pump's worker thread: over mooncake its bytes move
# while the next chunk computes (cut); over shm / cuda-ipc the copies run in the start (no cut, as cuda-ipc).


def applies(prompt_tokens: int, max_chunk: int) -> bool:
    """The rule cuts only prompts longer than one chunk. Measured on the H200 (docs/reports/performance-history-2026-12-01.md,
    "Tail pieces at 2K"; random Llama-3-8B, mooncake fp8, 8 engines per side): one eager step takes the
    engine thread ~14 ms to launch (~23 ms while transfer engines move KV on the same host) and a piece
    computes at ~23 us/token, so a piece under ~600-1000 tokens is bound by its launch, not by the GPU.
    A 2000-token prompt cut at floor 256 (1008, 496, 256, 240) computed in 62-77 ms with no transfer at
    all (benchmarks/tail_probe.py) against 48-50 uncut; cut in two halves (floor 1024) its P/D TTFT was
    81.7 ms (compute 60.9) against 74.8 uncut (compute 47.2), in one run."""
    return prompt_tokens > max_chunk


def prefill_pieces(prompt_tokens: int, max_chunk: int, floor: int, block_size: int) -> list[int]:
    """The piece sizes one prompt alone in the batch is computed in (budget >= max_chunk)."""
    if not applies(prompt_tokens, max_chunk):
        floor = 0
    pieces: list[int] = []
    left = prompt_tokens
    while left > 0:
        n = min(max_chunk, tail_piece(left, floor, block_size))
        pieces.append(n)
        left -= n
    return pieces
