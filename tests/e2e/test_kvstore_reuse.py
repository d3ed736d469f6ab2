"""Multi-turn replay on 2 prefills: with the kvstore, pages one prefill wrote are loaded by the other
(counted), outputs equal the store-off run token for token, and later turns compute less."""

from __future__ import annotations

import json
import statistics
import time
import urllib.request

import pytest

from services.launcher import LocalCluster
from tests.e2e.cluster_util import metric_sum

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct.Q4_1"
TURNS = 4
FACTS = ("Rivers carry water from the mountains to the sea, shaping valleys, feeding farms and towns, and "
         "giving homes to fish, birds and plants along their banks through every season of the year. ")


def _stream_turn(http: str, messages: list[dict]) -> tuple[float, str]:
    """(TTFT seconds, text) of one streamed chat turn."""
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0,
                       "stream": True}).encode()
    req = urllib.request.Request(f"http://{http}/v1/chat/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    text = ""
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk["choices"]:
                delta = ch["delta"].get("content") or ""
                if delta and ttft is None:
                    ttft = time.perf_counter() - t0
                text += delta
    assert ttft is not None
    return ttft, text


def _replay(kvstore: str | None) -> tuple[list[float], list[str], LocalCluster, dict]:
    extra = {"router": ["--policy", "round_robin"], "prefill": ["--kv-cache-bytes", str(256 << 20)],
             "decode": ["--kv-cache-bytes", str(256 << 20)]}
    with LocalCluster(prefill=2, decode=1, kvstore=kvstore, extra=extra, quiet=True) as c:
        http = c.router["http"]
        _stream_turn(http, [{"role": "user", "content": "warm up"}])  # first-call costs out of the timings
        messages: list[dict] = []
        ttfts, texts = [], []
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"Part {turn}. {FACTS * 3} What follows from part {turn}?"})
            ttft, text = _stream_turn(http, messages)
            ttfts.append(ttft)
            texts.append(text)
            messages.append({"role": "assistant", "content": text})
            time.sleep(0.5)  # write-back is asynchronous: let it land before the next turn
        counts = {}
        for i in range(2):
            m = c.get(f"prefill-{i}").ready["metrics"]
            counts[f"prefill-{i}"] = {
                "kvstore": metric_sum(m, "pdserve_prefill_cached_prefix_tokens_total", source="kvstore"),
                "computed": metric_sum(m, "pdserve_prefill_computed_tokens_total"),
            }
        if kvstore:
            counts["hits"] = metric_sum(c.get("kvstore").ready["metrics"], "pdserve_kvstore_hits_total")
        return ttfts, texts, c, counts


def test_multi_turn_replay_reuses_pages_across_prefills():
    off_ttft, off_text, _, off = _replay(None)
    on_ttft, on_text, _, on = _replay("embedded")
    assert on_text == off_text  # token for token (greedy; same text from the same tokens)
    # Round-robin alternates prefills: each turn's prefix was computed by the OTHER prefill, so reuse
    # can only come through the kvstore.
    assert on["prefill-0"]["kvstore"] > 0 and on["prefill-1"]["kvstore"] > 0
    assert on["hits"] > 0
    assert off["prefill-0"]["kvstore"] == off["prefill-1"]["kvstore"] == 0
    on_computed = on["prefill-0"]["computed"] + on["prefill-1"]["computed"]
    off_computed = off["prefill-0"]["computed"] + off["prefill-1"]["computed"]
    assert on_computed < off_computed
    later_off, later_on = statistics.median(off_ttft[2:]), statistics.median(on_ttft[2:])
    print(f"\nmulti-turn replay, TTFT per turn (s): store off {[round(t, 3) for t in off_ttft]}"
          f"\n                                     store on  {[round(t, 3) for t in on_ttft]}"
          f"\nmedian TTFT of turns 3..{TURNS}: off {later_off:.3f}s, on {later_on:.3f}s "
          f"({later_off / later_on:.2f}x); prompt tokens computed: off {off_computed:.0f}, on {on_computed:.0f}")
