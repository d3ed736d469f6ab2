"""Errors raised while locating, reading or loading a model."""

from __future__ import annotations

from services.common.errors import OperatorError


class ModelLoadError(OperatorError, RuntimeError):
    """A model spec or file cannot be loaded; the message names the spec or file and why."""
