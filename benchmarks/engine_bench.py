"""Engine benchmark: prefill and decode tokens/s of the pdserve engine beside transformers, same run.

    pdserve bench engine [--dtype auto] [--weight-format auto] [--cpu-threads N] [--model PATH.gguf] [--repeats 3] [--json out.json]
    python -m benchmarks.engine_bench ...

Workloads (same weights, dtype and machine for both):
  * prefill: one 512-token prompt. Engine: one step with max_prefill_chunk=512 (prefix caching off,
    so repeats recompute). transformers: one forward of the 512 tokens.
  * decode at C concurrent sequences (C = 1 and 16): C distinct 32-token prompts, 128 output tokens
    each, EOS ignored. Decode tokens/s = C * 127 / (time from the first token of all C sequences to
    the last). transformers: ``generate(max_new_tokens=128, min_new_tokens=128)`` minus
    ``generate(max_new_tokens=1)`` on the same [C, 32] batch (greedy, KV cache on).

``--dtype auto`` (the default) resolves as the engine does (bf16 where the CPU has AMX-BF16 or
AVX512-BF16, fp32 otherwise); transformers runs in the resolved dtype. The run prints the CPU model,
its avx2/avx512f/avx512_bf16/amx_bf16 flags, the dtype and why, and torch's thread count.

Each figure is the median of ``--repeats`` timed runs after one warm-up run; engine and
transformers runs alternate so that load from other processes hits both alike. Goals:
prefill >= transformers; decode at 16 concurrent >= 10x transformers' batch-1 decode.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from services.common.cli_args import ArgParser
from services.engine.config import EngineConfig
from services.engine.cpu.cpu_features import DTYPE_REASONS, host_cpu, torch_cpu_capability
from services.engine.engine import LLMEngine
from services.engine.models.quant_linear import WEIGHT_FORMAT_REASONS, WEIGHT_FORMATS
from services.text.model.gguf_meta import default_gguf_path
from services.text.sampling_params import SamplingParams

PREFILL_GOAL = 1.0
"""Engine prefill tokens/s over transformers' prefill tokens/s."""
DECODE_GOAL = 10.0
"""Engine decode tokens/s at the largest concurrency over transformers' batch-1 decode tokens/s."""


@dataclass
class Results:
    machine: str
    cpu_model: str
    cpu_flags: list[str]
    """Of avx2, avx512f, avx512_bf16, amx_bf16: those the CPU has."""
    torch_cpu_capability: str
    dtype: str
    """The dtype both engines ran in (``--dtype auto`` resolved)."""
    dtype_reason: str
    """Why: a services.engine.cpu.cpu_features.DTYPE_REASONS code."""
    model: str
    torch_threads: int
    prompt_len: int
    decode_prompt_len: int
    output_len: int
    repeats: int
    load_avg: list[float] = field(default_factory=list)
    """1-minute load average at the start and the end: above the core count, other processes competed."""
    engine: dict[str, float] = field(default_factory=dict)
    """metric -> tokens/s (median)."""
    transformers: dict[str, float] = field(default_factory=dict)
    goals: dict[str, dict[str, float | bool]] = field(default_factory=dict)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n, length), generator=g).tolist()


def _machine() -> str:
    cpu = host_cpu()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{len(cpu.cpus)} CPUs {platform.machine()} {cpu.model} "
            f"({', '.join(cpu.reported_flags()) or 'no AVX2'}), {gpu}")


# --- pdserve engine ---------------------------------------------------------------------------------


