"""The systems `pdserve bench cpu-serving` compares, each able to run ONE round on demand, so that the
benchmark can let them take turns round by round (all servers stay up; the one not measured is idle).

* :class:`Server`: a server process (``pdserve up``, ``pdserve up --colocated``, llama.cpp's server) started
  once, warmed up, then asked for rounds of c concurrent streamed completions.
* :class:`InProcess`: the in-process engine (LLMEngine in this process): per round, the prefill of one
  prompt at each thread count asked for (all cores, and the served prefill's share), and a batch-1 decode.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import aiohttp

from benchmarks.serve.client import RequestResult, Target, send
from benchmarks.serve.load import wait_ready
from services.launcher import served_model

_TOPIC = ("the history of bridges, from fallen logs across streams to stone arches, iron trusses and long "
          "suspension spans, and what each new material allowed engineers to build. ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_run(n: int) -> int:
    """A port p with p .. p+n-1 free now (for --metrics-port-base)."""
    for _ in range(50):
        base = free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports found")


def text_prompts(spec: str, n: int, length: int, seed: int) -> list[str]:
    """Texts of about ``length`` tokens (re-encoding may differ by a few): a unique numbered opening, so no
    prompt shares a cached prefix block with another, then plain prose (random token ids make the model
    emit special tokens, whose empty text would delay the first streamed event)."""
    from services.text.model.source import load_tokenizer

    tok = load_tokenizer(spec).tokenizer
    body = tok.encode(_TOPIC * (length // 20 + 2), add_special_tokens=False)
    out = []
    for i in range(n):
        head = tok.encode(f"Request {seed}-{i}. Write about ", add_special_tokens=False)
        out.append(tok.decode((head + body)[:length]))
    return out


STAGE_METRICS = ("pdserve_router_time_to_first_token_seconds", "pdserve_prefill_queue_seconds",
                 "pdserve_prefill_compute_seconds", "pdserve_decode_kv_wait_seconds", "pdserve_decode_queue_seconds")
"""Histograms whose mean over the c=1 requests splits a served TTFT into stages (router view, prefill queue
and compute, decode's wait for the KV); the rest of the client's TTFT is HTTP, gRPC and detokenization."""


COMPILE_FINISHED = ("engine: background compile done", "decode steps of that size and larger stay eager",
                    "engine: background compile of the decode step failed", "so no background compile")
"""Log lines with which an engine's background decode compile (services/engine/cpu/decode_compiler.py) ends,
compiled or not: a server is measured only after each of its compiling engines printed one, so no round
runs beside a compile (minutes of both cores on a small host)."""


def parse_histogram_sums(text: str, names: tuple[str, ...] = STAGE_METRICS) -> dict[str, tuple[float, float]]:
    """Prometheus text -> {name: (sum, count)} over every label set of each named histogram."""
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, _, value = line.rpartition(" ")
        metric = key.split("{", 1)[0]
        for name in names:
            if metric in (f"{name}_sum", f"{name}_count"):
                acc = out.setdefault(name, [0.0, 0.0])
                acc[0 if metric.endswith("_sum") else 1] += float(value)
    return {k: (v[0], v[1]) for k, v in out.items()}


def stage_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean seconds per observation of each histogram between two scrapes."""
    means = {}
    for name, (s1, c1) in after.items():
        s0, c0 = before.get(name, (0.0, 0.0))
        if c1 > c0:
            means[name] = (s1 - s0) / (c1 - c0)
    return means


def scrape(ports: list[int]) -> dict[str, tuple[float, float]]:
    import urllib.request

    total: dict[str, tuple[float, float]] = {}
    for port in ports:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                part = parse_histogram_sums(r.read().decode())
        except OSError:
            continue
        for k, (a, b) in part.items():
            s0, c0 = total.get(k, (0.0, 0.0))
            total[k] = (s0 + a, c0 + b)
    return total


async def _round(target: Target, prompts: list[str], max_tokens: int) -> tuple[list[RequestResult], float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(send(session, target, p, max_tokens, RequestResult("bench", 0, 0.0), t0)
                                          for p in prompts))
        return list(results), time.perf_counter() - t0


class Server:
    """One server process for the whole benchmark; :meth:`round` sends c concurrent requests."""

    def __init__(self, name: str, command: list[str], target: Target, spec: str,
                 metrics_ports: list[int] | None = None, compiling_engines: int = 0) -> None:
        self.name, self.command, self.target, self.spec = name, command, target, spec
        self.compiling_engines = compiling_engines
        """Engines of this server that compile their decode step in the background (waited for at start)."""
        self.metrics_ports = metrics_ports or []
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdserve-bench-{name}-{os.getpid()}.log"
        self._stage_sums: dict[str, list[float]] = {}

    def start(self, ready_timeout_s: float, prompt_len: int, seed: int) -> None:
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        asyncio.run(wait_ready(self.target, ready_timeout_s))
        if not self.target.model:
            self.target = dataclasses.replace(self.target,
                                              model=served_model(self.target.base_url.removeprefix("http://")))
        asyncio.run(_round(self.target, text_prompts(self.spec, 1, prompt_len, seed + 999), 4))  # first-call costs
        waited = self._wait_compiles(ready_timeout_s)
        print(f"{self.name}: ready ({' '.join(self.command[:6])} ...), log {self.log}"
              + (f"; waited {waited:.0f} s for background decode compiles" if self.compiling_engines else ""),
              flush=True)

    def _wait_compiles(self, timeout_s: float) -> float:
        """Seconds waited until every compiling engine logged the end of its background compile; RuntimeError
        after ``timeout_s`` or if the server exits."""
        t0 = time.monotonic()
        while self.compiling_engines:
            text = self.log.read_text(errors="replace")
            if sum(text.count(m) for m in COMPILE_FINISHED) >= self.compiling_engines:
                break
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited while its engines compiled; log {self.log}")
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{self.name}: background decode compiles not done after {timeout_s:.0f} s")
            time.sleep(1.0)
        return time.monotonic() - t0

    def round(self, prompts: list[str], max_tokens: int, stages: bool) -> tuple[list[RequestResult], float]:
        """One round; with ``stages``, the stage histograms' sums/counts over it are accumulated."""
        before = scrape(self.metrics_ports) if stages and self.metrics_ports else {}
        results, wall = asyncio.run(_round(self.target, prompts, max_tokens))
        if before:
            for name, (s1, c1) in scrape(self.metrics_ports).items():
                s0, c0 = before.get(name, (0.0, 0.0))
                acc = self._stage_sums.setdefault(name, [0.0, 0.0])
                acc[0] += s1 - s0
                acc[1] += c1 - c0
        return results, wall

    def stage_means(self) -> dict[str, float]:
        return {k: s / c for k, (s, c) in self._stage_sums.items() if c > 0}

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


SHORT_CONTEXT = 32
"""Prompt tokens of the in-process decode shown beside the ceiling (what earlier runs measured as the ceiling)."""


class InProcess:
    """The in-process engine; one :meth:`round` = prefill seconds per thread count, and batch-1 decode s/token
    after a prompt of the served prompt length."""

    def __init__(self, gguf: Path, dtype: str, weight_format: str, prompt_len: int, output_len: int, threads: int,
                 cpu_compile_decode: int, compile_timeout_s: float = 600.0) -> None:
        from benchmarks.engine_bench import EngineBench

        self.bench = EngineBench(str(gguf), dtype, prompt_len, 1, 64 + output_len, threads, weight_format,
                                 cpu_compile_decode=cpu_compile_decode)
        self.prompt_len, self.output_len, self.threads = prompt_len, output_len, threads
        self._n = 0
        self.short_decode_s = 0.0
        """Batch-1 decode s/token of the last round after a SHORT_CONTEXT-token prompt (shown beside, not a ceiling)."""
        compiler = self.bench.engine.runner.decode_compiler
        # Measured compiled, as served engines are once their compile is done; a compile still running after
        # compile_timeout_s (the bench's --ready-timeout-s default) fails the run rather than hang it.
        if compiler is not None and not compiler.wait(compile_timeout_s):
            raise RuntimeError(f"in-process engine: background decode compile not done after "
                               f"{compile_timeout_s:.0f} s")
        cfg = self.bench.engine.config
        self.dtype = f"{cfg.resolved_dtype} ({cfg.dtype_reason})"
        self.weight_format = f"{cfg.resolved_weight_format} ({cfg.weight_format_reason})"
        self.round([threads])  # warm-up, not kept

    def round(self, prefill_threads: list[int]) -> tuple[dict[int, float], float]:
        """({threads: prefill seconds of a fresh prompt}, batch-1 decode seconds per output token)."""
        import torch

        from benchmarks.engine_bench import _prompts as token_prompts

        self._n += 1
        prefill = {}
        for i, t in enumerate(prefill_threads):
            torch.set_num_threads(t)
            prefill[t] = self.bench.prefill(token_prompts(1, self.prompt_len, self.bench.vocab,
                                                          seed=100 * self._n + i)[0])
        torch.set_num_threads(self.threads)
        # Decoded after a prompt as long as the served systems' (prompt_len): a step attends to the whole
        # context, so a shorter prompt is no ceiling (32 vs 512 tokens: 14.3 vs 17.8 ms/token, eager, 2 threads).
        short = token_prompts(1, SHORT_CONTEXT, self.bench.vocab, seed=100 * self._n + 98)
        self.short_decode_s = self.bench.decode(short, self.output_len) / (self.output_len - 1)
        prompt = token_prompts(1, self.prompt_len, self.bench.vocab, seed=100 * self._n + 99)
        return prefill, self.bench.decode(prompt, self.output_len) / (self.output_len - 1)

    def stop(self) -> None:
        import gc

        import torch

        del self.bench
        gc.collect()
        torch.set_num_threads(1)  # the client side needs no intra-op threads
