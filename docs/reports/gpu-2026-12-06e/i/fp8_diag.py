"""Diagnose the fp8 index-key misaligned address: tensor alignments, int args and the compiled PTX's global loads of
the index score kernel as the engine launches it (CUDA_LAUNCH_BLOCKING=1)."""
import re, sys, tempfile, traceback
from pathlib import Path
import torch
import services.engine.model_runner as mr
import services.kernels.index_topk as it
from services.engine.index_keys import IndexKeys
from tests.moe_checkpoints import write_tiny_moe
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.text.sampling_params import SamplingParams

mr._index_codec = lambda arch, config: (IndexKeys.resolve_codec(config.index_kv_codec, config.torch_dtype)
                                        if arch.mla is not None and arch.mla.index_head_dim else None)
orig_kernel = it._index_score_kernel
seen = []

class Spy:
    def __getitem__(self, grid):
        launch = orig_kernel[grid]
        def run(*args, **kw):
            if len(seen) < 2:
                info = []
                for i, a in enumerate(args):
                    if isinstance(a, torch.Tensor):
                        info.append(f"arg{i} {a.dtype} shape={tuple(a.shape)} stride={a.stride()} ptr%16={a.data_ptr() % 16}")
                    else:
                        info.append(f"arg{i} {a!r}")
                print("LAUNCH", grid, kw, "\n  " + "\n  ".join(info), flush=True)
            try:
                k = launch(*args, **kw)
            finally:
                if len(seen) < 2:
                    seen.append(1)
            if len(seen) <= 2 and k is not None and hasattr(k, "asm"):
                for line in k.asm["ptx"].splitlines():
                    if "ld.global" in line or "st.global" in line:
                        print("   PTX", line.strip(), flush=True)
            return k
        return run
it._index_score_kernel = Spy()
d = write_tiny_moe(Path(tempfile.mkdtemp()), "deepseek_v32")
try:
    eng = LLMEngine(EngineConfig(model=str(d), dtype="float32", device="cuda", num_kv_blocks=64,
                                 index_kv_codec="fp8-e4m3", max_prefill_chunk=29, cuda_graphs=False))
    out = eng.generate([list(range(5, 75))], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    torch.cuda.synchronize()
    print("ok", out)
except Exception:
    traceback.print_exc()
