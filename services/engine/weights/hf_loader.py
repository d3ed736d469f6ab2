"""HF model directories: *.safetensors (single or sharded) -> tensors (their config.json:
services/text/model/hf_config.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from services.text.model.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

_INDEX = "model.safetensors.index.json"


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
