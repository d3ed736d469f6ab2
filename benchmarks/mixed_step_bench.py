"""Mixed steps on one GPU: decode throughput and prompt TTFT while prompts keep arriving, per
--mixed-step-interval (1: every step may mix prompt chunks with decodes and runs eagerly; N > 1: prompt
chunks join one step in N, the steps between replay the decode CUDA graphs).

    python3 benchmarks/mixed_step_bench.py --out "$OUT/mixed_step.json" [--intervals 1,2,4,8] [--batch 64,256]

For each (batch B, interval N): B sequences decode (ignore_eos, long outputs); every --arrival-steps steps a
new --prompt-tokens prompt arrives (max_tokens 1: its first token is its TTFT). Reports decode tokens/s of
the B sequences, TTFT p50/p90 of the prompts (wall, from add_request to the first token), the share of
steps that replayed a graph, all measured in the same process against interval 1 (ratios printed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.text.sampling_params import SamplingParams

MODEL = "random:llama-3-8b"


def run(engine: LLMEngine, graphed: list[int], batch: int, interval: int, ns: argparse.Namespace) -> dict[str, Any]:
    engine.scheduler.config.mixed_step_interval = interval  # the one engine serves every run (one load)
    vocab = engine.vocab_size
    g = torch.Generator().manual_seed(0)
    decode = SamplingParams(max_tokens=ns.steps + 64, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", torch.randint(0, vocab, (ns.context,), generator=g).tolist(), decode,
                           detokenize=False)
    while any(engine.requests[f"d{i}"].seq.num_output_tokens == 0 for i in range(batch)):
        engine.step()  # every decoder has its first token: the window starts in steady decode
    arrivals: dict[str, float] = {}
    ttft: list[float] = []
    decode_tokens, steps, graphed[0] = 0, 0, 0
    t0 = time.perf_counter()
    for step in range(ns.steps):
        if step % ns.arrival_steps == 0:
            rid = f"p{step}"
            engine.add_request(rid, torch.randint(0, vocab, (ns.prompt_tokens,), generator=g).tolist(),
                               SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), detokenize=False)
            arrivals[rid] = time.perf_counter()
        for o in engine.step():
            if o.request_id.startswith("d"):
                decode_tokens += len(o.new_token_ids)
            elif o.request_id in arrivals:
                ttft.append(time.perf_counter() - arrivals.pop(o.request_id))
        steps += 1
    wall = time.perf_counter() - t0
    for rid in list(engine.requests):
        engine.abort(rid)
    q = statistics.quantiles(ttft, n=10) if len(ttft) >= 2 else [float("nan")] * 9
    return {"batch": batch, "interval": interval, "steps": steps, "wall_s": wall,
            "decode_tok_s": decode_tokens / wall, "graphed_share": graphed[0] / steps, "prompts_done": len(ttft),
            "ttft_p50_ms": 1e3 * statistics.median(ttft) if ttft else None, "ttft_p90_ms": 1e3 * q[8]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="mixed_step.json")
    p.add_argument("--intervals", default="1,2,4,8")
    p.add_argument("--batch", default="64,256")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens of the decoding sequences")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="tokens of each arriving prompt")
    p.add_argument("--arrival-steps", type=int, default=8, help="a prompt arrives every this many steps")
    p.add_argument("--steps", type=int, default=200, help="measured steps per run")
    ns = p.parse_args()
    batches = [int(x) for x in ns.batch.split(",")]
    engine = LLMEngine(EngineConfig(model=MODEL, dtype="bfloat16", device="cuda",
                                    max_model_len=max(ns.context, ns.prompt_tokens) + ns.steps + 128,
                                    max_num_seqs=max(batches) + ns.steps // ns.arrival_steps + 8))
    graphed = [0]
    replay = engine.runner._execute_graph

    def counted(chunks, bucket):  # count the steps that replayed a decode graph
        graphed[0] += 1
        return replay(chunks, bucket)

    engine.runner._execute_graph = counted
    rows = []
    for b in batches:
        for n in (int(x) for x in ns.intervals.split(",")):
            r = run(engine, graphed, b, n, ns)
            rows.append(r)
            print(json.dumps(r), flush=True)
    base = {r["batch"]: r for r in rows if r["interval"] == 1}
    print(f"{'B':>4s} {'N':>3s} {'decode tok/s':>12s} {'vs N=1':>7s} {'graphed':>8s} {'TTFT p50':>9s} {'p90':>7s}")
    for r in rows:
        b = base.get(r["batch"])
        ratio = f"{r['decode_tok_s'] / b['decode_tok_s']:.2f}" if b else "-"
        print(f"{r['batch']:4d} {r['interval']:3d} {r['decode_tok_s']:12.0f} {ratio:>7s} {r['graphed_share']:8.2f} "
              f"{r['ttft_p50_ms'] or float('nan'):9.1f} {r['ttft_p90_ms']:7.1f}")
    Path(ns.out).write_text(json.dumps({"model": MODEL, "args": vars(ns), "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
