"""Errors raised while locating, reading or loading a model."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model spec or file cannot be loaded; the message names the spec or file and why."""
