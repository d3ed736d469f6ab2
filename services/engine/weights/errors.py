"""ModelLoadError moved to services/text/model/errors.py (the router raises it too); it stays importable here
for the modules that still import it from the engine."""

from __future__ import annotations

from services.text.model.errors import ModelLoadError

__all__ = ["ModelLoadError"]
