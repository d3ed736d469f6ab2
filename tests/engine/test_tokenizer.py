"""Tokenizer vs transformers (built from the same GGUF), chat template, streaming detokenization."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from services.engine.weights.gguf_loader import GGUFFile
from services.text.detokenizer import IncrementalDetokenizer, StopChecker
from services.text.tokenizer import Tokenizer, bytes_to_unicode

TEXTS = [
    "Hello world!",
    "The capital of France is Paris.",
    "Ünïcödé — naïve café, Straße, Ελληνικά, русский, العربية",
    "東京は日本の首都です。中文测试\uff0c한국어",
    "emoji 🤖👍🏽🇫🇷👨‍👩‍👧 ok 🎉",
    "def f(x):\n    return x ** 2  # square\n\n\n\tclass A: pass\r\n",
    "   leading, inner      runs, and trailing   \n\n   ",
    "12345 3.14159 1,000,000 0x1F 2024-01-01",
    "I'm sure they'll say we've done what's right, isn't it? WE'LL",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "a<|im_start|>b <|im_end|>c",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? 🤔"}],
]


@pytest.fixture(scope="module")
def tok(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile(gguf_path).metadata)


@pytest.mark.parametrize("add_special", [True, False])
def test_ids_identical_to_transformers(tok: Tokenizer, hf_gguf_tokenizer: Any, add_special: bool) -> None:
    for text in TEXTS:
        ours = tok.encode(text, add_special_tokens=add_special)
        ref = hf_gguf_tokenizer.encode(text, add_special_tokens=add_special)
        assert ours == ref, text
        assert tok.decode(ours) == hf_gguf_tokenizer.decode(ref)
        assert tok.decode(ours, skip_special_tokens=True) == hf_gguf_tokenizer.decode(
            ref, skip_special_tokens=True)


def test_special_tokens_and_sizes(tok: Tokenizer, hf_gguf_tokenizer: Any) -> None:
    assert tok.encode("<|im_start|>") == [1]
    assert tok.eos_token_ids == {hf_gguf_tokenizer.eos_token_id} == {2}
    assert tok.bos_token_id == 1 and not tok.add_bos
    assert tok.vocab_size == len(hf_gguf_tokenizer) == 49152


@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_identical(tok: Tokenizer, hf_gguf_tokenizer: Any, gen_prompt: bool) -> None:
    for chat in CHATS:
        ours = tok.apply_chat_template(chat, add_generation_prompt=gen_prompt)
        ref = hf_gguf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen_prompt)
        assert ours == ref
        assert tok.encode(ours, add_special_tokens=False) == hf_gguf_tokenizer.apply_chat_template(
            chat, tokenize=True, add_generation_prompt=gen_prompt, return_dict=False)


def test_chat_template_helpers() -> None:
    t = Tokenizer.byte_level()
    t.chat_template = ("{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('no bad') }}"
                       "{% endif %}{% if loop.index > 1 %}{% break %}{% endif %}\n  {% if true %}{{ m['content'] }}"
                       "{% endif %}{% endfor %}")  # trim_blocks eats the newline, lstrip_blocks the indent
    assert t.apply_chat_template([{"role": "u", "content": "a"}, {"role": "u", "content": "b"}]) == "a"
    with pytest.raises(Exception, match="no bad"):
        t.apply_chat_template([{"role": "bad", "content": "x"}])


def test_hf_dir_tokenizer_roundtrip(tok: Tokenizer, tmp_path: Path, hf_gguf_tokenizer: Any) -> None:
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tok.chat_template, "eos_token": {"content": "<|im_end|>"}, "bos_token": "<|im_start|>"}))
    t2 = Tokenizer.from_hf_dir(tmp_path)
    assert t2.eos_token_ids == {2} and t2.bos_token_id == 1
    for text in TEXTS:
        assert t2.encode(text) == tok.encode(text)
    assert t2.apply_chat_template(CHATS[1]) == tok.apply_chat_template(CHATS[1])
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nope" / "tokenizer.json"))):
        Tokenizer.from_hf_dir(tmp_path / "nope")


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    return [detok.add(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS[2:6])
def test_incremental_detok_is_utf8_safe(tok: Tokenizer, text: str) -> None:
    prompt = tok.encode("Say something:")
    ids = tok.encode(text, add_special_tokens=False)
    deltas = _stream(tok, prompt, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


def test_incremental_detok_holds_partial_bytes() -> None:
    t = Tokenizer.byte_level()
    ids = t.encode("a🤖b東")  # one token per byte: 🤖 is 4 tokens, 東 is 3
    deltas = _stream(t, [], ids)
    assert deltas[:6] == ["a", "", "", "", "🤖", "b"]
    assert deltas[6:] == ["", "", "東", ""]
    assert _stream(t, [], ids[:3]) == ["a", "", "", "\ufffd"]  # flush releases an unfinished char


def test_incremental_detok_skips_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("Paris.<|im_end|>", add_special_tokens=False)
    assert "".join(_stream(tok, [1], ids)) == "Paris."


def test_stop_string_across_token_boundaries(tok: Tokenizer) -> None:
    text = "The answer is 42.\nUser: and then?"
    ids = tok.encode(text, add_special_tokens=False)
    detok, stop = IncrementalDetokenizer(tok, []), StopChecker(["\nUser:", "never"])
    out = ""
    for i in ids:
        out += stop.feed(detok.add(i))
        if stop.stopped:
            break
    assert out == "The answer is 42."
    assert stop.matched == "\nUser:"


def test_stop_checker_hold_back_and_earliest() -> None:
    s = StopChecker(["world", "rld!"])
    assert s.feed("Hello wo") == "Hello "  # "wo" may begin "world"
    assert s.feed("rl") == ""
    assert s.feed("d! more") == "" and s.stopped and s.matched == "world"
    assert s.feed("x") == ""
    s = StopChecker(["abc", "c"])
    assert s.feed("xab") == "x" and s.feed("c") == "" and s.matched == "abc"
    s = StopChecker(["STOP"])
    assert s.feed("a S") == "a " and s.feed("T") == "" and s.feed("x") == "STx"
    assert s.feed("ST") == "" and s.flush() == "ST" and not s.stopped
    assert StopChecker([]).feed("anything") == "anything"


def test_byte_level_tokenizer_roundtrip() -> None:
    t = Tokenizer.byte_level()
    text = "héllo 🤖 <|endoftext|>"
    ids = t.encode(text)
    assert ids[-1] == 256 and all(i < 256 for i in ids[:-1])
    assert t.decode(ids) == text
    assert t.eos_token_ids == {256} and t.vocab_size == 257
    assert "<|im_start|>user\nhi<|im_end|>" in t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_the_gpt_4o_pre_tokenizer_splits_as_o200k_does(gguf_path: Path) -> None:
    """llama.cpp's "gpt-4o" (gpt-oss): words split at a case change keep their contraction, digits go by
    three, where the GPT-2 regex keeps "HelloWorld" whole and splits "'t" off."""
    md = dict(GGUFFile(gguf_path).metadata) | {"tokenizer.ggml.pre": "gpt-4o"}
    pre = Tokenizer.from_gguf_metadata(md).backend.pre_tokenizer
    words = [w for w, _ in pre.pre_tokenize_str("HelloWorld don't 12345 x\n\ny")]
    alphabet = bytes_to_unicode()
    assert words == ["".join(alphabet[b] for b in w.encode())
                     for w in ["Hello", "World", " don't", " ", "123", "45", " x", "\n\n", "y"]]


def test_a_pre_tokenizer_not_implemented_is_refused(gguf_path: Path) -> None:
    md = dict(GGUFFile(gguf_path).metadata) | {"tokenizer.ggml.pre": "tekken"}
    with pytest.raises(ValueError, match=r"^tokenizer.ggml.pre='tekken': this pre-tokenizer is not implemented"):
        Tokenizer.from_gguf_metadata(md)
