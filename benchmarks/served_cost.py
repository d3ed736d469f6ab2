"""Serving cost per output token at concurrency, both ways tokens come back from decode (--decode-stream), in
one run: µs of CPU per output token in each process (router, decode or colocated worker, prefill), served
output tok/s, and the in-process engine's tok/s at the same concurrency and shapes.

Each mode starts its own cluster (``pdserve up``'s launcher, each service in its own process), warms it, then
for each concurrency C sends C streamed /v1/completions at once (token-id prompts, ``ignore_eos``), ``--rounds``
times. Process CPU is utime + stime of /proc/<pid>/stat over the measured rounds, so it barely moves with the
load of a shared box; tok/s is wall time and does.

    python -m benchmarks.served_cost --model random:tiny-llama --concurrency 16,64 --colocated
    python -m benchmarks.served_cost --model random:tiny-llama --concurrency 16,64       # P/D
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import urllib.request

from services.engine.cpu.cpu_features import quiet_openmp_env
from services.launcher import LocalCluster, served_model
from services.router.config import DECODE_STREAMS


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) ``pid`` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stream(http: str, model: str, prompt: list[int], max_tokens: int) -> int:
    """One streamed completion; returns the output tokens its final usage reports."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://{http}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    tokens = 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {") and b'"usage"' in line:
                usage = json.loads(line[6:]).get("usage") or {}
                tokens = usage.get("completion_tokens", tokens) or tokens
    return tokens


def burst(http: str, model: str, prompts: list[list[int]], max_tokens: int) -> int:
    """All ``prompts`` at once, one thread each; the output tokens they got."""
    got = [0] * len(prompts)

    def one(i: int) -> None:
        got[i] = stream(http, model, prompts[i], max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(got)


def prompts_for(c: int, length: int, salt: int) -> list[list[int]]:
    """``c`` prompts of ``length`` token ids that share no leading block (no prefix-cache reuse)."""
    return [[(salt * 7919 + i * 131 + j * 17) % 250 + 3 for j in range(length)] for i in range(c)]


def engine_core_pid(pid: int) -> int | None:
    """The engine-core process below service ``pid`` (``--engine-core process``), or None."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            for child in f.read().split():
                try:
                    with open(f"/proc/{child}/cmdline", "rb") as g:
                        if b"services.engine.core_process" in g.read():
                            return int(child)
                except OSError:  # the child exited meanwhile
                    continue
    return None


def measure_served(c: LocalCluster, names: list[str], model: str, conc: int, a: argparse.Namespace
                   ) -> dict[str, float]:
    http = c.router["http"]
    pids = {n: c.get(n).popen.pid for n in names}  # type: ignore[union-attr]
    core = engine_core_pid(pids[names[1]])
    if core is not None:
        pids["core-0"] = core
    burst(http, model, prompts_for(conc, a.prompt_len, 0), a.max_tokens)  # warm at this concurrency
    cpu0 = {n: process_cpu_s(p) for n, p in pids.items()}
    t0 = time.perf_counter()
    tokens = sum(burst(http, model, prompts_for(conc, a.prompt_len, r + 1), a.max_tokens) for r in range(a.rounds))
    wall = time.perf_counter() - t0
    out = {"tok_s": tokens / wall, "tokens": float(tokens)}
    for n, p in pids.items():
        out[f"{n.split('-')[0]}_us_per_token"] = (process_cpu_s(p) - cpu0[n]) * 1e6 / max(1, tokens)
    return out


def measure_in_process(model: str, conc: int, a: argparse.Namespace) -> float:
    from services.engine.config import EngineConfig  # the bench process loads torch only for this row
    from services.engine.engine import LLMEngine
    from services.text.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(model=model))
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    eng.generate(prompts_for(conc, a.prompt_len, 0), params)  # warm
    best = 0.0
    for r in range(a.rounds):
        t0 = time.perf_counter()
        outs = eng.generate(prompts_for(conc, a.prompt_len, r + 1), params)
        best = max(best, sum(len(o) for o in outs) / (time.perf_counter() - t0))
    eng.runner.release()
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:tiny-llama")
    ap.add_argument("--concurrency", default="16,64", help="Comma-separated concurrencies.")
    ap.add_argument("--prompt-len", type=int, default=32, help="Prompt tokens per request.")
    ap.add_argument("--max-tokens", type=int, default=64, help="Output tokens per request.")
    ap.add_argument("--rounds", type=int, default=2, help="Measured bursts per concurrency.")
    ap.add_argument("--colocated", action="store_true", help="One colocated worker (else 1 prefill + 1 decode).")
    ap.add_argument("--modes", default=",".join(DECODE_STREAMS), help="--decode-stream values, in this order.")
    ap.add_argument("--engine-core", default="thread", help="decode --engine-core values, in this order "
                    "(thread, process): each with every --modes value")
    ap.add_argument("--no-in-process", action="store_true", help="Skip the in-process engine rows.")
    a = ap.parse_args(argv)
    # The in-process engine runs in this process: its OpenMP workers sleep when idle, as the services' do.
    os.environ.update(quiet_openmp_env(os.environ))
    concs = [int(x) for x in a.concurrency.split(",")]
    names = ["router", "worker-0"] if a.colocated else ["router", "decode-0", "prefill-0"]
    print(f"model {a.model}, {'colocated' if a.colocated else '1P1D'}, prompt {a.prompt_len}, "
          f"output {a.max_tokens}, rounds {a.rounds}, load {os.getloadavg()}")
    rows: dict[tuple[str, int], dict[str, float]] = {}
    modes = [f"{m}/{core}" for core in a.engine_core.split(",") for m in a.modes.split(",")]
    for label in modes:
        mode, core = label.split("/")
        extra = {"router": ["--decode-stream", mode], "decode": ["--engine-core", core]}
        with LocalCluster(prefill=0 if a.colocated else 1, decode=1, kvstore=None, colocated=a.colocated,
                          model=a.model, extra=extra, quiet=True) as c:
            model = served_model(c.router["http"])
            for conc in concs:
                rows[(label, conc)] = r = measure_served(c, names, model, conc, a)
                print(json.dumps({"decode_stream": mode, "engine_core": core, "concurrency": conc,
                                  **{k: round(v, 1) for k, v in r.items()}}), flush=True)
    engine = {} if a.no_in_process else {conc: measure_in_process(a.model, conc, a) for conc in concs}
    role = "worker" if a.colocated else "decode"
    print(f"\n| C | --decode-stream / --engine-core | served tok/s | x in-process | router µs/token | {role} "
          "(front) µs/token | engine core µs/token" + ("" if a.colocated else " | prefill µs/token") + " |")
    print("|---|---|---|---|---|---|---|" + ("" if a.colocated else "---|"))
    for conc in concs:
        for mode in modes:
            r = rows[(mode, conc)]
            ratio = f"{r['tok_s'] / engine[conc]:.2f}" if conc in engine else "-"
            core_us = f"{r['core_us_per_token']:.0f}" if "core_us_per_token" in r else "-"
            line = (f"| {conc} | {mode} | {r['tok_s']:.0f} | {ratio} | {r['router_us_per_token']:.0f} | "
                    f"{r[f'{role}_us_per_token']:.0f} | {core_us} |")
            print(line + ("" if a.colocated else f" {r['prefill_us_per_token']:.0f} |"))
        if conc in engine:
            print(f"| {conc} | in-process engine | {engine[conc]:.0f} | 1.00 | - | - | - |" + ("" if a.colocated else " - |"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