class EngineBench:
    def __init__(self, model: str | None, dtype: str, prompt_len: int, max_seqs: int, seq_len: int,
                 cpu_threads: int = 0, weight_format: str = "auto", cpu_compile_decode: int = 0) -> None:
        blocks = max(prompt_len + 1, max_seqs * seq_len) // 16 + 2 * max_seqs + 8
        self.config = EngineConfig(
            model=model, dtype=dtype, cpu_threads=cpu_threads, num_kv_blocks=blocks, block_size=16, max_num_seqs=max_seqs,
            max_num_batched_tokens=max(prompt_len, 2048), max_prefill_chunk=prompt_len,
            enable_prefix_caching=False, weight_format=weight_format, cpu_compile_decode=cpu_compile_decode)
        self.engine = LLMEngine(self.config)
        self.vocab = self.engine.vocab_size
        self._n = 0

    def _add(self, prompt: list[int], max_tokens: int) -> str:
        self._n += 1
        rid = f"bench-{self._n}"
        self.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                            ignore_eos=True), detokenize=False)
        return rid

    def prefill(self, prompt: list[int]) -> float:
        self._add(prompt, 1)
        t0 = time.perf_counter()
        while self.engine.has_work():
            self.engine.step()
        return time.perf_counter() - t0

    def decode(self, prompts: list[list[int]], output_len: int) -> float:
        """Seconds from the step that gave every sequence its first token to the last token."""
        ids = {self._add(p, output_len) for p in prompts}
        started: set[str] = set()
        t0 = 0.0
        while self.engine.has_work():
            for o in self.engine.step():
                if o.request_id in ids and o.new_token_ids:
                    started.add(o.request_id)
            if t0 == 0.0 and started == ids:
                t0 = time.perf_counter()
        assert self.engine.block_manager.num_free_blocks == self.engine.runner.num_blocks
        return time.perf_counter() - t0


# --- transformers -----------------------------------------------------------------------------------


class TransformersBench:
    def __init__(self, gguf: Path, dtype: torch.dtype) -> None:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        with contextlib.redirect_stderr(io.StringIO()):  # GGUF de-quantization progress bars
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=dtype).eval()

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> float:
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        self.model(ids)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> float:
        ids = torch.tensor(prompts)
        t0 = time.perf_counter()
        self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0


# --- driver -----------------------------------------------------------------------------------------


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _table(r: Results, concurrencies: list[int]) -> str:
    rows = [("prefill tok/s", f"prefill_{r.prompt_len}")]
    rows += [(f"decode tok/s @ {c} seq", f"decode_{c}") for c in concurrencies]
    out = [f"{'metric':<24}{'pdserve':>12}{'transformers':>14}{'ratio':>9}"]
    for label, key in rows:
        e, t = r.engine.get(key), r.transformers.get(key)
        ratio = f"{e / t:.2f}x" if e and t else "-"
        out.append(f"{label:<24}{_fmt(e):>12}{_fmt(t):>14}{ratio:>9}")
    out.append("")
    for name, g in r.goals.items():
        status = "MET" if g["met"] else "MISSED"
        out.append(f"goal {name}: {g['ratio']:.2f}x (need >= {g['goal']:.0f}x) {status}")
    return "\n".join(out)


def _pair(r: Results, key: str, tokens: int, eng: Callable[[], float], hf: Callable[[], float] | None,
          repeats: int) -> None:
    """Time the engine and transformers on one workload, alternating run by run so that load from
    other processes on the machine hits both alike; record median tokens/s."""
    t0 = time.perf_counter()
    eng()
    if hf is not None:
        hf()
    te: list[float] = []
    th: list[float] = []
    for _ in range(repeats):
        te.append(eng())
        if hf is not None:
            th.append(hf())
    r.engine[key] = tokens / statistics.median(te)
    if th:
        r.transformers[key] = tokens / statistics.median(th)
    print(f"{key}: pdserve {_fmt(r.engine[key])} tok/s, transformers {_fmt(r.transformers.get(key))} tok/s "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)


