"""Host reads per speculative decode step (eager path, CPU): calls of Tensor.cpu / tolist / item / int()
and the elements they move, averaged over ``--steps`` decode steps of ``--batch`` greedy sequences.

    python -m benchmarks.spec_host_reads                # tiny random model, layers:1 draft, K=7, batch 16

A device->host read is a synchronisation on GPU; elements x 4 bytes is what an fp32 logits copy moves.
"""

from __future__ import annotations

import collections

import torch

from services.common.cli_args import ArgParser
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.text.sampling_params import SamplingParams

_READS = ("cpu", "tolist", "item", "__int__", "__index__")


def count(model: str, draft: str, k: int, batch: int, steps: int, synthetic: float) -> tuple[dict, dict]:
    """(calls per step, elements per step) by read kind, over decode steps after every prefill."""
    eng = LLMEngine(EngineConfig(model=model, dtype="float32", num_kv_blocks=batch * 8, block_size=16,
                                 max_num_seqs=batch, draft_model=draft, spec_tokens=k,
                                 spec_synthetic_acceptance=synthetic))
    params = SamplingParams(max_tokens=8 * steps * (k + 1), ignore_eos=True, temperature=0)
    for i in range(batch):
        eng.add_request(str(i), list(range(1 + i, 40 + i)), params, detokenize=False)
    while any(s.num_output_tokens == 0 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    calls: collections.Counter[str] = collections.Counter()
    elems: collections.Counter[str] = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def counted(name: str):  # type: ignore[no-untyped-def]
        def read(self, *a, **kw):  # type: ignore[no-untyped-def]
            calls[name] += 1
            elems[name] += self.numel()
            return originals[name](self, *a, **kw)
        return read

    try:
        for name in _READS:
            setattr(torch.Tensor, name, counted(name))
        for _ in range(steps):
            eng.step()
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
    return {n: c / steps for n, c in calls.items()}, {n: e / steps for n, e in elems.items()}


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog="python -m benchmarks.spec_host_reads", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:tiny-llama")
    p.add_argument("--draft", default="layers:1")
    p.add_argument("--spec-tokens", type=int, default=7)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--synthetic-acceptance", type=float, default=3.0)
    a = p.parse_args(argv)
    calls, elems = count(a.model, a.draft, a.spec_tokens, a.batch, a.steps, a.synthetic_acceptance)
    print(f"per step (K={a.spec_tokens}, batch {a.batch}): host reads {dict(calls)}, elements {dict(elems)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
