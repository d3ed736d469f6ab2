"""The P/D path end to end: router -> decode Reserve -> prefill chunked KV -> decode tokens."""

from __future__ import annotations

import asyncio

import grpc
import openai
import pytest

from services.common.grpc_util import create_channel
from services.common.pb import common_pb2, router_pb2, router_pb2_grpc
from services.text.sampling_params import SamplingParams
from tests.e2e.cluster_util import CHAT_PROMPTS, metric_sum, post_json, wait_idle

pytestmark = pytest.mark.e2e

MAX_TOKENS = 20
LONG = ("Tell me about the history of the lighthouse keepers on the northern coast, their daily routines, "
        "the storms they survived and the ships they guided home safely through the fog. ") * 3


def _chat_ids(engine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def _reference(engine, ids: list[int], n: int = MAX_TOKENS) -> list[int]:
    return engine.generate([ids], SamplingParams(max_tokens=n, temperature=0.0))[0]


async def _router_generate(addr: str, ids: list[int], n: int = MAX_TOKENS, **params) -> common_pb2.GenerateResponse:
    async with create_channel(addr) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids),
                                         params=common_pb2.SamplingParams(max_tokens=n, temperature=0.0, **params))
        out = common_pb2.GenerateResponse()
        async for msg in stub.Generate(req, timeout=120):
            out.token_ids.extend(msg.token_ids)
            out.text += msg.text
            out.finish_reason = msg.finish_reason
            if msg.HasField("usage"):
                out.usage.CopyFrom(msg.usage)
        return out


def test_grpc_tokens_equal_colocated_engine_on_both_prefills(pd_cluster, reference_engine):
    router = pd_cluster.router["grpc"]
    prompts = [*CHAT_PROMPTS, LONG]
    for text in prompts:
        ids = _chat_ids(reference_engine, text)
        want = _reference(reference_engine, ids)
        # Round-robin: two sends land on both prefills (chunked transfer off and on) and both decodes.
        for _ in range(2):
            got = asyncio.run(_router_generate(router, ids))
            assert list(got.token_ids) == want, f"prompt {text[:30]!r}"
            assert got.usage.prompt_tokens == len(ids)
    p0, p1 = (pd_cluster.get(f"prefill-{i}").ready["metrics"] for i in range(2))
    sent0 = metric_sum(p0, "pdserve_prefill_kv_chunks_sent_total")
    sent1 = metric_sum(p1, "pdserve_prefill_kv_chunks_sent_total")
    reqs0 = metric_sum(p0, "pdserve_prefill_compute_seconds_count")
    reqs1 = metric_sum(p1, "pdserve_prefill_compute_seconds_count")
    assert reqs0 >= len(prompts) and reqs1 >= len(prompts)
    # Chunked transfer off: one message per request; on: one per computed chunk (the long prompt
    # takes several 37-token chunks), so strictly more messages than requests.
    assert sent0 == reqs0
    assert sent1 > reqs1


def test_http_chat_text_equals_engine_text(pd_cluster, reference_engine):
    http = pd_cluster.router["http"]
    eos = set(reference_engine.tokenizer.eos_token_ids)
    for text in CHAT_PROMPTS[:2]:
        ref = _reference(reference_engine, _chat_ids(reference_engine, text))
        want = reference_engine.tokenizer.decode([t for t in ref if t not in eos])
        status, body = post_json(http, "/v1/chat/completions", {
            "model": "SmolLM2-135M-Instruct.Q4_1", "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": text}]})
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == want


def test_prefix_sharing_skips_blocks_decode_holds(pd_cluster, reference_engine):
    router = pd_cluster.router["grpc"]
    before = sum(metric_sum(pd_cluster.get(f"prefill-{i}").ready["metrics"],
                            "pdserve_prefill_kv_skipped_tokens_total") for i in range(2))
    base = _chat_ids(reference_engine, LONG + " Now answer briefly.")
    # Four sends of prompts sharing a long prefix: round-robin puts at least two on the same decode,
    # whose prefix cache then holds the shared blocks.
    for k in range(4):
        ids = base[:-6] + _chat_ids(reference_engine, f"variant {k}")[-6:]
        got = asyncio.run(_router_generate(router, ids))
        assert list(got.token_ids) == _reference(reference_engine, ids)
    after = sum(metric_sum(pd_cluster.get(f"prefill-{i}").ready["metrics"],
                           "pdserve_prefill_kv_skipped_tokens_total") for i in range(2))
    assert after - before >= 16 * 4  # at least a few shared blocks were not sent


