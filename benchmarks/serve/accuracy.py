"""Accuracy mode: questions with known answers, decoded greedily, graded by exact match of the
extracted answer; and how often two deployments' output tokens are identical.

The built-in set is generated from ``--seed`` (no download): arithmetic (``What is 17 + 25?``) and
short facts (capitals, counts). ``--trace FILE`` takes JSONL questions instead, one per line, either
the trace format (benchmarks/serve/workload.py, turns with ``answer``/``grade``) or the short form
``{"question": "...", "answer": "...", "grade": "number"|"text", "max_tokens": 16}``.

Grading (``grade``):
- ``number``: the first integer in the reply equals the answer;
- ``text``: the normalized answer (lower case, punctuation dropped, spaces collapsed) occurs as whole
  words in the normalized first sentence of the reply.
Token agreement compares, per question, the output token strings (logprobs) of two runs: the share
of questions whose tokens are identical, and the share of token positions before the first
difference (over the longer output).
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from benchmarks.serve.client import RequestResult
from benchmarks.serve.workload import Conversation, TraceError, Turn, conversation_from_json, jsonl_objects

CAPITALS = (("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"),
            ("Germany", "Berlin"), ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Russia", "Moscow"),
            ("China", "Beijing"), ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Ireland", "Dublin"),
            ("Norway", "Oslo"), ("Austria", "Vienna"), ("Poland", "Warsaw"), ("Kenya", "Nairobi"))
FACTS = (("How many days are in a week?", "7"), ("How many legs does a spider have?", "8"),
         ("How many months are in a year?", "12"), ("How many sides does a triangle have?", "3"),
         ("How many minutes are in an hour?", "60"), ("How many hours are in a day?", "24"))
MAX_TOKENS = 24


def builtin_set(n: int, seed: int) -> list[Conversation]:
    """``n`` questions: half arithmetic, a quarter capitals, a quarter counts (seeded)."""
    rng = random.Random(f"{seed}:accuracy")
    out = []
    for i in range(n):
        kind = i % 4
        if kind in (0, 1):
            a, b = rng.randint(2, 60), rng.randint(2, 40)
            op = rng.choice("+-")
            q = f"What is {a} {op} {b}? Answer with the number only."
            turn = Turn(q, MAX_TOKENS, str(a + b if op == "+" else a - b), "number")
        elif kind == 2:
            country, city = rng.choice(CAPITALS)
            turn = Turn(f"What is the capital of {country}? Answer with one word.", MAX_TOKENS, city, "text")
        else:
            q, ans = rng.choice(FACTS)
            turn = Turn(f"{q} Answer with the number only.", MAX_TOKENS, ans, "number")
        out.append(Conversation(f"q-{i}", (turn,)))
    return out


def read_questions(path: str | Path) -> list[Conversation]:
    """Questions from JSONL (short form or the trace format); TraceError names a bad line."""
    out = []
    for where, obj in jsonl_objects(path):
        if isinstance(obj, dict) and "question" in obj:
            extra = set(obj) - {"question", "answer", "grade", "max_tokens", "id"}
            if extra:
                raise TraceError(f"{where}: unknown key(s) {sorted(extra)}")
            line = where.rsplit(":", 1)[1]
            obj = {"id": str(obj.get("id", f"q-{line}")), "turns": [{
                "user": obj["question"], "answer": obj.get("answer"), "grade": obj.get("grade", "text"),
                "max_tokens": obj.get("max_tokens", MAX_TOKENS)}]}
        conv = conversation_from_json(obj, where)
        if any(t.answer is None for t in conv.turns):
            raise TraceError(f"{where}: every question needs an 'answer'")
        out.append(conv)
    if not out:
        raise TraceError(f"{path}: no questions")
    return out


def normalize(s: str) -> str:
    return " ".join(re.sub(r"[^\w\s-]", " ", s.lower()).split())


def is_correct(reply: str, answer: str, grade: str) -> bool:
    if grade == "number":
        m = re.search(r"-?\d+", reply.replace(",", ""))
        return m is not None and int(m.group()) == int(answer)
    first = re.split(r"(?<=[.!?])\s|\n", reply.strip(), maxsplit=1)[0]
    return f" {normalize(answer)} " in f" {normalize(first)} "


def grade(convs: list[Conversation], results: list[RequestResult]) -> dict[str, Any]:
    """Exact-match accuracy of completed requests; failed ones count as wrong (and are listed)."""
    answers = {(c.id, k): t for c in convs for k, t in enumerate(c.turns) if t.answer is not None}
    by_grade: dict[str, list[int]] = {}
    wrong = []
    for r in results:
        t = answers.get((r.conversation, r.turn))
        if t is None:
            continue
        ok = r.ok and is_correct(r.text, t.answer or "", t.grade)
        by_grade.setdefault(t.grade, [0, 0])
        by_grade[t.grade][0] += ok
        by_grade[t.grade][1] += 1
        if not ok and len(wrong) < 8:
            wrong.append({"question": t.user, "answer": t.answer, "reply": r.text[:120] if r.ok else f"[{r.error}]"})
    right = sum(v[0] for v in by_grade.values())
    total = sum(v[1] for v in by_grade.values())
    return {"questions": total, "correct": right, "accuracy": right / total if total else None,
            "by_grade": {g: {"correct": c, "questions": n} for g, (c, n) in sorted(by_grade.items())},
            "wrong_examples": wrong}


def _tokens(r: RequestResult) -> list[str]:
    return r.tokens if r.tokens else list(r.text)


def token_agreement(a: list[RequestResult], b: list[RequestResult]) -> dict[str, Any]:
    """Per question completed in both runs: identical outputs and the matching-prefix share."""
    bmap = {(r.conversation, r.turn): r for r in b if r.ok}
    same = compared = matched = longest = 0
    diverged = []
    by_tokens = True
    for r in a:
        other = bmap.get((r.conversation, r.turn))
        if not r.ok or other is None:
            continue
        by_tokens = by_tokens and bool(r.tokens) and bool(other.tokens)
        x, y = _tokens(r), _tokens(other)
        n = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
        compared += 1
        same += x == y
        matched += n
        longest += max(len(x), len(y))
        if x != y and len(diverged) < 8:
            diverged.append({"id": r.conversation, "first_difference_at": n, "a": r.text[:80], "b": other.text[:80]})
    return {"compared": compared, "identical": same, "identical_fraction": same / compared if compared else None,
            "matching_prefix_fraction": matched / longest if longest else None,
            "unit": "tokens (logprobs)" if by_tokens else "characters (no logprobs)", "differences": diverged}
