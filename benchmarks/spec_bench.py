"""Speculative decoding: decode tokens/s without speculation, with real acceptance and with synthetic
acceptance, on one workload in one process (``pdserve bench spec``).

The target's weights are loaded once and shared by every engine; each mode gets a fresh engine (and KV
pool) over them. A run adds ``--batch`` greedy requests, lets their prefills finish, then times the
decode steps only: decode tokens/s = tokens generated after the first token of every request / seconds.
Mean acceptance length = tokens a verify step emitted per request (accepted drafts + 1), measured.
Synthetic rows force ``--synthetic-acceptance`` accepted drafts per step (their tokens are NOT the
model's): they show what the step costs at that acceptance, and are labelled ``synthetic``.

CPU (tiny shapes, seconds):   pdserve bench spec --model random:tiny-llama --draft layers:1
CPU (embedded SmolLM2):       pdserve bench spec --draft layers:8
H200 (Llama-3-8B shape, bf16, random weights; draft = its first 2 layers):
    pdserve bench spec --model random:llama-3-8b --draft layers:2 --device cuda:0 --dtype bfloat16 \\
        --batch 16 --prompt-len 512 --max-tokens 256 --spec-tokens 7 --synthetic-acceptance 3 --kv-cache-gib 16
CUDA graphs: on CUDA the plain and the speculative modes replay captured steps (the speculative step is one
graph per batch bucket: services/engine/spec/graphs.py); plain-eager and synthetic-eager run the same
workloads without graphs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common.cli_args import ArgParser
from services.engine.config import EngineConfig
from services.engine.cpu.cpu_features import host_cpu
from services.engine.engine import LLMEngine
from services.engine.model_loader import load_model
from services.text.sampling_params import SamplingParams

TEXT = ("The history of the lighthouse keepers on the northern coast is a story of long winters, careful "
        "routines and ships guided home through the fog. Every evening the keeper climbed the tower, ")


@dataclass
class ModeResult:
    mode: str
    """plain | plain-eager | real | synthetic | synthetic-eager."""
    decode_tokens: int
    decode_s: float
    mean_acceptance_length: float | None = None
    """Tokens per verify step per request (accepted drafts + 1); None without speculation."""
    acceptance_rate: float | None = None
    """Accepted / proposed drafts."""
    steps: int = 0
    """Engine steps in the timed part."""
    graph_steps: int | None = None
    """Of those, speculative steps replayed as one CUDA graph (None: no speculative graphs)."""

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


@dataclass
class Results:
    machine: str
    cpu_model: str
    cpu_flags: list[str]
    device: str
    dtype: str
    model: str
    draft: str
    spec_tokens: int
    synthetic_acceptance: float
    batch: int
    prompt_len: int
    max_tokens: int
    load_avg: list[float] = field(default_factory=list)
    modes: list[ModeResult] = field(default_factory=list)


def _prompts(loaded, n: int, length: int, seed: int) -> list[list[int]]:
    """Windows of natural text (acceptance depends on the text), or random byte ids if the text is short."""
    ids = loaded.tokenizer.encode(TEXT * (1 + length // 30))
    if len(ids) >= length + n:
        return [ids[i:i + length] for i in range(n)]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, min(loaded.arch.vocab_size, 256), (n, length), generator=g).tolist()


@torch.inference_mode()
def early_exit_agreement(loaded, ids: list[int], layers: list[int]) -> dict[int, float]:
    """Per N: the fraction of positions of ``ids`` where the ``layers:N`` draft's greedy token equals the
    full target's (one teacher-forced forward each; an upper-bound view of greedy acceptance per draft)."""
    from services.engine.attention import ForwardContext, TorchPagedAttention
    from services.engine.spec.draft import LayerSkipDraft
    from services.engine.step_inputs import prepare_rows

    a, bs = loaded.arch, 16
    table = list(range(-(-len(ids) // bs)))
    device = next(loaded.model.parameters()).device

    def argmax(model, num_layers: int) -> torch.Tensor:
        cache = torch.zeros(num_layers, 2, len(table), bs, a.num_kv_heads, a.head_dim,
                            dtype=next(loaded.model.parameters()).dtype, device=device)
        i, p, meta = prepare_rows([(ids, 0, table)], bs, device)
        backend = TorchPagedAttention(cache, a.head_dim ** -0.5)
        return model.compute_logits(model(i, p, ForwardContext(backend, meta))).argmax(-1)

    full = argmax(loaded.model, a.num_layers)
    return {n: float((argmax(LayerSkipDraft(loaded.model, n), n) == full).float().mean()) for n in layers}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _decode_run(eng: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[int, float, int]:
    """(decode tokens, seconds, steps) of one batch, timed from the step after every request's first token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", p, params, detokenize=False)
    started: set[str] = set()
    while len(started) < len(prompts) and eng.has_work():
        started.update(o.request_id for o in eng.step() if o.new_token_ids)
    _sync(eng.config.device)
    t0, tokens, steps = time.perf_counter(), 0, 0
    while eng.has_work():
        tokens += sum(len(o.new_token_ids) for o in eng.step())
        steps += 1
    _sync(eng.config.device)
    return tokens, time.perf_counter() - t0, steps


def _mode(base: EngineConfig, loaded, mode: str, args: argparse.Namespace, prompts: list[list[int]]) -> ModeResult:
    spec = mode in ("real", "synthetic", "synthetic-eager")
    cfg = dataclasses.replace(
        base, draft_model=args.draft if spec else "", spec_tokens=args.spec_tokens if spec else 0,
        spec_synthetic_acceptance=args.synthetic_acceptance if mode.startswith("synthetic") else 0.0,
        cuda_graphs=base.cuda_graphs and not mode.endswith("-eager"))
    eng = LLMEngine(cfg, loaded=loaded)
    _decode_run(eng, prompts[:2], 8, f"warm-{mode}")  # warm-up: kernels, graphs, allocator
    if spec:
        eng.runner.spec.stats = dataclasses.replace(eng.runner.spec.stats, proposed=0, accepted=0, steps=0,
                                                    accept_hist=[])
    graphs = eng.runner.spec.graphs if spec else None
    replays = [0]
    if graphs is not None:
        run_graph = graphs.run

        def counted(bucket, steps):  # type: ignore[no-untyped-def]
            replays[0] += 1
            return run_graph(bucket, steps)

        graphs.run = counted  # type: ignore[method-assign]
    tokens, secs, steps = _decode_run(eng, prompts, args.max_tokens, mode)
    r = ModeResult(mode, tokens, secs, steps=steps, graph_steps=replays[0] if graphs is not None else None)
    if spec:
        st = eng.runner.spec.stats
        r.mean_acceptance_length = st.mean_accepted + 1
        r.acceptance_rate = st.accepted / st.proposed if st.proposed else 0.0
    del eng
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return r


def run(args: argparse.Namespace) -> Results:
    cpu = host_cpu()
    base = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=16,
                        max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.prompt_len * 2),
                        max_prefill_chunk=max(512, args.prompt_len), enable_prefix_caching=False,
                        kv_cache_bytes=args.kv_cache_gib << 30, seed=args.seed, cpu_threads=args.cpu_threads)
    base.apply_host()
    loaded = load_model(args.model, base.torch_dtype, args.device, seed=args.seed)
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "no GPU"
    r = Results(machine=f"{len(cpu.cpus)} CPUs {platform.machine()} {cpu.model}, {gpu}", cpu_model=cpu.model,
                cpu_flags=cpu.reported_flags(), device=args.device, dtype=base.resolved_dtype,
                model=loaded.model_id, draft=args.draft, spec_tokens=args.spec_tokens,
                synthetic_acceptance=args.synthetic_acceptance, batch=args.batch, prompt_len=args.prompt_len,
                max_tokens=args.max_tokens, load_avg=[os.getloadavg()[0]])
    prompts = _prompts(loaded, args.batch, args.prompt_len, args.seed)
    cuda = args.device.startswith("cuda")
    modes = ["plain", *(["plain-eager"] if cuda else []), "real", "synthetic", *(["synthetic-eager"] if cuda else [])]
    for mode in modes:
        r.modes.append(_mode(base, loaded, mode, args, prompts))
        print(_line(r.modes[-1], r.modes[0]), flush=True)
    r.load_avg.append(os.getloadavg()[0])
    return r


def _line(m: ModeResult, plain: ModeResult) -> str:
    label = {"plain": "no speculation", "plain-eager": "no speculation, no CUDA graphs",
             "real": "speculation, real acceptance", "synthetic": "speculation, SYNTHETIC acceptance",
             "synthetic-eager": "speculation, SYNTHETIC acceptance, no CUDA graphs"}[m.mode]
    acc = "" if m.mean_acceptance_length is None else (
        f"  mean acceptance length {m.mean_acceptance_length:.2f} (accept rate {m.acceptance_rate:.2f})")
    graphs = "" if m.graph_steps is None else f"  {m.graph_steps}/{m.steps} steps in the speculative graph"
    return (f"{m.mode:<15} {m.tokens_per_s:9.1f} decode tok/s  x{m.tokens_per_s / plain.tokens_per_s:5.2f} vs plain"
            f"  [{label}]{acc}{graphs}  ({1000 * m.decode_s / max(m.steps, 1):.2f} ms/step)")


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog="pdserve bench spec", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="target: .gguf, HF dir or random:NAME (default: embedded SmolLM2)")
    p.add_argument("--draft", default="layers:8", help="draft: layers:N, .gguf, HF dir or random:NAME")
    p.add_argument("--spec-tokens", type=int, default=7, help="drafts per step (K)")
    p.add_argument("--synthetic-acceptance", type=float, default=3.0,
                   help="accepted drafts per step in the synthetic run (<= K)")
    p.add_argument("--batch", type=int, default=4, help="concurrent requests")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=64, help="generated tokens per request")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="KV pool (target + draft regions), GiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-threads", type=int, default=0, help="torch threads (0: every CPU this process may use)")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument("--agreement", default="", help="only print, for these comma-separated N, how often the "
                                                   "layers:N draft's greedy token equals the target's (128 tokens)")
    args = p.parse_args(argv)
    if args.agreement:
        loaded = load_model(args.model, torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype))
        ids = loaded.tokenizer.encode(TEXT * 8)[:128]
        for n, frac in early_exit_agreement(loaded, ids, [int(x) for x in args.agreement.split(",")]).items():
            print(f"layers:{n:<3} greedy agreement with the target {frac:.2f}")
        return 0
    cpu = host_cpu()
    print(f"CPU: {cpu.model} [{' '.join(cpu.reported_flags()) or '-'}], load {os.getloadavg()[0]:.1f}; "
          f"device {args.device}; target {args.model or 'embedded SmolLM2-135M'}, draft {args.draft}, "
          f"K={args.spec_tokens}, batch {args.batch}, prompt {args.prompt_len}, output {args.max_tokens}")
    r = run(args)
    print(f"dtype {r.dtype}; load average {r.load_avg[0]:.1f} -> {r.load_avg[-1]:.1f}")
    if args.json is not None:
        out = dataclasses.asdict(r)
        for m, d in zip(r.modes, out["modes"], strict=True):
            d["tokens_per_s"] = m.tokens_per_s
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
