"""Workloads: conversations of one or more turns, generated from a seed or read from a JSONL trace.

A request is one turn of a :class:`Conversation`. Turns of a conversation run one after the other;
turn ``k`` is sent with the whole history so far (the system prompt, every earlier user turn and
the reply the server actually gave), so the shared context grows turn by turn. A single-turn
workload is conversations of one turn.

JSONL trace format (``--trace FILE``; ``--save-trace FILE`` writes one), one conversation per line::

    {"id": "c0", "system": "optional system prompt", "arrival_s": 0.0,
     "turns": [{"user": "first question", "max_tokens": 32},
               {"user": "follow-up", "max_tokens": 32, "answer": "42", "grade": "number"}]}

- ``id`` (string, unique) and ``turns`` (at least one) are required; each turn needs ``user``
  (string) and ``max_tokens`` (integer >= 1).
- ``system`` (default empty) opens the conversation; ``arrival_s`` (seconds after the run starts,
  default none) is when a ``--rate trace`` replay starts it.
- ``answer`` and ``grade`` (``number``: the first integer of the reply must equal the answer;
  ``text``: the normalized reply must start with the normalized answer) make a turn gradable
  (accuracy mode, benchmarks/serve/accuracy.py).
Unknown keys are an error, so a typo never silently changes a run.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

GRADES = ("number", "text")


@dataclass(frozen=True)
class Turn:
    user: str
    max_tokens: int
    answer: str | None = None
    grade: str = "text"


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]
    system: str = ""
    arrival_s: float | None = None

    def messages(self, turn: int, replies: list[str]) -> list[dict[str, str]]:
        """Chat messages of turn ``turn``: system, then each earlier (user, reply) pair, then the turn."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for t, reply in zip(self.turns[:turn], replies, strict=True):
            out += [{"role": "user", "content": t.user}, {"role": "assistant", "content": reply}]
        return [*out, {"role": "user", "content": self.turns[turn].user}]

    def prompt(self, turn: int, replies: list[str]) -> str:
        """The plain-text prompt of turn ``turn`` (completions API): the same history as a transcript."""
        head = f"{self.system}\n\n" if self.system else ""
        past = "".join(f"User: {t.user}\nAssistant: {r}\n" for t, r in zip(self.turns[:turn], replies, strict=True))
        return f"{head}{past}User: {self.turns[turn].user}\nAssistant:"


class TextMaker(Protocol):
    """Makes text of about ``n`` tokens of the served model (benchmarks/serve/tokens.py)."""

    def text(self, n: int, rng: random.Random) -> str: ...


def _length(rng: random.Random, mean: int, spread: float) -> int:
    """Uniform in [mean * (1 - spread), mean * (1 + spread)], at least 1."""
    if spread <= 0:
        return max(1, mean)
    return max(1, round(rng.uniform(mean * (1 - spread), mean * (1 + spread))))


@dataclass(frozen=True)
class RandomSpec:
    """Single-turn requests with random input/output lengths (tokens; spread is relative)."""

    input_tokens: int
    output_tokens: int
    input_spread: float = 0.0
    output_spread: float = 0.0


@dataclass(frozen=True)
class MultiTurnSpec:
    """Conversations of ``turns`` user turns; every conversation opens with the same system prompt of
    ``shared_prefix_tokens`` tokens (shared across conversations); each turn adds ``input_tokens``."""

    turns: int
    input_tokens: int
    output_tokens: int
    input_spread: float = 0.0
    output_spread: float = 0.0
    shared_prefix_tokens: int = 0


@dataclass
class Workload:
    """Conversation ``i`` of a run, deterministic in (seed, i); ``count`` None: unbounded (duration runs)."""

    name: str
    make: Callable[[int], Conversation]
    count: int | None
    turns_each: int = 1
    notes: dict[str, Any] = field(default_factory=dict)

    def conversations(self, limit: int | None = None) -> Iterator[Conversation]:
        i = 0
        while (self.count is None or i < self.count) and (limit is None or i < limit):
            yield self.make(i)
            i += 1


def random_workload(spec: RandomSpec, texts: TextMaker, *, requests: int | None, seed: int,
                    tag: str = "Request") -> Workload:
    """Each prompt starts with ``tag`` and its index, so no two share a cached prefix."""
    def make(i: int) -> Conversation:
        rng = random.Random(f"{seed}:{tag}:{i}")
        n_in = _length(rng, spec.input_tokens, spec.input_spread)
        n_out = _length(rng, spec.output_tokens, spec.output_spread)
        return Conversation(f"{tag.lower().replace(' ', '-')}-{i}", (Turn(f"{tag} {i}: {texts.text(n_in, rng)}", n_out),))
    return Workload("random", make, requests, 1, {"spec": spec.__dict__})


