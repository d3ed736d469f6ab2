"""Load this rank's shard of a model (any source the engine loads)."""

from __future__ import annotations

import dataclasses

import torch

from services.engine.model_loader import LoadedModel, build_empty_model, load_model
from services.engine.parallel.group import TPGroup, building
from services.engine.parallel.split import HeadSplit, TensorParallelError
from services.engine.parallel.weights import hf_named_tensors
from services.engine.weights.gguf_loader import GGUFFile
from services.text.model.config import ModelArchConfig
from services.text.model.hf_config import read_hf_config
from services.text.model.random_shapes import random_arch
from services.text.model.source import resolve


def model_arch(spec: str | None) -> ModelArchConfig:
    """The architecture a model spec names (headers only: no weights are read)."""
    src = resolve(spec)
    if src.kind == "random":
        return random_arch(src.shape)
    assert src.path is not None
    return GGUFFile(src.path).arch if src.kind == "gguf" else read_hf_config(src.path)


def check_split(spec: str | None, size: int) -> None:
    """TensorParallelError naming the flag and the model when ``size`` ranks cannot split its heads or MLP."""
    arch = model_arch(spec)
    try:
        HeadSplit(arch.num_heads, arch.num_kv_heads, size)
        widths = {"intermediate_size": arch.intermediate_size}
        if arch.moe is not None:  # every expert is split along its intermediate dimension (models/moe.py)
            widths["moe.intermediate_size"] = arch.moe.intermediate_size
            widths["moe.shared_expert_intermediate_size"] = arch.moe.shared_expert_intermediate_size
        for name, width in widths.items():
            if width % size:
                raise TensorParallelError(f"tensor-parallel size {size} does not divide {name} {width}")
    except TensorParallelError as e:
        raise TensorParallelError(f"--tensor-parallel-size / PDSERVE_TENSOR_PARALLEL_SIZE {size} cannot run "
                                  f"{resolve(spec).model_id}: {e}") from None


def load_shard(spec: str | None, dtype: torch.dtype, device: str | torch.device, group: TPGroup | None,
               *, max_model_len: int | None = None) -> LoadedModel:
    """The model as ``load_model`` loads it, with this rank's shard of every split weight.

    Random models are drawn whole (on the CPU, same seed) and then sharded, so every TP degree runs the
    same weights as TP=1; checkpoints stream their tensors through the model's sharding load_weights."""
    if group is None or group.size == 1:
        return load_model(spec, dtype, device, max_model_len=max_model_len)
    if resolve(spec).kind == "random":
        full = load_model(spec, dtype, "cpu", max_model_len=max_model_len)
        with building(group):
            model = build_empty_model(full.arch, dtype, device)
        model.load_weights(hf_named_tensors(full.model))
        model.eval().requires_grad_(False)
        return dataclasses.replace(full, model=model)
    with building(group):
        return load_model(spec, dtype, device, max_model_len=max_model_len)