def test_openai_client_stream_and_not(pd_cluster):
    client = openai.OpenAI(base_url=f"http://{pd_cluster.router['http']}/v1", api_key="unused")
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
    assert "Paris" in full.choices[0].message.content
    assert full.usage.completion_tokens > 0
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=msgs, max_tokens=24, temperature=0, stream=True) if c.choices]
    assert "".join(parts) == full.choices[0].message.content
    comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert comp.choices[0].text and comp.choices[0].finish_reason in ("length", "stop")


def test_client_disconnect_frees_blocks_everywhere(pd_cluster):
    import http.client
    import json

    host, port = pd_cluster.router["http"].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"model": "SmolLM2-135M-Instruct.Q4_1", "max_tokens": 2000, "temperature": 0.8,
                       "ignore_eos": True, "stream": True, "messages": [{"role": "user", "content": LONG}]})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    got = b""
    while got.count(b"data:") < 4:
        got += resp.read1(4096)
    busy = [pd_cluster.get(f"decode-{i}").ready["grpc"] for i in range(2)]
    conn.close()  # the client goes away mid-stream
    for name in ("decode-0", "decode-1", "prefill-0", "prefill-1"):
        rep = wait_idle(pd_cluster.get(name).ready["grpc"])
        assert rep.running == rep.waiting == rep.waiting_for_kv == 0, name
        assert rep.free_blocks == rep.total_blocks, name
    assert busy


def test_router_grpc_bad_input(pd_cluster, reference_engine):
    router = pd_cluster.router["grpc"]

    async def call(req: router_pb2.GenerateRequest) -> tuple[grpc.StatusCode, str]:
        async with create_channel(router) as ch:
            try:
                async for _ in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=30):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()
        return grpc.StatusCode.OK, ""

    ids = _chat_ids(reference_engine, "hi")
    cases = [
        (router_pb2.GenerateRequest(), "prompt"),
        (router_pb2.GenerateRequest(text=""), "prompt"),
        (router_pb2.GenerateRequest(model="gpt-9", text="hi"), "gpt-9"),
        (router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[10**7])), "vocabulary"),
        (router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1] * 9000)), "context"),
        (router_pb2.GenerateRequest(text="hi", params=common_pb2.SamplingParams(max_tokens=-3)), "max_tokens"),
        (router_pb2.GenerateRequest(text="hi", params=common_pb2.SamplingParams(temperature=-1)), "temperature"),
        (router_pb2.GenerateRequest(text="hi", params=common_pb2.SamplingParams(top_p=1.5)), "top_p"),
    ]
    for req, word in cases:
        code, details = asyncio.run(call(req))
        expected = grpc.StatusCode.NOT_FOUND if word == "gpt-9" else grpc.StatusCode.INVALID_ARGUMENT
        assert code == expected and word in details, (req, code, details)
    got = asyncio.run(_router_generate(router, ids))  # still serving
    assert len(got.token_ids) > 0


def test_router_http_bad_input(pd_cluster):
    http = pd_cluster.router["http"]
    model = "SmolLM2-135M-Instruct.Q4_1"
    cases = [
        (b"{not json", 400, None),
        ({"model": model, "messages": "hi"}, 400, "messages"),
        ({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400, "max_tokens"),
        ({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
        ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
        ({"model": model, "prompt": "word " * 9000, "max_tokens": 4}, 400, "prompt"),
    ]
    for body, status, param in cases:
        got, err = post_json(http, "/v1/chat/completions" if "prompt" not in str(body) else "/v1/completions", body)
        assert got == status, (body, got, err)
        assert err["error"]["message"]
        if param:
            assert err["error"]["param"] == param, err
    ok, body = post_json(http, "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 4})
    assert ok == 200 and body["usage"]["completion_tokens"] == 4
