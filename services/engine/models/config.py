"""The architecture description moved to services/text/model/config.py (torch-free, read by the router too);
these names stay importable here for the benchmarks that still import them from the engine."""

from __future__ import annotations

from services.text.model.config import ARCHITECTURES, ModelArchConfig, ModelConfigError

__all__ = ["ARCHITECTURES", "ModelArchConfig", "ModelConfigError"]