def run(args: argparse.Namespace) -> Results:
    gguf = Path(args.model) if args.model else default_gguf_path()
    concurrencies = sorted({int(c) for c in args.concurrency.split(",")})
    load0 = os.getloadavg()[0]
    eng = EngineBench(str(gguf), args.dtype, args.prompt_len, max(concurrencies),
                      args.decode_prompt_len + args.output_len, args.cpu_threads, args.weight_format)
    cpu, cfg = host_cpu(), eng.config
    r = Results(machine=_machine(), cpu_model=cpu.model, cpu_flags=cpu.reported_flags(),
                torch_cpu_capability=torch_cpu_capability(), dtype=cfg.resolved_dtype,
                dtype_reason=cfg.dtype_reason, model=gguf.name, torch_threads=torch.get_num_threads(),
                prompt_len=args.prompt_len, decode_prompt_len=args.decode_prompt_len,
                output_len=args.output_len, repeats=args.repeats, load_avg=[load0])
    print(f"machine: {r.machine}; torch {torch.__version__} (CPU kernels {r.torch_cpu_capability}), "
          f"{r.torch_threads} threads", flush=True)
    print(f"cpu: {r.cpu_model}; flags: {' '.join(r.cpu_flags) or '-'}", flush=True)
    print(f"model: {gguf.name}, dtype {r.dtype} ({DTYPE_REASONS[r.dtype_reason]}), weight format "
          f"{cfg.resolved_weight_format} ({WEIGHT_FORMAT_REASONS[cfg.weight_format_reason]})", flush=True)
    hf = None if args.skip_transformers else TransformersBench(gguf, cfg.torch_dtype)
    long_prompt = _prompts(1, args.prompt_len, eng.vocab, seed=1)[0]
    decode_prompts = _prompts(max(concurrencies), args.decode_prompt_len, eng.vocab, seed=2)

    key_prefill = f"prefill_{args.prompt_len}"
    _pair(r, key_prefill, args.prompt_len, lambda: eng.prefill(long_prompt),
          None if hf is None else lambda: hf.prefill(long_prompt), args.repeats)
    n = args.output_len
    for c in concurrencies:
        batch = decode_prompts[:c]
        # transformers' decode time: generate(n) minus generate(1) (its prefill and first token).
        hf_decode = None if hf is None else lambda b=batch: hf.generate(b, n) - hf.generate(b, 1)
        _pair(r, f"decode_{c}", c * (n - 1), lambda b=batch: eng.decode(b, n), hf_decode, args.repeats)

    if hf is not None:
        top, low = max(concurrencies), min(concurrencies)
        pr = r.engine[key_prefill] / r.transformers[key_prefill]
        dr = r.engine[f"decode_{top}"] / r.transformers[f"decode_{low}"]
        r.goals["prefill vs transformers"] = {"ratio": pr, "goal": PREFILL_GOAL, "met": pr >= PREFILL_GOAL}
        r.goals[f"decode@{top} vs transformers@{low}"] = {
            "ratio": dr, "goal": DECODE_GOAL, "met": dr >= DECODE_GOAL}
    r.load_avg.append(os.getloadavg()[0])
    return r


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog="pdserve bench engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2-135M GGUF)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="auto: bfloat16 where the CPU has AMX-BF16/AVX512-BF16, else float32")
    p.add_argument("--cpu-threads", type=int, default=0, help="torch threads (0: every CPU this process may use)")
    p.add_argument("--weight-format", default="auto", choices=WEIGHT_FORMATS,
                   help="linear weights of decode-sized steps (EngineConfig.weight_format)")
    p.add_argument("--prompt-len", type=int, default=512, help="prefill prompt tokens")
    p.add_argument("--decode-prompt-len", type=int, default=32, help="prompt tokens of each decode sequence")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per decode sequence")
    p.add_argument("--concurrency", default="1,16", help="comma-separated decode concurrencies")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per figure (median), after one warm-up")
    p.add_argument("--skip-transformers", action="store_true", help="measure the engine only")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    r = run(args)
    print()
    print(_table(r, sorted({int(c) for c in args.concurrency.split(",")})))
    print(f"\n{r.cpu_model} [{' '.join(r.cpu_flags) or '-'}], dtype {r.dtype} ({r.dtype_reason}), "
          f"{r.torch_threads} torch threads")
    print(f"(total {time.perf_counter() - t0:.0f}s; 1-min load average {r.load_avg[0]:.2f} at start, "
          f"{r.load_avg[-1]:.2f} at end, on {os.cpu_count()} cores)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(r), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
