"""Per-request sampling parameters, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

MAX_TOP_LOGPROBS = 20
"""Most alternatives a request may ask for per output position (OpenAI's limit for chat)."""


@dataclass(frozen=True)
class TopLogprobs:
    """The most likely tokens at one output position under the model's raw distribution (before
    temperature, top-k and top-p), most likely first."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """Natural-log probabilities, same order as token_ids (non-increasing)."""


class Sampled(NamedTuple):
    """One sampled position: the token, its logprob (None unless params.logprobs) and its alternatives
    (None unless params.top_logprobs > 0)."""

    token: int
    logprob: float | None = None
    top: TopLogprobs | None = None


class InvalidRequestError(ValueError):
    """A request field is out of range or malformed. The message names the field."""

    def __init__(self, field_name: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.code = code
        """OpenAI's error code: invalid_value, or context_length_exceeded for a request past the context."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    """Most tokens to generate (> 0)."""
    temperature: float = 1.0
    """0 means greedy; must be >= 0."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    seed: int | None = None
    """Per-request RNG seed; the same seed and prompt give the same tokens."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; the output ends before the first occurrence."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end the request (EOS always does unless ignore_eos)."""
    ignore_eos: bool = False
    logprobs: bool = False
    """Return the log-probability of each chosen token."""
    top_logprobs: int = 0
    """Also return this many most likely tokens per position, in [0, MAX_TOP_LOGPROBS]; needs logprobs."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> SamplingParams:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequestError("max_tokens", f"must be an integer, got {self.max_tokens!r}")
        if self.max_tokens <= 0:
            raise InvalidRequestError("max_tokens", f"must be > 0, got {self.max_tokens}")
        if not isinstance(self.temperature, (int, float)) or self.temperature != self.temperature:
            raise InvalidRequestError("temperature", f"must be a number, got {self.temperature!r}")
        if self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError("top_k", f"must be an integer >= -1 (0 or -1 disables), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequestError("seed", f"must be an integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError("stop", "must be a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", "must be a list of non-negative integers")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) or not (
                0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                                                      f"got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "requires logprobs")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        return self
