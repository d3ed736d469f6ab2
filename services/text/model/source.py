"""What a model spec names, and what can be read from it without weights or torch.

spec: None (the embedded default GGUF), a path to a ``.gguf`` file, an HF directory (config.json +
safetensors), or ``random:NAME`` (see RANDOM_SHAPES). :func:`load_tokenizer` reads the tokenizer
(``tokenizers`` + the jinja2 chat template), the model id and the context length from GGUF metadata,
an HF directory's JSON files or a random shape: numpy and ``gguf``, never torch, so the router, which
runs no model, starts without it (tests/router/test_no_torch.py). The engine's ``load_model``
(engine/model_loader.py) resolves specs and builds tokenizers through these same functions, so router and
workers agree on token ids, chat rendering, model id and context length.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

from services.text.model.config import ModelArchConfig
from services.text.model.errors import ModelLoadError
from services.text.model.gguf_meta import GGUFMetadata, default_gguf_path
from services.text.model.hf_config import read_hf_config
from services.text.model.random_shapes import BYTE_EOS_ID, RANDOM_SHAPES, random_arch
from services.text.tokenizer import Tokenizer

__all__ = ["RANDOM_PREFIX", "ModelSource", "TokenizerInfo", "gguf_tokenizer", "hf_tokenizer", "load_tokenizer",
           "resolve"]

log = logging.getLogger(__name__)

RANDOM_PREFIX = "random:"


@dataclass(frozen=True)
class ModelSource:
    """A resolved spec: a random shape's name, a GGUF file or an HF directory (which exist)."""

    kind: Literal["random", "gguf", "hf"]
    spec: str | None
    shape: str = ""
    """Random shape name (kind "random")."""
    path: Path | None = None
    """The GGUF file or the HF directory (kinds "gguf", "hf")."""

    @property
    def model_id(self) -> str:
        """Stable id for layout fingerprints: GGUF file stem, HF directory name, or the random spec."""
        if self.path is None:
            return str(self.spec)
        return self.path.stem if self.kind == "gguf" else self.path.resolve().name


class TokenizerInfo(NamedTuple):
    tokenizer: Tokenizer
    model_id: str
    max_model_len: int
    """The model's trained context (tokens): the longest prompt + output the workers run by default."""


def _valid_specs() -> str:
    return ("None (embedded SmolLM2 GGUF), a .gguf path, an HF model directory, or one of "
            + ", ".join(RANDOM_PREFIX + n for n in RANDOM_SHAPES))


def resolve(spec: str | None) -> ModelSource:
    """Which model ``spec`` names; ModelLoadError naming the spec and the valid forms otherwise."""
    if spec is not None and spec.startswith(RANDOM_PREFIX):
        name = spec[len(RANDOM_PREFIX):]
        if name not in RANDOM_SHAPES:
            raise ModelLoadError(f"unknown random model {spec!r}; valid specs: {_valid_specs()}")
        return ModelSource("random", spec, shape=name)
    path = default_gguf_path() if spec is None else Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model {spec if spec is not None else path}: {path} does not exist; "
                             f"valid specs: {_valid_specs()}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file {path}: expected a .gguf file; valid specs: {_valid_specs()}")
        return ModelSource("gguf", spec, path=path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {path}: missing {path / 'config.json'}")
    return ModelSource("hf", spec, path=path)


def gguf_tokenizer(gguf: GGUFMetadata) -> Tokenizer:
    try:
        return Tokenizer.from_gguf_metadata(gguf.metadata)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{gguf.path}: cannot build the tokenizer: {e}") from e


def hf_tokenizer(path: Path, arch: ModelArchConfig) -> Tokenizer:
    """tokenizer.json's tokenizer, or the byte-level one when the vocab can hold it; fills in
    ``arch.eos_token_ids`` from the tokenizer when config.json names none."""
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


def load_tokenizer(spec: str | None) -> TokenizerInfo:
    """The tokenizer, model id and context length of ``spec``, without weights (for the router)."""
    src = resolve(spec)
    if src.kind == "random":
        return TokenizerInfo(Tokenizer.byte_level(BYTE_EOS_ID), src.model_id,
                             random_arch(src.shape).max_position_embeddings)
    assert src.path is not None
    if src.kind == "gguf":
        gguf = GGUFMetadata(src.path)
        return TokenizerInfo(gguf_tokenizer(gguf), src.model_id, gguf.arch.max_position_embeddings)
    arch = read_hf_config(src.path)
    return TokenizerInfo(hf_tokenizer(src.path, arch), src.model_id, arch.max_position_embeddings)
