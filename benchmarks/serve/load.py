"""Load generation: conversations at a fixed concurrency or at Poisson arrivals, after a warmup.

- Fixed concurrency ``C``: ``C`` workers each run one conversation at a time (its turns one after
  another), so at most ``C`` requests are in flight.
- Poisson rate ``r``: conversations start at exponential gaps of mean ``1/r`` seconds (seeded), or at
  their trace ``arrival_s`` when the rate is ``trace``; ``concurrency`` > 0 caps the conversations in
  flight (a start waits for a slot), 0 leaves them uncapped.
- Stopping: after ``requests`` requests (whole conversations), or once ``duration_s`` has passed
  (nothing new starts then; requests in flight finish and are counted).

Warmup requests run first (single short turns, not in the results, and before the measured window
opens). A turn whose conversation already failed is not sent (its history would be wrong); it is
counted in ``not_sent``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import aiohttp

from benchmarks.serve.client import RequestResult, Target, send
from benchmarks.serve.tokens import TokenCounter
from benchmarks.serve.workload import Conversation, Workload

TRACE_RATE = -1.0
"""``rate`` value meaning: start each conversation at its trace ``arrival_s``."""


@dataclass(frozen=True)
class LoadPoint:
    """One point of a sweep."""

    concurrency: int
    rate: float = 0.0
    """Conversations started per second (Poisson); 0: as fast as the concurrency allows; TRACE_RATE:
    the trace's own arrival times."""
    requests: int | None = None
    duration_s: float = 0.0
    warmup: int = 0
    seed: int = 0
    turn_gap_s: float = 0.0

    def label(self) -> str:
        if self.rate == TRACE_RATE:
            return f"trace arrivals (max {self.concurrency or 'unbounded'} in flight)"
        if self.rate > 0:
            return f"rate {self.rate:g}/s" + (f" (max {self.concurrency} in flight)" if self.concurrency else "")
        return f"concurrency {self.concurrency}"


@dataclass
class RunResult:
    point: LoadPoint
    results: list[RequestResult]
    not_sent: int
    window: tuple[float, float]
    """Wall-clock (Unix seconds) start and end of the measured window."""
    duration_s: float
    """First request sent -> last request finished (seconds)."""
    server: dict[str, object] = field(default_factory=dict)
    conversations: list[Conversation] = field(default_factory=list)
    """The conversations started in the window, in start order."""


