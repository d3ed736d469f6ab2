"""Errors of the engine that modules on both sides of the engine core raise or catch (the step loop, the
tensor-parallel ranks, the front's client of the engine-core process)."""

from __future__ import annotations

__all__ = ["EngineDeadError"]


class EngineDeadError(RuntimeError):
    """The engine can take no more work: its step loop, a rank of it or its engine-core process died (the
    message says which and why). Every request it held has ended with it."""
