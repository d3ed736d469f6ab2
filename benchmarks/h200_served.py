"""One-H200 serving run: the in-process engine, `pdserve up` colocated and 1P1D over cuda-ipc, and the
bandwidth ceiling, at the same shapes and concurrencies, in one call. Writes ``h200_served.json`` under
--out; ``benchmarks/h200_served_plot.py`` draws throughput per GPU against TPOT from it (on any host with
matplotlib).

    python3 benchmarks/h200_served.py --out "$OUT"                       # everything, within --budget-s
    python3 benchmarks/h200_served.py --out "$OUT" --modes engine --shapes 1024x256 --concurrency 64,256

Model: random:llama-3-8b in bf16 (no download). Points whose prompts exceed --max-prompt-tokens in all (8192x256
at C256 and C512 by default) are skipped with that reason. Each point sends max(C, --min-requests) requests of exactly
``in`` prompt tokens and ``out`` output tokens (ignore_eos, greedy), logprobs off and/or on (the chosen token's
logprob). Engine points add every request at once and step until done (the C requests run as one batch when
C <= max_num_seqs). Served points run `pdserve bench serve` against the started cluster. Points run in the
order engine, colocated, 1p1d, shape by shape; a point that would start after --budget-s is recorded as
skipped, so a trimmed rerun (--modes/--shapes/--concurrency/--logprobs) fills it in.

Before a shape's measured points, the engine phase and each cluster run one unmeasured point (--warmup-prompt-tokens):
step shapes met for the first time pay Triton's compiles and the libraries' first calls, which otherwise landed on
whichever measured point ran first.

The ceiling: a 1 GiB device copy (read + write bytes / time) measured in this run; a decode step's
bandwidth limit is (weight bytes + batch x context x KV bytes per token) / that bandwidth.

The 1P1D time-sharing ceiling: a prefill process and a decode process on one GPU take turns on it, and no decode
row rides on a prompt's weight reads as it does in one engine's mixed step. So 1P1D on one GPU can serve at most
R x out tokens in R x (one prompt's prefill, measured alone in the engine phase: prompts only, one output token
each) + R x out / batch x (the engine's full-batch decode step at the point's batch), the best case where decode
always runs full batches. 1P1D rows are divided by it beside the engine ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BENCH_TOKENIZER = "byte"
"""bench serve's client tokenizer: the byte-level one random models serve with, so a prompt is cut to exactly
``in`` tokens as the engine phase's are (with ``none`` the client sized prompts in words, which the byte-level
tokenizer counts as ~4.7x as many tokens) and the run needs no model package on the GPU host."""
PROMPT_TOLERANCE = 0.02
"""A served point whose prompts average more than this fraction below ``in`` tokens (the server's usage counts)
gets no served/engine ratio: it did less work than the engine phase."""
PROMPT_WRAPPER = 0.05
"""...or more than this fraction above it. The completions transcript ("User: ...\nAssistant:") adds ~34 tokens to
a 1024-token prompt; a served point that prefilled that much more than the engine phase still gets its ratio,
which then understates the served path."""
MODEL = "random:llama-3-8b"
MAX_MODEL_LEN = 9216
"""Context of every engine: the 8192/256 shape plus room (keeps the decode graphs' block tables small)."""


def log(msg: str) -> None:
    print(f"[h200_served {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _shape(text: str) -> tuple[int, int]:
    a, b = text.lower().split("x")
    return int(a), int(b)


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/h200_served"), help="output directory ($OUT)")
    p.add_argument("--model", default=MODEL, help="model spec every engine loads (random:NAME gives real sizes)")
    p.add_argument("--modes", default="engine,colocated,1p1d", help="subset of engine,colocated,1p1d")
    p.add_argument("--shapes", default="1024x256,8192x256", help="INxOUT prompt/output tokens, comma-separated")
    p.add_argument("--concurrency", default="1,16,64,256,512")
    p.add_argument("--logprobs", default="off,on", help="off, on, or off,on")
    p.add_argument("--async-scheduling", default="off", choices=("off", "on"),
                   help="every engine's --async-scheduling (the in-process engine's and the served decodes')")
    p.add_argument("--engine-core", default="thread,process",
                   help="served modes run with each decode --engine-core given (thread, process, or both); a "
                        "process row's mode is named MODE/process")
    p.add_argument("--prefill-engine-core", default="auto", choices=("auto", "thread", "process"),
                   help="the 1P1D prefill's --engine-core (auto: an engine-core process; thread: beside its front)")
    p.add_argument("--decode-args", default="",
                   help="more flags for the served decode (or colocated worker), e.g. '--mixed-step-interval 8'; "
                        "the rows' mode names them")
    p.add_argument("--min-requests", type=int, default=4, help="requests per point: max(C, this)")
    p.add_argument("--max-prompt-tokens", type=int, default=600_000,
                   help="skip points whose requests carry more prompt tokens than this (8192x256 at C256/C512: "
                        "run them in a call of their own with a larger value)")
    p.add_argument("--budget-s", type=float, default=540.0, help="start no point after this many seconds")
    p.add_argument("--warmup-prompt-tokens", type=int, default=300_000,
                   help="before a shape's measured points, in the engine phase and on each cluster: one unmeasured "
                        "point of min(largest C, 256, this / in) requests with 4 output tokens and logprobs, so the "
                        "step shapes met first (Triton variants, cuDNN plans) are not paid by the first measured "
                        "point (0: none)")
    p.add_argument("--prefill-utilization", type=float, default=0.3,
                   help="1p1d on one GPU: the prefill engine's --gpu-memory-utilization (decode gets 0.9 minus it)")
    p.add_argument("--engine-child", default="", help=argparse.SUPPRESS)  # internal: run the engine phase, write JSON
    ns = p.parse_args(argv)
    ns.shapes_l = [_shape(s) for s in ns.shapes.split(",") if s]
    ns.conc_l = [int(c) for c in ns.concurrency.split(",") if c]
    ns.lp_l = [v.strip() == "on" for v in ns.logprobs.split(",") if v]
    ns.modes_l = [m for m in ns.modes.split(",") if m]
    ns.decode_args_l = shlex.split(ns.decode_args)
    bad = set(ns.modes_l) - {"engine", "colocated", "1p1d"}
    if bad:
        p.error(f"--modes: unknown {sorted(bad)} (engine, colocated, 1p1d)")
    return ns


# --- engine phase (a child process: its device memory is gone before the clusters start) ---

def ceiling() -> dict[str, float]:
    import torch
    import triton.testing

    x = torch.empty(2**29, dtype=torch.bfloat16, device="cuda").normal_()  # 1 GiB
    ms = float(triton.testing.do_bench(lambda: x.clone(), warmup=25, rep=200, return_mode="median"))
    return {"copy_ms_1GiB": ms, "copy_GBps": 2 * 2**30 / ms / 1e6}


def engine_point(engine: Any, n_in: int, n_out: int, conc: int, logprobs: bool, requests: int, seed: int
                 ) -> dict[str, Any]:
    """Add ``requests`` requests (at most ``conc`` in flight), step until done; output tok/s and the median
    decode-step time at the point's full batch."""
    import torch

    from services.text.sampling_params import SamplingParams

    vocab = engine.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n_in,), generator=g).tolist() for _ in range(requests)]
    sp = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    pending, live, done_tokens = list(range(requests)), 0, 0
    full_steps: list[float] = []
    steps = {"steps": 0, "seconds": 0.0, "tokens": 0, "rows": 0, "graphed": 0}
    added: dict[str, float] = {}
    ttft: list[float] = []
    t0 = time.perf_counter()
    while pending or engine.has_work():
        while pending and live < conc:
            i = pending.pop(0)
            engine.add_request(f"p{seed}-{i}", prompts[i], sp, detokenize=False)
            added[f"p{seed}-{i}"] = time.perf_counter()
            live += 1
        running = engine.scheduler.num_running
        graphed = getattr(engine.runner, "graphed_steps", 0)
        s0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - s0
        if engine.last_step_sequences:  # the same step records a service's step metrics are made of
            steps["steps"] += 1
            steps["seconds"] += dt
            steps["tokens"] += engine.last_step_tokens
            steps["rows"] += engine.last_step_sequences
            steps["graphed"] += getattr(engine.runner, "graphed_steps", 0) > graphed
        if running == min(conc, engine.config.max_num_seqs) and all(
                len(o.new_token_ids) == 1 for o in outs) and len(outs) == running and not engine.scheduler.num_waiting:
            full_steps.append(dt)
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids and o.request_id in added:
                ttft.append(now - added.pop(o.request_id))
            done_tokens += len(o.new_token_ids)
            live -= o.finished
    wall = time.perf_counter() - t0
    n = max(1, steps["steps"])
    ttft.sort()
    return {"requests": requests, "output_tokens": done_tokens, "wall_s": wall, "output_tok_s": done_tokens / wall,
            "full_batch_decode_step_ms": 1000 * statistics.median(full_steps) if full_steps else None,
            "full_batch_steps": len(full_steps), "batch": min(conc, engine.config.max_num_seqs),
            "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None,
            "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))] if ttft else None,
            "steps": {"steps": steps["steps"], "step_ms_mean": 1e3 * steps["seconds"] / n,
                      "tokens_per_step": steps["tokens"] / n, "rows_per_step": steps["rows"] / n,
                      "graphed_share": steps["graphed"] / n, "busy_ratio": steps["seconds"] / wall}}


