"""``pdserve bench KIND ...``: dispatch to ``benchmarks.<KIND>_bench.main(argv)`` (or the
``module:function`` a BENCHES entry names).

Modules are imported only when chosen, so one benchmark's heavy or missing dependencies never
break another.
"""

from __future__ import annotations

import importlib
import sys

BENCHES = {
    "engine": ("benchmarks.engine_bench", "CPU/GPU engine: prefill and decode tokens/s vs transformers"),
    "cpu-serving": ("benchmarks.cpu_serving_bench", "CPU serving: pdserve up (+ --colocated) vs the in-process "
                                                    "engine and llama.cpp's server, same GGUF and client"),
    "cluster": ("benchmarks.cluster_bench", "local P/D cluster: TTFT, ITL and throughput through the router"),
    "kvstore": ("benchmarks.kvstore_bench", "kvstore put/get bandwidth and latency"),
    "kernels": ("benchmarks.kernels_bench", "Triton kernels vs their torch references"),
    "moe": ("benchmarks.moe_bench", "fused MoE at qwen3-30b-a3b / mixtral-8x7b shapes vs copy and matmul "
                                    "ceilings, torch loops, and the engine's MoE decode/prefill"),
    "kv": ("benchmarks.kv_bench", "KV transports (grpc, shm, mooncake) vs a loopback socket and a memcpy"),
    "spec": ("benchmarks.spec_bench", "speculative decoding: decode tokens/s plain vs real vs synthetic acceptance"),
    "startup": ("benchmarks.startup_bench", "router start-up: entry-point import and exec -> ready, per checkout"),
    "serve": ("benchmarks.serve.cli:serve_main", "any OpenAI-compatible server (or a recipe's deployment): "
                                                 "concurrency/rate sweeps, SLO goodput, plots, accuracy"),
    "ab": ("benchmarks.serve.cli:ab_main", "two recipes' deployments on the same workload, one report"),
    "tls-ttft": ("benchmarks.tls_ttft_bench", "TTFT with mTLS between the services vs plaintext, two 1P1D "
                                             "clusters side by side, grpc KV transport"),
    "soak": ("benchmarks.soak_bench", "bounded loopback soak of a default pdserve up: mixed load, cancels, "
                                      "kill -9 of each service, a CPU hog; every outcome counted"),
    "pd-vs-dp": ("benchmarks.gpu_pd_vs_dp", "1P1D (cuda-ipc) vs 2 colocated workers on one device, same workload"),
}


def _usage() -> str:
    lines = ["usage: pdserve bench {" + ",".join(BENCHES) + "} [ARGS ...]", "", "benchmarks:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in BENCHES.items()]
    lines.append("\n`pdserve bench KIND --help` lists a benchmark's own flags.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    kind, rest = argv[0], argv[1:]
    if kind not in BENCHES:
        print(f"pdserve bench: unknown benchmark {kind!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, _, func = BENCHES[kind][0].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        print(f"pdserve bench {kind}: {module_name} is not available in this checkout", file=sys.stderr)
        return 2
    return int(getattr(module, func or "main")(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
