"""The decode CUDA graphs' host rows (services/engine/cuda/cuda_graphs.py `fill_decode_rows`), on CPU arrays: every
row the graph runs, padding included, holds a valid token id, even after an async step's placeholder
(PLACEHOLDER_TOKEN, patched on the device only) sat in a row that is padding now."""

from __future__ import annotations

import numpy as np

from services.engine.cuda.cuda_graphs import fill_decode_rows
from services.engine.scheduler import PLACEHOLDER_TOKEN
from services.engine.sequence import Sequence
from services.text.sampling_params import SamplingParams

BLOCK = 4
BUCKET = 4


def _seq(tokens: list[int], blocks: list[int]) -> Sequence:
    s = Sequence(token_ids=tokens, params=SamplingParams(max_tokens=8), block_table=blocks)
    s.num_computed_tokens = len(tokens) - 1  # its last token is the one this step decodes
    return s


def _arrays() -> tuple[list[tuple[int, int]], np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    return ([(-1, -1)] * BUCKET, np.zeros(BUCKET, np.int64), np.zeros(BUCKET, np.int64), np.zeros(BUCKET, np.int64),
            np.zeros(BUCKET, np.int32), np.zeros((BUCKET, 8), np.int32))


def test_padding_rows_never_keep_a_placeholder_id() -> None:
    rows, ids, pos, slots, ctx, tables = _arrays()
    full = [_seq([5, 6, 7, PLACEHOLDER_TOKEN], [0]), _seq([1, 2, PLACEHOLDER_TOKEN], [1]),
            _seq([9, PLACEHOLDER_TOKEN], [2])]
    fill_decode_rows(full, BUCKET, BLOCK, rows, ids, pos, slots, ctx, tables)
    assert ids[:3].tolist() == [PLACEHOLDER_TOKEN] * 3  # the device patch replaces these before the replay
    fill_decode_rows(full[:1], BUCKET, BLOCK, rows, ids, pos, slots, ctx, tables)  # two requests finished
    assert ids[1:].tolist() == [0, 0, 0] and slots[1:].tolist() == [-1, -1, -1] and ctx[1:].tolist() == [0, 0, 0]
    assert pos[0] == 3 and slots[0] == 3 and ctx[0] == 4
