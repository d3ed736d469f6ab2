"""HF model directories: config.json -> ModelArchConfig, *.safetensors (single or sharded) -> tensors."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from services.engine.models.config import ModelArchConfig, ModelConfigError
from services.engine.weights.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

_INDEX = "model.safetensors.index.json"


def read_hf_config(model_dir: str | os.PathLike[str]) -> ModelArchConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"HF model directory {model_dir}: missing {path}")
    try:
        cfg = json.loads(path.read_text())
        arch = ModelArchConfig.from_hf_config(cfg)
    except (json.JSONDecodeError, ModelConfigError) as e:
        raise ModelLoadError(f"{path}: {e}") from e
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():  # generation_config's eos list (e.g. Llama-3 instruct) extends config.json's
        eos = json.loads(gen.read_text()).get("eos_token_id")
        extra = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        arch.eos_token_ids = sorted(set(arch.eos_token_ids) | {int(e) for e in extra})
    return arch


def safetensors_files(model_dir: str | os.PathLike[str]) -> list[Path]:
    """The weight files: the shards the index lists, else every *.safetensors in the directory."""
    root = Path(model_dir)
    index = root / _INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [root / s for s in shards]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that do not exist: {missing}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"HF model directory {root}: no *.safetensors files (nor {_INDEX})")
    return files


def iter_safetensors(model_dir: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor in the file's dtype), one tensor at a time."""
    from safetensors import safe_open

    for f in safetensors_files(model_dir):
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    yield name, sf.get_tensor(name)
        except (OSError, RuntimeError) as e:
            raise ModelLoadError(f"cannot read safetensors file {f}: {e}") from e
