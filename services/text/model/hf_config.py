"""HF model directories: config.json (and generation_config.json's eos ids) -> ModelArchConfig, without torch
(the tensors: engine/weights/hf_loader.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from services.text.model.config import ModelArchConfig, ModelConfigError
from services.text.model.errors import ModelLoadError


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