def time_sharing_ceiling(point: dict[str, Any], prefill_s: float | None, n_out: int) -> float | None:
    """Output tok/s the 1P1D time-sharing bound allows at an engine point (module docstring)."""
    step_ms = point.get("full_batch_decode_step_ms")
    if not prefill_s or not step_ms:
        return None
    r = point["requests"]
    seconds = r * prefill_s + r * n_out / point["batch"] * step_ms / 1e3
    return r * n_out / seconds


def run_engine_phase(ns: argparse.Namespace, deadline: float) -> dict[str, Any]:
    import torch

    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    out: dict[str, Any] = {"ceiling": ceiling(), "points": []}
    log(f"copy ceiling {out['ceiling']['copy_GBps']:.0f} GB/s")
    engine = LLMEngine(EngineConfig(model=ns.model, dtype="bfloat16", device="cuda", max_model_len=MAX_MODEL_LEN,
                                    async_scheduling=ns.async_scheduling))
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    kv_token = engine.runner.bytes_per_block // engine.config.block_size
    out["engine"] = {"weight_bytes": weights, "kv_bytes_per_token": kv_token, "kv_pages": engine.runner.num_blocks,
                     "max_num_seqs": engine.config.max_num_seqs,
                     "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                     "max_prefill_chunk": engine.config.max_prefill_chunk,
                     "device": torch.cuda.get_device_name()}
    engine_point(engine, 64, 8, 4, True, 4, seed=999)  # warm-up (Triton autotune, sampler paths)
    seed = 0
    out["prefill_only_s_per_request"] = {}
    for n_in, n_out in ns.shapes_l:
        prefill_s = None
        if time.monotonic() < deadline:
            engine_point(engine, n_in, 2, 2, False, 2, seed=998)  # warm this prompt length's paths
            reqs = max(4, min(64, 65536 // n_in))
            prefill_s = engine_point(engine, n_in, 1, reqs, False, reqs, seed=997)["wall_s"] / reqs  # prompts alone
            out["prefill_only_s_per_request"][f"{n_in}x{n_out}"] = prefill_s
            log(f"prefill alone, {n_in} tokens: {1e3 * prefill_s:.1f} ms per prompt ({reqs} prompts)")
            if wr := warmup_requests(ns, n_in):
                engine_point(engine, n_in, 4, wr, True, wr, seed=996)
                log(f"warm-up point: {wr} requests of {n_in} tokens")
        for lp in ns.lp_l:
            for conc in ns.conc_l:
                key = {"shape": f"{n_in}x{n_out}", "concurrency": conc, "logprobs": lp}
                if skip := _skip(ns, n_in, conc, deadline):
                    out["points"].append({**key, "skipped": skip})
                    continue
                seed += 1
                r = engine_point(engine, n_in, n_out, conc, lp, max(conc, ns.min_requests), seed)
                ctx = n_in + n_out / 2
                if r["full_batch_decode_step_ms"]:
                    limit_ms = (weights + r["batch"] * ctx * kv_token) / (out["ceiling"]["copy_GBps"] * 1e6)
                    r["bandwidth_limit_ms"] = limit_ms
                    r["fraction_of_bandwidth_limit"] = limit_ms / r["full_batch_decode_step_ms"]
                r["one_gpu_pd_ceiling_tok_s"] = time_sharing_ceiling(r, prefill_s, n_out)
                out["points"].append({**key, **r})
                log(f"engine {key}: {r['output_tok_s']:.0f} tok/s, full-batch step {r['full_batch_decode_step_ms']}, "
                    f"TTFT p50/p90 {r['ttft_p50_s']}/{r['ttft_p90_s']} s, steps {r['steps']}")
    return out


def warmup_requests(ns: argparse.Namespace, n_in: int) -> int:
    """Requests of a shape's unmeasured warm-up point (--warmup-prompt-tokens; 0: none)."""
    return min(max(ns.conc_l), 256, ns.warmup_prompt_tokens // n_in) if ns.conc_l else 0


def _skip(ns: argparse.Namespace, n_in: int, conc: int, deadline: float) -> str:
    """Why a point is not run ("" to run it)."""
    if max(conc, ns.min_requests) * n_in > ns.max_prompt_tokens:
        return f"over --max-prompt-tokens {ns.max_prompt_tokens}"
    return "time budget" if time.monotonic() > deadline else ""


# --- served phase ---

def _cluster(mode: str, ns: argparse.Namespace, core: str = "thread") -> Any:
    from services.launcher import LocalCluster

    common = ["--device", "cuda", "--max-model-len", str(MAX_MODEL_LEN), "--async-scheduling", ns.async_scheduling]
    if mode == "colocated":
        return LocalCluster(prefill=0, decode=1, colocated=True, model=ns.model, dtype="bfloat16", kvstore=None,
                            quiet=True, extra={"decode": [*common, "--engine-core", core, *ns.decode_args_l]})
    decode_util = round(0.9 - ns.prefill_utilization, 3)
    return LocalCluster(prefill=1, decode=1, model=ns.model, dtype="bfloat16", kvstore=None, quiet=True,
                        kv_transport="cuda-ipc",
                        extra={"prefill": [*common, "--gpu-memory-utilization", str(ns.prefill_utilization),
                                           "--engine-core", ns.prefill_engine_core],
                               "decode": [*common, "--gpu-memory-utilization", str(decode_util),
                                          "--engine-core", core, *ns.decode_args_l]})


_ROLES = (("core_process", "engine core"), ("services.router", "router"), ("services.decode", "decode front"),
          ("services.prefill", "prefill"), ("bench", "client"))


def _tree_cpu() -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) of every process below this one whose command names a role."""
    tck = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    info: dict[int, tuple[str, float]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        pid = int(d)
        parent[pid] = int(fields[1])
        role = next((r for key, r in _ROLES if key in cmd), "")
        if role:
            info[pid] = (role, (int(fields[11]) + int(fields[12])) / tck)
    me = os.getpid()

    def below(pid: int) -> bool:
        for _ in range(64):
            pid = parent.get(pid, 0)
            if pid == me:
                return True
            if pid <= 1:
                return False
        return False

    return {pid: v for pid, v in info.items() if below(pid)}


def _cores_by_role(first: dict[int, tuple[str, float]], last: dict[int, tuple[str, float]], wall: float
                   ) -> dict[str, float]:
    """Cores each role used over ``wall`` seconds (CPU seconds between the first and last sight of each pid)."""
    out: dict[str, float] = {}
    for pid, (role, cpu) in last.items():
        out[role] = out.get(role, 0.0) + (cpu - first.get(pid, (role, 0.0 if role == "client" else cpu))[1]) / wall
    return {k: round(v, 3) for k, v in sorted(out.items())}


_STEP_SERIES = ("engine_step_seconds_sum", "engine_step_seconds_count", "engine_step_tokens_sum",
                "engine_step_sequences_sum", "engine_busy_seconds_total")


def _decode_steps(metrics_addr: str) -> dict[str, float]:
    """The decode engine's step series (sums over labels) from its /metrics, graphed steps apart."""
    import urllib.request

    out: dict[str, float] = {}
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
        text = opener.open(f"http://{metrics_addr}/metrics", timeout=10).read().decode()
    except OSError as e:
        log(f"decode metrics at {metrics_addr}: {e}")
        return out
    for line in text.splitlines():
        if not line.startswith("pdserve_decode_engine_"):
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{")[0][len("pdserve_decode_"):]
        if base == "engine_steps_total":
            base += "_graphed" if 'cuda_graph="graphed"' in name else "_eager"
        elif base not in _STEP_SERIES:
            continue
        out[base] = out.get(base, 0.0) + float(value)
    return out


def _step_summary(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, float]:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = d.get("engine_step_seconds_count", 0.0)
    if not steps:
        return {"scraped_series": len(after)}
    return {"steps": steps, "step_ms_mean": 1e3 * d["engine_step_seconds_sum"] / steps,
            "tokens_per_step": d.get("engine_step_tokens_sum", 0.0) / steps,
            "rows_per_step": d.get("engine_step_sequences_sum", 0.0) / steps,
            "graphed_share": d.get("engine_steps_total_graphed", 0.0) / steps,
            "busy_ratio": d.get("engine_busy_seconds_total", 0.0) / wall}


def served_point(base: str, n_in: int, n_out: int, conc: int, lp: bool, ns: argparse.Namespace, tmp: Path,
                 label: str, decode_metrics: str = "") -> dict[str, Any]:
    """One `pdserve bench serve` point: max(C, --min-requests) requests at concurrency C; its report's point."""
    d = tmp / f"{label}-c{conc}"
    cmd = [sys.executable, "-m", "services.cli", "bench", "serve", "--base-url", base, "--api", "completions",
           "--input-tokens", str(n_in), "--output-tokens", str(n_out), "--ignore-eos", "--temperature", "0",
           "--concurrency", str(conc), "--requests", str(max(conc, ns.min_requests)), "--warmup", "2",
           "--num-gpus", "1", "--no-progress", "--no-plots", "--tokenizer", BENCH_TOKENIZER, "--label", label, "--out", str(d),
           *(["--logprobs"] if lp else [])]
    log(" ".join(cmd[2:]))
    steps0 = _decode_steps(decode_metrics) if decode_metrics else {}
    first, t0 = _tree_cpu(), time.monotonic()
    last = dict(first)
    proc = subprocess.Popen(cmd)
    limit = t0 + max(60.0, ns.deadline - time.monotonic() + 180)
    while proc.poll() is None:  # sample every process of the tree (the client's CPU is seen only while it runs)
        if time.monotonic() > limit:
            proc.kill()
            proc.wait()
            return {"concurrency": conc, "error": "bench serve timed out"}
        last.update(_tree_cpu())
        time.sleep(0.5)
    wall = time.monotonic() - t0
    cores = _cores_by_role(first, last, wall)
    log(f"cores used over the point: {cores}")
    if decode_metrics:
        time.sleep(1.2)  # the service observes its step records when it reads its stats (every second)
    steps = _step_summary(steps0, _decode_steps(decode_metrics), wall) if decode_metrics else {}
    log(f"decode engine steps over the point: {steps}")
    report = d / "report.json"
    if not report.exists():
        return {"concurrency": conc, "error": "bench serve wrote no report"}
    servers = json.loads(report.read_text())["servers"]
    point = dict(servers[0]["points"][0]) if servers and servers[0]["points"] else {"concurrency": conc,
                                                                                    "error": "no point"}
    point["cores_by_role"] = cores
    point["decode_steps"] = steps
    done = point.get("requests", {}).get("completed")
    if done and "tokens" in point:
        point["prompt_tokens_per_request"] = point["tokens"]["input"] / done
        log(f"prompt tokens per request: {point['prompt_tokens_per_request']:.1f} (asked for {n_in})")
    return point


def run_served(ns: argparse.Namespace, mode: str, tmp: Path, core: str = "thread") -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    name = (mode if core == "thread" else f"{mode}/{core}") + (f" [{ns.decode_args}]" if ns.decode_args else "")
    if time.monotonic() > ns.deadline:
        return [{"mode": name, "skipped": "time budget"}]
    cluster = _cluster(mode, ns, core)
    log(f"starting {mode} ...")
    cluster.start(300.0)
    try:
        base = f"http://{cluster.router['http']}/v1"
        dec = next((p for p in cluster.procs if p.name == ("worker-0" if mode == "colocated" else "decode-0")), None)
        decode_metrics = dec.ready.get("metrics", "") if dec is not None else ""
        if dec is not None:  # what the engine sized itself to (pool pages, batch limits)
            for line in dec.lines:
                if any(w in line for w in ("KV pool", "max_num_seqs", "pages")):
                    log(f"{dec.name}: {line[-300:]}")
        for n_in, n_out in ns.shapes_l:
            if (wr := warmup_requests(ns, n_in)) and time.monotonic() < ns.deadline:
                warm = served_point(base, n_in, 4, wr, True, ns, tmp, f"{mode}-{core}-{n_in}-warmup", "")
                log(f"warm-up point ({wr} requests of {n_in} tokens, not measured): "
                    f"{warm.get('requests', warm.get('error'))}")
            for lp in ns.lp_l:
                for conc in ns.conc_l:
                    key = {"mode": name, "shape": f"{n_in}x{n_out}", "logprobs": lp, "concurrency": conc}
                    if skip := _skip(ns, n_in, conc, ns.deadline):
                        rows.append({**key, "skipped": skip})
                        continue
                    label = f"{mode}-{core}-{n_in}x{n_out}-lp{int(lp)}"
                    rows.append({**key, **served_point(base, n_in, n_out, conc, lp, ns, tmp, label,
                                                             decode_metrics)})
    finally:
        cluster.stop()
    return rows


def summarize(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Served output tok/s over the engine's at the same (shape, C, logprobs)."""
    eng = {(p["shape"], p["concurrency"], p["logprobs"]): p for p in result.get("engine", {}).get("points", [])
           if "output_tok_s" in p}
    rows = []
    for s in result.get("served", []):
        if "throughput" not in s:
            continue
        c = s["concurrency"]
        e = eng.get((s["shape"], c, s["logprobs"]))
        tput = s["throughput"]["output_tok_s"]
        n_in = int(s["shape"].split("x")[0])
        per_req = s.get("prompt_tokens_per_request")
        same_work = per_req is not None and -PROMPT_TOLERANCE <= (per_req - n_in) / n_in <= PROMPT_WRAPPER
        rows.append({"mode": s["mode"], "shape": s["shape"], "concurrency": c, "logprobs": s["logprobs"],
                     "served_tok_s": tput, "engine_tok_s": e["output_tok_s"] if e else None,
                     "prompt_tokens_per_request": per_req,
                     "served_over_engine": tput / e["output_tok_s"] if e and same_work else None,
                     "one_gpu_pd_ceiling_tok_s": (e.get("one_gpu_pd_ceiling_tok_s") if e and same_work
                                                  and s["mode"].startswith("1p1d") else None),
                     "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p90_s": s["ttft_s"]["p90"],
                     "tpot_p50_s": s["tpot_s"]["p50"], "failed": s["requests"].get("failed")})
    return rows


def main(argv: list[str] | None = None) -> int:
    ns = _args(argv)
    t0 = time.monotonic()
    ns.deadline = t0 + ns.budget_s
    if ns.engine_child:
        Path(ns.engine_child).write_text(json.dumps(run_engine_phase(ns, ns.deadline)))
        return 0
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"model": ns.model, "args": {k: v for k, v in vars(ns).items() if isinstance(v, (str, int, float))},
                              "served": []}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        if "engine" in ns.modes_l:
            child = tmp / "engine.json"
            cmd = [sys.executable, __file__, "--engine-child", str(child), "--model", ns.model, "--shapes", ns.shapes, "--concurrency",
                   ns.concurrency, "--logprobs", ns.logprobs, "--min-requests", str(ns.min_requests),
                   "--max-prompt-tokens", str(ns.max_prompt_tokens), "--async-scheduling", ns.async_scheduling,
                   "--warmup-prompt-tokens", str(ns.warmup_prompt_tokens),
                   "--budget-s", str(max(1.0, ns.deadline - time.monotonic()))]
            subprocess.run(cmd, check=False)
            result["engine"] = json.loads(child.read_text()) if child.exists() else {"error": "engine phase failed"}
        for mode in ("colocated", "1p1d"):
            for core in ns.engine_core.split(","):
                if mode in ns.modes_l:
                    try:
                        result["served"].extend(run_served(ns, mode, tmp, core))
                    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                        result["served"].append({"mode": f"{mode}/{core}", "error": str(e)[-2000:]})
    result["summary"] = summarize(result)
    result["wall_s"] = time.monotonic() - t0
    path = out / "h200_served.json"
    path.write_text(json.dumps(result, indent=1))
    log(f"wrote {path}")
    print(f"{'mode':17s} {'shape':9s} {'C':>4s} {'lp':>3s} {'served':>8s} {'engine':>8s} {'ratio':>6s} "
          f"{'TTFT50':>7s} {'TTFT90':>7s} {'TPOT50':>7s} fail  1P1D-ceiling (x)")
    for r in result["summary"]:
        ratio = f"{r['served_over_engine']:.2f}" if r["served_over_engine"] else "-"
        eng = f"{r['engine_tok_s']:.0f}" if r["engine_tok_s"] else "-"
        ms = [f"{r[k] * 1e3:7.{d}f}" if r[k] is not None else f"{'-':>7s}"
              for k, d in (("ttft_p50_s", 0), ("ttft_p90_s", 0), ("tpot_p50_s", 1))]
        cap = r["one_gpu_pd_ceiling_tok_s"]
        cap_s = f"{cap:.0f} ({r['served_tok_s'] / cap:.2f})" if cap else ""
        print(f"{r['mode']:17s} {r['shape']:9s} {r['concurrency']:4d} {int(r['logprobs']):3d} {r['served_tok_s']:8.0f} "
              f"{eng:>8s} {ratio:>6s} {' '.join(ms)} {r['failed']}  {cap_s}")
    for p in result.get("engine", {}).get("points", []):
        if p.get("fraction_of_bandwidth_limit"):
            print(f"engine {p['shape']} C{p['concurrency']} lp={int(p['logprobs'])}: full-batch step "
                  f"{p['full_batch_decode_step_ms']:.1f} ms, bandwidth limit {p['bandwidth_limit_ms']:.1f} ms "
                  f"({p['fraction_of_bandwidth_limit']:.2f} of it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
