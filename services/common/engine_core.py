"""``--engine-core``: where an engine-backed service's step loop runs (decode, colocated worker, prefill)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import opt


@dataclass
class EngineCoreConfig:
    engine_core: str = opt("auto", "Where the step loop runs. process: in an engine-core process of its own that "
                                   "owns the device, reached over a local socket pair with typed frames (the front "
                                   "and the step loop never share an interpreter; a prefill's front maps the core's "
                                   "KV pool and moves the pages itself); thread: on a thread of this process, "
                                   "beside the gRPC front; auto: process, except where the loop must share this "
                                   "process with what lives here: --tensor-parallel-size > 1 (the ranks), a "
                                   "decode's --kv-mooncake-host (the transfer engine registers the pool), and for a "
                                   "prefill --kv-transport mooncake, --kv-export-layer-group-cpu, "
                                   "--draft-model or a model whose pages have several regions; there it is thread.",
                           choices=("auto", "thread", "process"))
