"""``pdserve generate``: run the engine in this process and stream the answer to stdout."""

from __future__ import annotations

import sys
import time

from services.common.cli_args import ArgParser
from services.common.config import add_dataclass_args, from_args
from services.common.logging import LoggingConfig, setup_logging
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.text.sampling_params import InvalidRequestError, SamplingParams


def main(argv: list[str]) -> int:
    p = ArgParser(prog="pdserve generate")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--model", default=None, help="a .gguf, a HF directory or random:NAME (default: embedded)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="auto: bfloat16 on GPU or a CPU with AMX/AVX512-BF16, else float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    add_dataclass_args(p, LoggingConfig)
    args = p.parse_args(argv)
    setup_logging("generate", from_args(LoggingConfig, args))

    # A model that cannot load (or a config field it refuses) raises an expected error: the CLI prints it
    # as one line, with the traceback at --log-level DEBUG.
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                    kv_cache_bytes=256 << 20))
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    ids = tok.encode(text, add_special_tokens=not args.chat)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=args.stop)
    try:
        engine.add_request("cli", ids, params)
    except InvalidRequestError as e:
        print(f"pdserve generate: error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    n = 0
    reason = None
    while engine.has_work():
        for o in engine.step():
            n += len(o.new_token_ids)
            sys.stdout.write(o.new_text)
            sys.stdout.flush()
            if o.finished:
                reason = o.finish_reason
    dt = time.perf_counter() - t0
    print(f"\n[{n} tokens in {dt:.2f}s, {n / dt:.1f} tok/s, finish_reason={reason.value if reason else None}]",
          file=sys.stderr)
    return 0
