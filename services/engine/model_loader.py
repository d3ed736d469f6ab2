"""`load_model(spec, dtype, device)`: one entry point for every model source.

spec: as :func:`services.text.model.source.resolve` reads it (None: the embedded GGUF, a ``.gguf``
path, an HF directory, ``random:NAME``). Weights are materialized directly in the target dtype on
the target device (the module is built on the meta device first).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.models.fp8_linear import KeptFp8, keep_fp8, swap_in_random_fp8
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.registry import get_model_class
from services.engine.weights.fp8_block import dequantized, tensor_headers
from services.engine.weights.gguf_loader import GGUFFile
from services.engine.weights.hf_loader import iter_safetensors, safetensors_files
from services.engine.weights.random_weights import init_random_
from services.text.model.config import ModelArchConfig
from services.text.model.errors import ModelLoadError
from services.text.model.hf_config import read_hf_config
from services.text.model.random_shapes import BYTE_EOS_ID, random_arch
from services.text.model.source import RANDOM_PREFIX, gguf_tokenizer, hf_tokenizer, resolve
from services.text.tokenizer import Tokenizer

__all__ = ["RANDOM_PREFIX", "LoadedModel", "ModelLoadError", "build_empty_model", "load_model"]

log = logging.getLogger(__name__)

FP8_MODEL_ID_SUFFIX = "+fp8"
"""Appended to a random model's id when its linears are FP8 block-scaled: other weights, other math, so another
KV layout fingerprint than the plain build of the same shape (on the CPU, or at tensor-parallel size > 1)."""

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


def build_empty_model(arch: ModelArchConfig, dtype: torch.dtype, device: str | torch.device,
                      on_meta: Callable[[LlamaForCausalLM], None] | None = None) -> LlamaForCausalLM:
    """Model with uninitialized parameters allocated once, in `dtype` on `device`; RoPE tables in fp32.
    on_meta: called with the model on the meta device, in `dtype`, before anything is allocated (it may swap
    modules: FP8 linears kept fp8)."""
    if dtype not in SUPPORTED_DTYPES:
        raise ModelLoadError(f"dtype={dtype}: supported are {SUPPORTED_DTYPES}")
    with torch.device("meta"):
        model = get_model_class(arch.architecture)(arch)
    model = model.to(dtype=dtype)
    if on_meta is not None:
        on_meta(model)
    model = model.to_empty(device=device)
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


def load_model(spec: str | None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               *, seed: int = 0, max_model_len: int | None = None, keep_fp8: bool | None = None) -> LoadedModel:
    """Load a model, its tokenizer and architecture. Raises ModelLoadError naming the spec/file.

    keep_fp8: for FP8 block-scaled checkpoints (and random shapes that declare FP8 blocks), whether linears keep
    (get) fp8 weights (FP8 GEMM) instead of dequantized (plain) ones; None: on CUDA in bf16/fp16 at
    tensor-parallel size 1 (models/fp8_linear.py); True on the CPU computes them with the torch reference (tests)."""
    src = resolve(spec)
    if src.kind == "random":
        return _load_random(src.shape, src.model_id, dtype, device, seed, max_model_len, keep_fp8)
    path = src.path
    assert path is not None
    if src.kind == "gguf":
        gguf = GGUFFile(path)
        tokenizer = gguf_tokenizer(gguf)
        model = build_empty_model(gguf.arch, dtype, device)
        _load_weights(model, gguf.tensors(), path)
        return _finish(model, gguf.arch, tokenizer, src.model_id, max_model_len)
    arch = read_hf_config(path)
    tokenizer = hf_tokenizer(path, arch)
    kept = _kept_fp8(arch, path, dtype, device, keep_fp8)
    model = build_empty_model(arch, dtype, device, None if kept is None else kept.swap_in)
    weights = iter_safetensors(path)
    if arch.fp8_weight_block is not None:  # FP8 block-scaled weights: dequantized one by one as they stream in
        weights = dequantized(weights, (arch.fp8_weight_block[0], arch.fp8_weight_block[1]),
                              keep=frozenset() if kept is None else kept.names)
        if kept is not None:  # the kept ones' scales go straight into their modules
            weights = kept.placed_scales(weights, model)
    _load_weights(model, weights, path)
    return _finish(model, arch, tokenizer, src.model_id, max_model_len)


def _load_random(shape: str, model_id: str, dtype: torch.dtype, device: str | torch.device, seed: int,
                 max_model_len: int | None, requested: bool | None) -> LoadedModel:
    """A random model of ``shape``; a shape with FP8 blocks gets Fp8BlockLinear modules filled with random e4m3
    weights and block scales where :func:`keep_fp8` keeps a checkpoint's (its model_id then says ``+fp8``)."""
    arch = random_arch(shape)
    block = _random_fp8_block(arch, model_id, dtype, device, requested)
    on_meta = None if block is None else functools.partial(_swap_random_fp8, block=block, model_id=model_id)
    model = build_empty_model(arch, dtype, device, on_meta)
    init_random_(model, seed)
    if block is not None:
        model_id += FP8_MODEL_ID_SUFFIX
    return _finish(model, arch, Tokenizer.byte_level(BYTE_EOS_ID), model_id, max_model_len)


def _random_fp8_block(arch: ModelArchConfig, model_id: str, dtype: torch.dtype, device: str | torch.device,
                      requested: bool | None) -> tuple[int, int] | None:
    """The FP8 blocks of a random shape's linears when they are built fp8 here, else None (said in one line for a
    shape that declares them)."""
    if arch.fp8_weight_block is None:
        return None
    try:
        kept = keep_fp8(device, dtype, requested)
    except ValueError as e:
        raise ModelLoadError(f"{model_id}: {e}") from None
    if not kept:
        log.info("engine: %s declares FP8 block-scaled linears; on %s in %s they are plain linears of random "
                 "weights in the compute dtype (fp8 on CUDA in bf16/fp16 at tensor-parallel size 1)", model_id,
                 torch.device(device).type, str(dtype).removeprefix("torch."))
        return None
    return arch.fp8_weight_block[0], arch.fp8_weight_block[1]


def _swap_random_fp8(model: LlamaForCausalLM, block: tuple[int, int], model_id: str) -> None:
    """build_empty_model's on_meta hook of an FP8 random model: swap its linears in and say how many."""
    count = swap_in_random_fp8(model, block)
    log.info("engine: %s: %d linears FP8 block-scaled in %dx%d blocks (random e4m3 weights, fp32 scales), run by "
             "the FP8 block GEMM; embedding, LM head, norms, routers, kv_b_proj and the routed experts stay in the "
             "compute dtype", model_id, count, block[0], block[1])


def _kept_fp8(arch: ModelArchConfig, path: Path, dtype: torch.dtype, device: str | torch.device,
              requested: bool | None) -> KeptFp8 | None:
    """The FP8 linears of an FP8 block-scaled checkpoint that stay fp8 (planned from the tensor headers when
    the model is built), or None when every fp8 weight is dequantized at load."""
    if arch.fp8_weight_block is None:
        return None
    try:
        if not keep_fp8(device, dtype, requested):
            return None
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    try:
        headers = tensor_headers(safetensors_files(path))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: cannot read the safetensors headers: {e}") from e
    return KeptFp8(headers, (arch.fp8_weight_block[0], arch.fp8_weight_block[1]))
