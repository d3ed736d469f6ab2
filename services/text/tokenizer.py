"""Tokenizer: `tokenizers.Tokenizer` plus special ids and the jinja2 chat template.

Built from an HF directory (tokenizer.json + tokenizer_config.json), from GGUF metadata (byte-level
BPE, `tokenizer.ggml.model == "gpt2"`), or as the trivial byte-level tokenizer of random models.
Ids equal transformers' for the same source (tests/engine/test_tokenizer.py checks the GGUF).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# llama.cpp `token_type` values.
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (gpt-oss, llama.cpp "gpt-4o"): words split at case changes with their contraction, digits by three.
_O200K_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
           "deepseek-r1-qwen": _QWEN2_SPLIT, "gpt-4o": _O200K_SPLIT}
# llama.cpp splits each digit, then applies the GPT-2 regex, for these (SmolLM's tokenizer.json does the same).
_DIGIT_SPLIT = {"smollm", "starcoder", "refact", "codeshell", "minerva", "exaone"}
# The GPT-2 regex alone: these names, and a file that names no pre-tokenizer.
_GPT2_SPLIT = {"default", "gpt-2", "gpt2"}

_CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
           " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|im_start|>assistant\n' }}{% endif %}")


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode char table (the alphabet of byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    # Same environment as transformers' chat templating: sandboxed, trim/lstrip blocks, loop controls.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as "str" or {"content": "str", ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """encode/decode/chat template over a `tokenizers.Tokenizer`.

    `eos_token_ids` holds every id that ends generation; `add_bos` prepends `bos_token_id` on
    `encode(add_special_tokens=True)` when the backend's post-processor does not already do so.
    """

    def __init__(self, backend: HFTokenizer, *, bos_token_id: int | None, eos_token_ids: set[int],
                 chat_template: str | None = None, add_bos: bool = False,
                 special_tokens: dict[str, str | None] | None = None) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = set(eos_token_ids)
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.special_tokens = dict(special_tokens or {})

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, model_dir: str | os.PathLike[str]) -> Tokenizer:
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        backend = HFTokenizer.from_file(str(path))
        cfg_path = root / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = root / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        special = {k: _token_str(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        eos_ids = {i for i in [backend.token_to_id(special["eos_token"] or "")] if i is not None}
        gen = root / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            eos_ids |= set([] if eos is None else [eos] if isinstance(eos, int) else eos)
        bos_id = backend.token_to_id(special["bos_token"]) if special["bos_token"] else None
        return cls(backend, bos_token_id=bos_id, eos_token_ids=eos_ids, chat_template=template,
                   add_bos=False, special_tokens=special)  # tokenizer.json's post-processor adds BOS

    @classmethod
    def from_gguf_metadata(cls, md: dict[str, Any]) -> Tokenizer:
        """Byte-level BPE from llama.cpp metadata (tokens, merges, token_type, special ids, template)."""
        model = md.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model={model!r}: only byte-level BPE ('gpt2') is supported")
        alphabet = bytes_to_unicode()
        chars = set(alphabet.values())
        tokens: list[str] = list(md["tokenizer.ggml.tokens"])
        types: list[int] = list(md.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        vocab = {(t if set(t) <= chars else "".join(alphabet[b] for b in t.encode())): i
                 for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
        backend = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False))  # type: ignore[arg-type]
        pre = md.get("tokenizer.ggml.pre", "default")
        if pre in _SPLITS:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        elif pre in _DIGIT_SPLIT:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        elif pre in _GPT2_SPLIT:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:  # another split would tokenize text differently from the model's own tokenizer
            known = sorted({*_SPLITS, *_DIGIT_SPLIT, *_GPT2_SPLIT})
            raise ValueError(f"tokenizer.ggml.pre={pre!r}: this pre-tokenizer is not implemented "
                             f"(supported: {', '.join(known)})")
        backend.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|> ...) match whole and are special; a control token spelled
        # outside the byte alphabet is a llama.cpp mislabel and is left alone (as transformers does).
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, ty in zip(tokens, types, strict=False)
                                    if ty == _CONTROL and set(t) <= chars])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, ty in zip(tokens, types, strict=False) if ty == _USER_DEFINED])

        def tok(key: str) -> str | None:
            i = md.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        eos_ids = {int(md[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
                   if md.get(k) is not None}
        special = {"bos_token": tok("bos_token_id"), "eos_token": tok("eos_token_id"),
                   "unk_token": tok("unknown_token_id"), "pad_token": tok("padding_token_id")}
        return cls(backend, bos_token_id=md.get("tokenizer.ggml.bos_token_id"), eos_token_ids=eos_ids,
                   chat_template=md.get("tokenizer.chat_template"),
                   add_bos=bool(md.get("tokenizer.ggml.add_bos_token", False)), special_tokens=special)

    @classmethod
    def byte_level(cls, eos_id: int = 256) -> Tokenizer:
        """Random models' tokenizer: id b < 256 is byte b, `eos_id` is <|endoftext|>; ChatML template."""
        alphabet = bytes_to_unicode()
        backend = HFTokenizer(models.BPE({alphabet[b]: b for b in range(256)}, []))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
        assert backend.token_to_id("<|endoftext|>") == eos_id, "byte tokenizer: eos must follow the bytes"
        return cls(backend, bos_token_id=None, eos_token_ids={eos_id}, chat_template=_CHATML,
                   special_tokens={"eos_token": "<|endoftext|>"})

    # ---- use ----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (the model's vocab may be larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and (
                not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render the chat template to a prompt string (encode it with add_special_tokens=False)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        variables: dict[str, Any] = {**self.special_tokens, **kwargs}
        return _compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables)