def multi_turn_workload(spec: MultiTurnSpec, texts: TextMaker, *, conversations: int | None,
                        seed: int, tag: str = "Conversation") -> Workload:
    """Conversation ``i`` opens its turns with ``tag`` and ``i``: no two share more than the system prompt."""
    system = texts.text(spec.shared_prefix_tokens, random.Random(f"{seed}:system")) if spec.shared_prefix_tokens else ""

    def make(i: int) -> Conversation:
        rng = random.Random(f"{seed}:{tag}:{i}")
        turns = tuple(Turn(f"{tag} {i}, part {k}: {texts.text(_length(rng, spec.input_tokens, spec.input_spread), rng)}",
                           _length(rng, spec.output_tokens, spec.output_spread)) for k in range(spec.turns))
        return Conversation(f"{tag.lower().replace(' ', '-')}-{i}", turns, system)
    return Workload("multi_turn", make, conversations, spec.turns, {"spec": spec.__dict__})


def trace_workload(convs: list[Conversation], name: str = "trace") -> Workload:
    return Workload(name, lambda i: convs[i], len(convs), max((len(c.turns) for c in convs), default=1))


# -- JSONL ---------------------------------------------------------------------------------------------
def conversation_to_json(c: Conversation) -> dict[str, Any]:
    out: dict[str, Any] = {"id": c.id}
    if c.system:
        out["system"] = c.system
    if c.arrival_s is not None:
        out["arrival_s"] = c.arrival_s
    turns = []
    for t in c.turns:
        d: dict[str, Any] = {"user": t.user, "max_tokens": t.max_tokens}
        if t.answer is not None:
            d.update(answer=t.answer, grade=t.grade)
        turns.append(d)
    out["turns"] = turns
    return out


class TraceError(ValueError):
    """A trace line is malformed; the message names the file and line."""


def _check_keys(obj: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = set(obj) - allowed
    if extra:
        raise TraceError(f"{where}: unknown key(s) {sorted(extra)}; allowed: {sorted(allowed)}")


def conversation_from_json(obj: Any, where: str) -> Conversation:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    _check_keys(obj, {"id", "system", "arrival_s", "turns"}, where)
    cid, system, arrival, turns = obj.get("id"), obj.get("system", ""), obj.get("arrival_s"), obj.get("turns")
    if not isinstance(cid, str) or not cid:
        raise TraceError(f"{where}: 'id' must be a non-empty string")
    if not isinstance(system, str):
        raise TraceError(f"{where}: 'system' must be a string")
    if arrival is not None and (not isinstance(arrival, (int, float)) or isinstance(arrival, bool) or arrival < 0):
        raise TraceError(f"{where}: 'arrival_s' must be a number >= 0")
    if not isinstance(turns, list) or not turns:
        raise TraceError(f"{where}: 'turns' must be a non-empty list")
    out = []
    for k, t in enumerate(turns):
        w = f"{where}, turn {k}"
        if not isinstance(t, dict):
            raise TraceError(f"{w}: expected an object")
        _check_keys(t, {"user", "max_tokens", "answer", "grade"}, w)
        user, mt, ans, grade = t.get("user"), t.get("max_tokens"), t.get("answer"), t.get("grade", "text")
        if not isinstance(user, str):
            raise TraceError(f"{w}: 'user' must be a string")
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise TraceError(f"{w}: 'max_tokens' must be an integer >= 1")
        if ans is not None and not isinstance(ans, (str, int)):
            raise TraceError(f"{w}: 'answer' must be a string or integer")
        if grade not in GRADES:
            raise TraceError(f"{w}: 'grade' must be one of {GRADES}")
        out.append(Turn(user, mt, None if ans is None else str(ans), grade))
    return Conversation(cid, tuple(out), system, None if arrival is None else float(arrival))


def write_trace(path: str | Path, convs: list[Conversation]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps(conversation_to_json(c), ensure_ascii=False) + "\n")


def jsonl_objects(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(``path:line``, parsed object) for every non-blank line of a JSONL file; TraceError names a line
    that is not JSON."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not JSON ({e.msg})") from None


def read_trace(path: str | Path) -> list[Conversation]:
    """Every conversation of a JSONL trace (blank lines skipped); TraceError names a bad line."""
    out: list[Conversation] = []
    seen: set[str] = set()
    for where, obj in jsonl_objects(path):
        c = conversation_from_json(obj, where)
        if c.id in seen:
            raise TraceError(f"{where}: duplicate id {c.id!r}")
        seen.add(c.id)
        out.append(c)
    if not out:
        raise TraceError(f"{path}: no conversations")
    return out
