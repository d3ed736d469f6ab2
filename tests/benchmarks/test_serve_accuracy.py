"""Accuracy mode: the seeded question set, grading, JSONL questions and token agreement."""

from __future__ import annotations

import pytest

from benchmarks.serve.accuracy import builtin_set, grade, is_correct, read_questions, token_agreement
from benchmarks.serve.client import RequestResult
from benchmarks.serve.workload import TraceError


def test_builtin_set_is_seeded_and_answers_are_right():
    a, b = builtin_set(20, seed=1), builtin_set(20, seed=1)
    assert a == b and a != builtin_set(20, seed=2)
    for conv in a:
        t = conv.turns[0]
        if t.grade == "number" and ("+" in t.user or " - " in t.user):
            expr = t.user.removeprefix("What is ").split("?")[0]
            x, op, y = expr.split()
            assert int(t.answer) == (int(x) + int(y) if op == "+" else int(x) - int(y))


@pytest.mark.parametrize("reply, answer, grade_, ok", [
    ("42", "42", "number", True),
    ("The answer is 42.", "42", "number", True),
    ("-7", "-7", "number", True),
    ("4 2", "42", "number", False),
    ("1,234", "1234", "number", True),
    ("Paris.", "Paris", "text", True),
    ("The capital of France is Paris. Lyon is big.", "Paris", "text", True),
    ("Lyon. Paris is the capital.", "Paris", "text", False),
    ("Parisian food", "Paris", "text", False),
])
def test_grading_rules(reply, answer, grade_, ok):
    assert is_correct(reply, answer, grade_) is ok


def test_grade_counts_failures_as_wrong():
    convs = builtin_set(3, seed=0)
    results = [RequestResult("q-0", 0, 0.0, ok=True, text=convs[0].turns[0].answer),
               RequestResult("q-1", 0, 0.0, ok=True, text="no idea"),
               RequestResult("q-2", 0, 0.0, ok=False, error="http_503")]
    g = grade(convs, results)
    assert g["questions"] == 3 and g["correct"] == 1 and g["accuracy"] == pytest.approx(1 / 3)
    assert any(w["reply"] == "[http_503]" for w in g["wrong_examples"])


def test_jsonl_questions(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text('{"question": "2+2?", "answer": 4, "grade": "number"}\n'
                 '{"id": "t", "turns": [{"user": "Capital of Peru?", "max_tokens": 8, "answer": "Lima"}]}\n')
    qs = read_questions(p)
    assert [q.turns[0].answer for q in qs] == ["4", "Lima"] and qs[1].id == "t"
    p.write_text('{"question": "no answer"}\n')
    with pytest.raises(TraceError, match="answer"):
        read_questions(p)


def test_token_agreement():
    def r(cid, toks, ok=True):
        return RequestResult(cid, 0, 0.0, ok=ok, text="".join(toks), tokens=toks)
    a = [r("1", ["a", "b", "c"]), r("2", ["x", "y"]), r("3", ["p"]), r("4", ["q"], ok=False)]
    b = [r("1", ["a", "b", "c"]), r("2", ["x", "z", "w"]), r("3", ["p"]), r("4", ["q"])]
    t = token_agreement(a, b)
    assert t["compared"] == 3 and t["identical"] == 2
    assert t["matching_prefix_fraction"] == pytest.approx((3 + 1 + 1) / (3 + 3 + 1))
    assert t["unit"].startswith("tokens") and t["differences"][0]["first_difference_at"] == 1
