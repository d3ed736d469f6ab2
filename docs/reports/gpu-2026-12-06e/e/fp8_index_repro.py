"""Repro: DeepSeek-V3.2 tiny on CUDA with fp8-e4m3 index keys, in process (run with CUDA_LAUNCH_BLOCKING=1)."""
import sys, tempfile, traceback
from pathlib import Path
import torch
import services.engine.model_runner as mr
from services.engine.index_keys import IndexKeys
from tests.moe_checkpoints import write_tiny_moe
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.text.sampling_params import SamplingParams

mr._index_codec = lambda arch, config: (IndexKeys.resolve_codec(config.index_kv_codec, config.torch_dtype)
                                        if arch.mla is not None and arch.mla.index_head_dim else None)
d = write_tiny_moe(Path(tempfile.mkdtemp()), "deepseek_v32")
cases = [(c, g, dt) for dt in ("float32", "bfloat16") for c, g in (("native", False), ("fp8-e4m3", False), ("fp8-e4m3", True))]
for codec, graphs, dtype in cases:
    try:
        eng = LLMEngine(EngineConfig(model=str(d), dtype=dtype, device="cuda", num_kv_blocks=64,
                                     index_kv_codec=codec, max_prefill_chunk=29, cuda_graphs=graphs))
        out = eng.generate([list(range(5, 75)), list(range(9, 40))],
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        torch.cuda.synchronize()
        print(codec, graphs, dtype, "ok", [o.token_ids if hasattr(o, "token_ids") else o for o in out], flush=True)
    except Exception:
        print(codec, graphs, dtype, "FAILED", flush=True)
        traceback.print_exc()
        sys.exit(1)
