"""Every setting is declared once: a PDSERVE_* env var read by several config classes
names one declaration (inherited, or repeated with ``reuse``), never two settings that happen to share a
name, and a setting several services take is not written out again."""

from __future__ import annotations

import dataclasses
import importlib
from collections import defaultdict

from services.common.config import env_name

CONFIG_MODULES = (
    "services.common.logging", "services.common.server", "services.common.tracing", "services.common.tls",
    "services.common.config", "services.common.lease", "services.text.model.settings",
    "services.engine.model_settings", "services.engine.config",
    "services.router.config", "services.prefill.config", "services.decode.config", "services.kvstore.config",
    "services.up",
)

SAME_NAME_OWN_SETTING = {
    "PDSERVE_PORT": "each service's own gRPC port: ServerConfig subclasses give it their default and help",
    "PDSERVE_CHUNKED_TRANSFER": "the router's override (unset: each prefill decides) and a prefill's default; "
                                "one env var for both keeps them in agreement",
    "PDSERVE_KV_MOONCAKE_HOST": "the address this process's Mooncake Transfer Engine is reached at, on a decode "
                                "(empty: off) and on a prefill",
    "PDSERVE_INSECURE_INTERNAL": "`pdserve up`'s choice of plaintext over its default mTLS, and each service's "
                                 "permission to serve plaintext beyond loopback; one env var keeps a launcher "
                                 "and the services it starts in agreement",
}
"""Env vars two declarations share on purpose, and why."""


def _config_fields() -> dict[str, set[tuple[str, str, tuple | None]]]:
    """env var -> the distinct (declaring class, help, choices) that read it."""
    out: dict[str, set[tuple[str, str, tuple | None]]] = defaultdict(set)
    for name in CONFIG_MODULES:
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if not (isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == name):
                continue
            for f in dataclasses.fields(cls):
                if "help" in f.metadata:
                    out[env_name(f)].add((cls.__name__, f.metadata["help"], f.metadata.get("choices")))
    return out


def test_an_env_var_names_one_declaration() -> None:
    fields = _config_fields()
    assert "PDSERVE_MODEL" in fields and "PDSERVE_LEASE_MS" in fields
    clashes = {env: sorted(cls for cls, _, _ in decls) for env, decls in fields.items()
               if len({(h, c) for _, h, c in decls}) > 1 and env not in SAME_NAME_OWN_SETTING}
    assert not clashes, f"one env var, several declarations (declare once, inherit or reuse()): {clashes}"


def test_shared_settings_are_inherited_not_redeclared() -> None:
    from services.decode.config import DecodeConfig
    from services.engine.config import EngineConfig
    from services.router.config import RouterConfig

    def declared_by(cls: type, name: str) -> str:
        return next(c.__name__ for c in reversed(cls.__mro__) if name in getattr(c, "__annotations__", {}))

    assert declared_by(RouterConfig, "model") == declared_by(EngineConfig, "model") == "ModelConfig"
    assert declared_by(RouterConfig, "lease_ms") == declared_by(DecodeConfig, "lease_ms") == "LeaseConfig"
    assert declared_by(RouterConfig, "max_model_len") == declared_by(EngineConfig, "max_model_len") == "ContextConfig"
