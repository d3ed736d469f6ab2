"""`load_model(spec, dtype, device)`: one entry point for every model source.

spec: None (the embedded default GGUF), a path to a ``.gguf`` file, an HF directory (config.json +
safetensors), or ``random:NAME`` (see RANDOM_SHAPES). Weights are materialized directly in the
target dtype on the target device (the module is built on the meta device first).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.models import LlamaForCausalLM, ModelArchConfig, get_model_class
from services.engine.tokenizer import Tokenizer
from services.engine.weights.errors import ModelLoadError
from services.engine.weights.gguf_loader import GGUFFile, default_gguf_path
from services.engine.weights.hf_loader import iter_safetensors, read_hf_config
from services.engine.weights.random_weights import BYTE_EOS_ID, RANDOM_SHAPES, init_random_, random_arch

__all__ = ["RANDOM_PREFIX", "LoadedModel", "ModelLoadError", "build_empty_model", "load_model", "load_tokenizer"]

log = logging.getLogger(__name__)

RANDOM_PREFIX = "random:"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    """Eval mode, no grad, on the requested device and dtype."""
    arch: ModelArchConfig
    tokenizer: Tokenizer
    model_id: str
    """Stable id for layout fingerprints: GGUF file stem, HF directory name, or the random spec."""
    max_model_len: int
    """Longest sequence (prompt + output tokens) the engine may run."""


def _valid_specs() -> str:
    return ("None (embedded SmolLM2 GGUF), a .gguf path, an HF model directory, or one of "
            + ", ".join(RANDOM_PREFIX + n for n in RANDOM_SHAPES))


def build_empty_model(arch: ModelArchConfig, dtype: torch.dtype, device: str | torch.device
                      ) -> LlamaForCausalLM:
    """Model with uninitialized parameters allocated once, in `dtype` on `device`; RoPE tables in fp32."""
    if dtype not in SUPPORTED_DTYPES:
        raise ModelLoadError(f"dtype={dtype}: supported are {SUPPORTED_DTYPES}")
    with torch.device("meta"):
        model = get_model_class(arch.architecture)(arch)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.init_buffers()
    return model


def _finish(model: LlamaForCausalLM, arch: ModelArchConfig, tokenizer: Tokenizer, model_id: str,
            max_model_len: int | None) -> LoadedModel:
    model.eval().requires_grad_(False)
    limit = arch.max_position_embeddings if max_model_len is None else min(max_model_len,
                                                                           arch.max_position_embeddings)
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer, model_id=model_id, max_model_len=limit)


def _load_weights(model: LlamaForCausalLM, weights: object, source: Path) -> None:
    try:
        model.load_weights(weights)  # type: ignore[arg-type]
    except ValueError as e:
        raise ModelLoadError(f"{source}: {e}") from e


def _resolve(spec: str | None) -> tuple[str, Path | str]:
    """spec -> ("random", name) | ("gguf", file) | ("hf", directory); ModelLoadError otherwise."""
    if spec is not None and spec.startswith(RANDOM_PREFIX):
        name = spec[len(RANDOM_PREFIX):]
        if name not in RANDOM_SHAPES:
            raise ModelLoadError(f"unknown random model {spec!r}; valid specs: {_valid_specs()}")
        return "random", name
    path = default_gguf_path() if spec is None else Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model {spec if spec is not None else path}: {path} does not exist; "
                             f"valid specs: {_valid_specs()}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file {path}: expected a .gguf file; valid specs: {_valid_specs()}")
        return "gguf", path
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {path}: missing {path / 'config.json'}")
    return "hf", path


def _gguf_tokenizer(gguf: GGUFFile) -> Tokenizer:
    try:
        return Tokenizer.from_gguf_metadata(gguf.metadata)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{gguf.path}: cannot build the tokenizer: {e}") from e


def _hf_tokenizer(path: Path, arch: ModelArchConfig) -> Tokenizer:
    if (path / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_hf_dir(path)
    elif arch.vocab_size > BYTE_EOS_ID:
        log.warning("%s has no tokenizer.json; using the byte-level tokenizer (eos id %d)", path, BYTE_EOS_ID)
        tokenizer = Tokenizer.byte_level(BYTE_EOS_ID)
    else:
        raise ModelLoadError(f"model directory {path}: missing {path / 'tokenizer.json'}")
    if not arch.eos_token_ids:
        arch.eos_token_ids = sorted(tokenizer.eos_token_ids)
    return tokenizer


def load_tokenizer(spec: str | None) -> tuple[Tokenizer, str, int]:
    """(tokenizer, model_id, max_model_len) of a spec without loading weights (for the router)."""
    kind, where = _resolve(spec)
    if kind == "random":
        return Tokenizer.byte_level(BYTE_EOS_ID), str(spec), random_arch(str(where)).max_position_embeddings
    path = Path(where)
    if kind == "gguf":
        gguf = GGUFFile(path)
        return _gguf_tokenizer(gguf), path.stem, gguf.arch.max_position_embeddings
    arch = read_hf_config(path)
    return _hf_tokenizer(path, arch), path.resolve().name, arch.max_position_embeddings


def load_model(spec: str | None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               *, seed: int = 0, max_model_len: int | None = None) -> LoadedModel:
    """Load a model, its tokenizer and architecture. Raises ModelLoadError naming the spec/file."""
    kind, where = _resolve(spec)
    if kind == "random":
        arch = random_arch(str(where))
        model = build_empty_model(arch, dtype, device)
        init_random_(model, seed)
        return _finish(model, arch, Tokenizer.byte_level(BYTE_EOS_ID), str(spec), max_model_len)
    path = Path(where)
    if kind == "gguf":
        gguf = GGUFFile(path)
        tokenizer = _gguf_tokenizer(gguf)
        model = build_empty_model(gguf.arch, dtype, device)
        _load_weights(model, gguf.tensors(), path)
        return _finish(model, gguf.arch, tokenizer, path.stem, max_model_len)
    arch = read_hf_config(path)
    tokenizer = _hf_tokenizer(path, arch)
    model = build_empty_model(arch, dtype, device)
    _load_weights(model, iter_safetensors(path), path)
    return _finish(model, arch, tokenizer, path.resolve().name, max_model_len)
