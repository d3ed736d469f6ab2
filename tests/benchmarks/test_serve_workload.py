"""Workloads: seeded generation, history growth, and the JSONL trace format round trip."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks.serve.tokens import WordText, load_tokenizer
from benchmarks.serve.workload import (
    Conversation,
    MultiTurnSpec,
    RandomSpec,
    TraceError,
    Turn,
    multi_turn_workload,
    random_workload,
    read_trace,
    write_trace,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


def test_jsonl_trace_round_trips(tmp_path):
    convs = [
        Conversation("c0", (Turn("first question", 16), Turn("follow-up ünïcode \"quoted\"\n", 8))),
        Conversation("c1", (Turn("What is 2 + 2?", 4, "4", "number"),), system="Be brief.", arrival_s=1.25),
    ]
    path = tmp_path / "trace.jsonl"
    write_trace(path, convs)
    assert read_trace(path) == convs
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["arrival_s"] == 1.25


def test_generated_workload_round_trips_and_is_seeded(tmp_path, tokenizer):
    texts = WordText(tokenizer)
    spec = MultiTurnSpec(turns=3, input_tokens=20, output_tokens=5, input_spread=0.5, shared_prefix_tokens=12)
    a = list(multi_turn_workload(spec, texts, conversations=4, seed=3).conversations())
    b = list(multi_turn_workload(spec, texts, conversations=4, seed=3).conversations())
    c = list(multi_turn_workload(spec, texts, conversations=4, seed=4).conversations())
    assert a == b and a != c
    path = tmp_path / "mt.jsonl"
    write_trace(path, a)
    assert read_trace(path) == a
    assert len({conv.system for conv in a}) == 1 and a[0].system  # one system prompt shared by all


@pytest.mark.parametrize("bad, why", [
    ('{"turns": [{"user": "x", "max_tokens": 1}]}', "'id'"),
    ('{"id": "a", "turns": []}', "non-empty list"),
    ('{"id": "a", "turns": [{"user": "x", "max_tokens": 0}]}', "max_tokens"),
    ('{"id": "a", "turns": [{"user": "x", "max_tokens": 1, "maxtokens": 3}]}', "unknown key"),
    ('{"id": "a", "turns": [{"user": "x", "max_tokens": 1, "grade": "fuzzy"}]}', "grade"),
    ('{"id": "a", "arrival_s": -1, "turns": [{"user": "x", "max_tokens": 1}]}', "arrival_s"),
    ('not json', "not JSON"),
])
def test_malformed_trace_lines_name_the_line(tmp_path, bad, why):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "ok", "turns": [{"user": "x", "max_tokens": 1}]}\n' + bad + "\n")
    with pytest.raises(TraceError, match=why) as e:
        read_trace(path)
    assert ":2" in str(e.value)


def test_duplicate_ids_are_refused(tmp_path):
    line = '{"id": "a", "turns": [{"user": "x", "max_tokens": 1}]}\n'
    path = tmp_path / "dup.jsonl"
    path.write_text(line * 2)
    with pytest.raises(TraceError, match="duplicate"):
        read_trace(path)


def test_prompt_lengths_follow_the_tokenizer(tokenizer):
    texts = WordText(tokenizer)
    rng = random.Random(0)
    for n in (1, 7, 64, 300):
        got = len(tokenizer.encode(texts.text(n, rng), add_special_tokens=False))
        assert abs(got - n) <= 1, (n, got)
    spec = RandomSpec(input_tokens=100, output_tokens=10, input_spread=0.5, output_spread=0.5)
    convs = list(random_workload(spec, texts, requests=40, seed=1).conversations())
    outs = [c.turns[0].max_tokens for c in convs]
    assert min(outs) >= 5 and max(outs) <= 15 and len(set(outs)) > 3
    assert len({c.turns[0].user.split(":")[0] for c in convs}) == 40  # unique heads: no shared prefix


def test_history_grows_with_the_replies():
    conv = Conversation("c", (Turn("one", 4), Turn("two", 4), Turn("three", 4)), system="sys")
    msgs = conv.messages(2, ["r1", "r2"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in msgs] == ["sys", "one", "r1", "two", "r2", "three"]
    assert conv.prompt(1, ["r1"]) == "sys\n\nUser: one\nAssistant: r1\nUser: two\nAssistant:"
