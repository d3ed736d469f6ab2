"""Settings of ``pdserve bench serve`` / ``bench ab``: one dataclass each for the target server, the
workload, the load (sweep) and the report. Every field is a flag and a ``PDSERVE_BENCH_*`` env var; a
recipe's YAML sections use the same field names (recipes.py)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import opt, require

WORKLOADS = ("random", "multi_turn", "trace", "accuracy")


def _env(name: str) -> str:
    return "PDSERVE_BENCH_" + name.upper()


@dataclass
class TargetConfig:
    """Server under test (any OpenAI-compatible server)."""

    base_url: str = opt("", "OpenAI base URL, e.g. http://127.0.0.1:8000/v1 (with --recipe: the started "
                            "deployment's router).", env=_env("base_url"))
    model: str = opt("", "Model name sent in requests; empty: the first id /v1/models lists.", env=_env("model"))
    api: str = opt("chat", "API: chat (/v1/chat/completions) or completions (/v1/completions); streamed.",
                   choices=("chat", "completions"), env=_env("api"))
    api_key: str = opt("", "Bearer token for the server's API.", env=_env("api_key"))
    metrics_urls: tuple[str, ...] = opt((), "pdserve services' metrics host:port (comma-separated) to scrape "
                                            "over the same window, or a .json target file as `pdserve up "
                                            "--prometheus-sd FILE` writes; with --recipe: every service.",
                                        env=_env("metrics_urls"))
    reference_url: str = opt("", "accuracy: a second server (e.g. a colocated pdserve) asked the same questions; "
                                 "the report says how often its tokens equal the first's.", env=_env("reference_url"))
    timeout_s: float = opt(600.0, "Longest a request may take (seconds); past it the request is a "
                                  "'timeout' failure.", env=_env("timeout_s"))

    def __post_init__(self) -> None:
        require(self.timeout_s > 0, self, "timeout_s", f"must be > 0, got {self.timeout_s}")


@dataclass
class WorkloadConfig:
    """What each request asks."""

    workload: str = opt("random", "random: single turns of random length; multi_turn: conversations whose "
                                  "context grows turn by turn; trace: a JSONL trace (--trace); accuracy: "
                                  "questions with known answers, greedy.", choices=WORKLOADS, env=_env("workload"))
    input_tokens: int = opt(256, "Mean prompt tokens (multi_turn: new tokens per user turn).", env=_env("input_tokens"))
    input_spread: float = opt(0.0, "Relative spread of prompt lengths: uniform in mean * (1 +- spread).",
                              env=_env("input_spread"))
    output_tokens: int = opt(32, "Mean output tokens (max_tokens; with --ignore-eos exactly that many).",
                             env=_env("output_tokens"))
    output_spread: float = opt(0.0, "Relative spread of output lengths.", env=_env("output_spread"))
    turns: int = opt(4, "multi_turn: user turns per conversation.", env=_env("turns"))
    shared_prefix_tokens: int = opt(0, "multi_turn: a system prompt of this many tokens opens every "
                                       "conversation (shared by all).", env=_env("shared_prefix_tokens"))
    turn_gap_s: float = opt(0.0, "Think time between a conversation's turns (seconds).", env=_env("turn_gap_s"))
    trace: str = opt("", "JSONL trace (workload trace) or question file (workload accuracy; empty: the "
                         "seeded built-in set). Format: benchmarks/serve/workload.py.", env=_env("trace"))
    accuracy_items: int = opt(40, "accuracy: questions in the seeded built-in set (every question is asked at "
                                  "each sweep point; --requests does not apply).", env=_env("accuracy_items"))
    seed: int = opt(0, "Seed of every random choice (lengths, words, arrivals, questions).", env=_env("seed"))
    ignore_eos: bool = opt(True, "Ask the server to ignore EOS so outputs have the requested length "
                                 "(accuracy: always off).", env=_env("ignore_eos"))
    temperature: float = opt(0.0, "Sampling temperature (accuracy: always 0, greedy).", env=_env("temperature"))
    logprobs: bool = opt(False, "Ask for the chosen token's logprob in every request (chat: logprobs true, "
                                "completions: logprobs 1; accuracy: always on).", env=_env("logprobs"))
    tokenizer: str = opt("embedded", "Tokenizer for prompt lengths and client-side counts: embedded (pdserve's "
                                     "default SmolLM2 GGUF), byte (random:NAME models: one token per byte), "
                                     "a .gguf file, an HF directory, or none.",
                         env=_env("tokenizer"))
    save_trace: str = opt("", "Also write the first sweep point's conversations here as a JSONL trace.",
                          env=_env("save_trace"))

    def __post_init__(self) -> None:
        for name in ("input_tokens", "output_tokens", "turns"):
            require(getattr(self, name) >= 1, self, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("input_spread", "output_spread"):
            require(0 <= getattr(self, name) < 1, self, name, f"must be in [0, 1), got {getattr(self, name)}")
        require(self.workload != "trace" or bool(self.trace), self, "trace", "workload trace needs --trace FILE")


@dataclass
class LoadConfig:
    """How hard and how long: one run per sweep point."""

    concurrency: tuple[int, ...] = opt((4,), "Concurrency levels to sweep (comma-separated); with --rate, "
                                             "one value: the cap on conversations in flight (0: none).",
                                       env=_env("concurrency"))
    rate: tuple[str, ...] = opt((), "Poisson arrival rates to sweep (conversations/s, comma-separated), or "
                                    "'trace' (the trace's arrival_s); empty: closed loop at each concurrency.",
                                env=_env("rate"))
    requests: int = opt(32, "Requests per sweep point (multi_turn: rounded up to whole conversations); "
                            "with --duration-s the most sent.", env=_env("requests"))
    duration_s: float = opt(0.0, "Stop starting new conversations after this long (seconds); 0: run "
                                 "--requests.", env=_env("duration_s"))
    warmup: int = opt(2, "Warmup requests before each point's window (not reported).", env=_env("warmup"))

    def __post_init__(self) -> None:
        self.concurrency = tuple(int(c) for c in self.concurrency)
        require(bool(self.concurrency), self, "concurrency", "give at least one level")
        require(all(c >= (0 if self.rate else 1) for c in self.concurrency), self, "concurrency",
                f"levels must be >= 1, got {self.concurrency}")
        require(not self.rate or len(self.concurrency) == 1, self, "concurrency",
                "with --rate give one value (the in-flight cap)")
        for r in self.rate:
            require(r == "trace" or _positive(r), self, "rate", f"rates are numbers > 0 or 'trace', got {r!r}")
        require(self.requests >= 1, self, "requests", f"must be >= 1, got {self.requests}")
        require(self.duration_s >= 0, self, "duration_s", f"must be >= 0, got {self.duration_s}")
        require(self.warmup >= 0, self, "warmup", f"must be >= 0, got {self.warmup}")


def _positive(s: str) -> bool:
    try:
        return float(s) > 0
    except ValueError:
        return False


@dataclass
class ReportConfig:
    """What the report counts and where it goes."""

    slo_ttft_ms: float = opt(0.0, "Goodput SLO on TTFT (ms); 0: no bound.", env=_env("slo_ttft_ms"))
    slo_tpot_ms: float = opt(0.0, "Goodput SLO on TPOT (ms); 0: no bound.", env=_env("slo_tpot_ms"))
    slo_e2e_ms: float = opt(0.0, "Goodput SLO on end-to-end latency (ms); 0: no bound.", env=_env("slo_e2e_ms"))
    num_gpus: int = opt(0, "GPUs serving: adds per-GPU throughput when > 0.", env=_env("num_gpus"))
    out: str = opt("", "Directory for report.json, report.md and the PNG plots; empty: print only.",
                   env=_env("out"))
    label: str = opt("", "Name of this server in the report (default: the recipe name or the URL).",
                     env=_env("label"))
    note: str = opt("", "A note printed at the top of the report (e.g. what else ran on the host).",
                    env=_env("note"))
    progress: bool = opt(True, "Progress bar on stderr.", env=_env("progress"))
    plots: bool = opt(True, "Write PNG plots (needs matplotlib) when --out is given.", env=_env("plots"))
