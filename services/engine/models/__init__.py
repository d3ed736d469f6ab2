"""Model architectures, one module per family. This package's own namespace is torch-free (the
architecture description only), so a process that runs no model can read a model's shape;
:mod:`services.engine.models.registry` picks the torch module of an architecture."""

from __future__ import annotations

from services.engine.models.config import ARCHITECTURES, ModelArchConfig, ModelConfigError

__all__ = ["ARCHITECTURES", "ModelArchConfig", "ModelConfigError"]
