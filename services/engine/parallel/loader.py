"""Load this rank's shard of a model (any source the engine loads)."""

from __future__ import annotations

import dataclasses

import torch

from services.engine.model_loader import LoadedModel, build_empty_model, load_model
from services.engine.model_source import resolve
from services.engine.parallel.group import TPGroup, building
from services.engine.parallel.weights import hf_named_tensors


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