class Progress:
    """A tqdm bar on stderr (or nothing): ``update()`` per finished request."""

    def __init__(self, total: int | None, desc: str, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="req", leave=True, dynamic_ncols=True)
        self.failed = 0

    def update(self, r: RequestResult) -> None:
        self.failed += not r.ok
        if self.bar is not None:
            self.bar.update(1)
            if self.failed:
                self.bar.set_postfix(failed=self.failed)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Runner:
    """Runs conversations of one workload against one target."""

    def __init__(self, target: Target, counter: TokenCounter, *, progress: bool = True) -> None:
        self.target = target
        self.counter = counter
        self.progress = progress

    async def _conversation(self, session: aiohttp.ClientSession, conv: Conversation, clock0: float,
                            gap_s: float, out: list[RequestResult], on_done: Callable[[RequestResult], None]
                            ) -> int:
        """Run ``conv``'s turns in order; returns how many turns were not sent after a failure."""
        replies: list[str] = []
        for k, turn in enumerate(conv.turns):
            if k and gap_s > 0:
                await asyncio.sleep(gap_s)
            res = RequestResult(conv.id, k, 0.0)
            payload = conv.messages(k, replies) if self.target.api == "chat" else conv.prompt(k, replies)
            await send(session, self.target, payload, turn.max_tokens, res, clock0)
            out.append(res)
            on_done(res)
            if not res.ok:
                return len(conv.turns) - k - 1
            replies.append(res.text)
        return 0

    def count_tokens(self, convs: list[Conversation], results: list[RequestResult]) -> None:
        """The client tokenizer's counts of each request, after the run (tokenizing while requests
        stream would delay other streams' timestamps): the prompt as sent, and a completed reply."""
        by_id = {c.id: c for c in convs}
        replies: dict[str, dict[int, str]] = {}
        for r in results:
            if r.ok:
                replies.setdefault(r.conversation, {})[r.turn] = r.text
        for r in results:
            conv = by_id.get(r.conversation)
            if conv is None:
                continue
            history = [replies[conv.id][k] for k in range(r.turn)]  # every earlier turn completed
            if self.target.api == "chat":
                r.client_prompt_tokens = self.counter.chat(conv.messages(r.turn, history))
            else:
                r.client_prompt_tokens = self.counter.prompt(conv.prompt(r.turn, history))
            r.client_completion_tokens = self.counter.output(r.text) if r.ok else None

    async def run(self, workload: Workload, point: LoadPoint, warmup: Workload | None = None,
                  on_window: Callable[[str], None] | None = None) -> RunResult:
        """Warm up, then run ``point``; ``on_window("start"|"end")`` is called as the measured window
        opens and closes (the server-metrics scrape)."""
        limit = None if point.requests is None else max(1, math.ceil(point.requests / workload.turns_each))
        if workload.count is not None:
            limit = workload.count if limit is None else min(limit, workload.count)
        conn = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
            if warmup is not None and point.warmup > 0:
                warm = list(warmup.conversations(point.warmup))
                await self._run(session, warm, LoadPoint(max(1, min(point.concurrency or 1, point.warmup))),
                                sum(len(c.turns) for c in warm), "warmup")
            if on_window is not None:  # scrapes block: off the event loop
                await asyncio.to_thread(on_window, "start")
            convs = workload.conversations(limit)
            t_wall = time.time()
            total = None if limit is None or point.duration_s > 0 else limit * workload.turns_each
            started: list[Conversation] = []
            results, not_sent, dur = await self._run(session, convs, point, total, point.label(), started)
            if on_window is not None:
                await asyncio.to_thread(on_window, "end")
        self.count_tokens(started, results)
        return RunResult(point, results, not_sent, (t_wall, time.time()), dur, conversations=started)

    async def _run(self, session: aiohttp.ClientSession, convs: Iterable[Conversation], point: LoadPoint,
                   total: int | None, desc: str, started: list[Conversation] | None = None
                   ) -> tuple[list[RequestResult], int, float]:
        """Run ``convs`` at ``point``; ``total`` requests (for the bar; None: unknown); each
        conversation is appended to ``started`` as it starts."""
        it = iter(convs)
        results: list[RequestResult] = []
        bar = Progress(total, desc, self.progress)
        not_sent = 0
        clock0 = time.perf_counter()
        deadline = clock0 + point.duration_s if point.duration_s > 0 else math.inf

        def next_conv() -> Conversation | None:
            if time.perf_counter() >= deadline:
                return None
            conv = next(it, None)
            if conv is not None and started is not None:
                started.append(conv)
            return conv

        async def one(conv: Conversation) -> None:
            nonlocal not_sent
            not_sent += await self._conversation(session, conv, clock0, point.turn_gap_s, results, bar.update)

        try:
            if point.rate == 0:
                async def worker() -> None:
                    while (conv := next_conv()) is not None:
                        await one(conv)
                async with asyncio.TaskGroup() as tg:
                    for _ in range(max(1, point.concurrency)):
                        tg.create_task(worker())
            else:
                await self._arrivals(point, next_conv, one, clock0)
        finally:
            bar.close()
        first = min((r.start for r in results), default=0.0)
        last = max((r.start + r.e2e for r in results), default=0.0)
        return results, not_sent, max(last - first, 1e-9)

    async def _arrivals(self, point: LoadPoint, next_conv: Callable[[], Conversation | None],
                        one: Callable[[Conversation], Awaitable[None]], clock0: float) -> None:
        """Start conversations at Poisson (or trace) times, at most ``concurrency`` in flight."""
        rng = random.Random(f"{point.seed}:arrivals")
        slots = asyncio.Semaphore(point.concurrency) if point.concurrency > 0 else None
        t_next = 0.0

        async def guarded(conv: Conversation) -> None:
            try:
                await one(conv)
            finally:
                if slots is not None:
                    slots.release()

        async with asyncio.TaskGroup() as tg:
            while (conv := next_conv()) is not None:
                if point.rate == TRACE_RATE:
                    t_next = conv.arrival_s or 0.0
                else:
                    t_next += rng.expovariate(point.rate)
                delay = clock0 + t_next - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if slots is not None:
                    await slots.acquire()
                tg.create_task(guarded(conv))


async def wait_ready(target: Target, timeout_s: float = 60.0) -> None:
    """Until ``GET {base}/models`` answers 200, or 404/405 (a server without that route), so a
    server that is still starting is waited for."""
    url = target.base + "/models"
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with s.get(url, headers=target.headers(), timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status in (200, 404, 405):
                        return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer 200 within {timeout_s:g} s")
            await asyncio.sleep(0.5)
