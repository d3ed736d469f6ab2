"""Recipes: a deployment (what ``pdserve up`` starts), a workload, a sweep and SLOs, in one YAML file.

    name: chunked-on
    description: 1P1D, KV sent after every prefill chunk
    deployment:            # started with services.launcher.LocalCluster, stopped after the sweep
      prefill: 1           # prefill instances (0 with colocated)
      decode: 1            # decode instances (colocated: workers)
      colocated: false     # one service does prefill and decode
      kvstore: none        # embedded | none
      kv_transport: shm    # shm | grpc
      chunked_transfer: true
      prefill_chunk: 64    # --max-prefill-chunk of every engine (tokens); 0: the engine default
      router_policy: ""    # round_robin | least_loaded | prefix_aware; empty: the router default
      kv_cache_mib: 256    # KV pool of every engine (MiB)
      prefill_kv_cache_mib: 0   # the prefills' KV pool (their local prefix cache) if not 0
      dtype: auto
      tp: 1                # tensor parallel degree: only 1 (LocalCluster runs one process per engine)
      extra: {}            # more flags per service: {prefill: ["--flag", "value"], router: [...]}
    workload: {workload: random, input_tokens: 256, output_tokens: 16}    # WorkloadConfig fields
    load: {concurrency: [1, 4, 16], requests: 16, warmup: 2}             # LoadConfig fields
    report: {slo_ttft_ms: 2000, slo_tpot_ms: 300}                        # ReportConfig fields

Section keys are the field names of benchmarks/serve/config.py (the flags without ``--``, ``_`` for
``-``); flags given on the command line override a recipe's values. Unknown keys are an error.
The file is read with ``yaml.safe_load`` (plain data only).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks.serve.config import LoadConfig, ReportConfig, WorkloadConfig

SECTIONS = {"workload": WorkloadConfig, "load": LoadConfig, "report": ReportConfig}


class RecipeError(ValueError):
    """A recipe file is malformed; the message names the file and key."""


@dataclass(frozen=True)
class Deployment:
    prefill: int = 1
    decode: int = 1
    colocated: bool = False
    kvstore: str = "none"
    kv_transport: str = "shm"
    chunked_transfer: bool = True
    prefill_chunk: int = 0
    router_policy: str = ""
    kv_cache_mib: int = 256
    prefill_kv_cache_mib: int = 0
    dtype: str = "auto"
    tp: int = 1
    extra: dict[str, list[str]] = field(default_factory=dict)

    def check(self, where: str) -> None:
        def bad(key: str, why: str) -> RecipeError:
            return RecipeError(f"{where}: deployment.{key}: {why}")
        if self.kvstore not in ("embedded", "none"):
            raise bad("kvstore", f"embedded or none, got {self.kvstore!r}")
        if self.kv_transport not in ("shm", "grpc"):
            raise bad("kv_transport", f"shm or grpc, got {self.kv_transport!r}")
        if self.kv_cache_mib < 1 or self.prefill_kv_cache_mib < 0:
            raise bad("kv_cache_mib", "must be >= 1 (prefill_kv_cache_mib >= 0)")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise bad("dtype", f"auto, float32 or bfloat16, got {self.dtype!r}")
        if self.decode < 1 or self.prefill < (0 if self.colocated else 1):
            raise bad("prefill", f"needs >= 1 decode and (unless colocated) >= 1 prefill, got "
                                 f"{self.prefill}P{self.decode}D")
        if self.tp != 1:
            raise bad("tp", "only 1: a local cluster runs each engine as one process (no tensor parallelism)")
        if self.router_policy not in ("", "round_robin", "least_loaded", "prefix_aware"):
            raise bad("router_policy", f"round_robin, least_loaded or prefix_aware, got {self.router_policy!r}")
        if not all(isinstance(v, list) and all(isinstance(a, (str, int, float)) for a in v)
                   for v in self.extra.values()):
            raise bad("extra", "maps a service name to a list of flags")

    def describe(self) -> str:
        shape = f"colocated x{self.decode}" if self.colocated else f"{self.prefill}P{self.decode}D"
        parts = [shape, f"kvstore {self.kvstore}"]
        if not self.colocated:
            parts += [f"transport {self.kv_transport}", f"chunked transfer {'on' if self.chunked_transfer else 'off'}"]
        if self.prefill_chunk:
            parts.append(f"prefill chunk {self.prefill_chunk}")
        if self.prefill_kv_cache_mib and not self.colocated:
            parts.append(f"prefill KV cache {self.prefill_kv_cache_mib} MiB")
        if self.dtype != "auto":
            parts.append(self.dtype)
        if self.router_policy:
            parts.append(f"policy {self.router_policy}")
        return ", ".join(parts)

    def cluster_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of services.launcher.LocalCluster for this deployment."""
        engine = ["--max-prefill-chunk", str(self.prefill_chunk)] if self.prefill_chunk else []
        prefill_kv = self.prefill_kv_cache_mib or self.kv_cache_mib
        extra: dict[str, list[str]] = {"prefill": ["--kv-cache-bytes", str(prefill_kv << 20), *engine],
                                       "decode": ["--kv-cache-bytes", str(self.kv_cache_mib << 20), *engine],
                                       "router": []}
        if not self.chunked_transfer:
            extra["router"].append("--no-chunked-transfer")
        if self.router_policy:
            extra["router"] += ["--policy", self.router_policy]
        for svc, flags in self.extra.items():
            extra[svc] = [*extra.get(svc, []), *(str(a) for a in flags)]
        return {"prefill": 0 if self.colocated else self.prefill, "decode": self.decode,
                "kvstore": None if self.kvstore == "none" else self.kvstore, "dtype": self.dtype,
                "colocated": self.colocated, "kv_transport": self.kv_transport, "extra": extra}


@dataclass(frozen=True)
class Recipe:
    path: str
    name: str
    description: str
    deployment: Deployment
    sections: dict[str, dict[str, str]]
    """Section -> {field: value as flag text}, to merge under the command line's flags."""


def _flag_text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return ",".join(_flag_text(x) for x in v)
    return str(v)


def load_recipe(path: str | Path) -> Recipe:
    where = str(path)
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise RecipeError(f"{where}: {e}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a mapping at the top level")
    extra = set(data) - {"name", "description", "deployment", *SECTIONS}
    if extra:
        raise RecipeError(f"{where}: unknown top-level key(s) {sorted(extra)}")
    dep_data = data.get("deployment") or {}
    known = {f.name for f in dataclasses.fields(Deployment)}
    if not isinstance(dep_data, dict) or set(dep_data) - known:
        raise RecipeError(f"{where}: deployment: unknown key(s) {sorted(set(dep_data) - known)}; known: {sorted(known)}")
    try:
        dep = Deployment(**dep_data)
    except TypeError as e:
        raise RecipeError(f"{where}: deployment: {e}") from None
    dep.check(where)
    sections: dict[str, dict[str, str]] = {}
    for name, cls in SECTIONS.items():
        sec = data.get(name) or {}
        fields = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(sec, dict) or set(sec) - fields:
            raise RecipeError(f"{where}: {name}: unknown key(s) {sorted(set(sec) - fields)}; known: {sorted(fields)}")
        sections[name] = {k: _flag_text(v) for k, v in sec.items()}
    return Recipe(where, str(data.get("name") or Path(path).stem), str(data.get("description") or ""), dep, sections)
