"""API keys of the router's public API (HTTP ``Authorization: Bearer <key>``, gRPC ``authorization``
metadata). Keys come from the router's own settings, never from a request."""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from pathlib import Path

from services.common.config import ConfigError

BEARER = "bearer "


class APIKeys:
    """The accepted keys; empty means the API is open (no key required)."""

    def __init__(self, keys: Sequence[str] = ()) -> None:
        self._keys = tuple(k.encode() for k in keys if k)

    @classmethod
    def load(cls, api_key: str = "", api_key_file: str = "") -> APIKeys:
        """``api_key`` plus one key per non-empty, non-``#`` line of ``api_key_file``.

        Raises ConfigError naming the setting when the file cannot be read or holds no key."""
        keys = [api_key.strip()] if api_key.strip() else []
        if api_key_file:
            try:
                lines = Path(api_key_file).read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"--api-key-file / PDSERVE_API_KEY_FILE: cannot read {api_key_file!r}: {e}",
                                  field_name="api_key_file") from e
            file_keys = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
            if not file_keys:
                raise ConfigError(f"--api-key-file / PDSERVE_API_KEY_FILE: {api_key_file!r} holds no key",
                                  field_name="api_key_file")
            keys += file_keys
        bad = next((k for k in keys if any(c.isspace() for c in k)), None)
        if bad is not None:
            raise ConfigError("--api-key / --api-key-file: an API key must not contain whitespace",
                              field_name="api_key")
        return cls(keys)

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: str | None) -> bool:
        """True when no key is required or ``authorization`` is ``Bearer <an accepted key>``.

        Every key is compared in constant time (hmac.compare_digest), so timing does not tell how
        much of a guess matched nor which key it came close to."""
        if not self._keys:
            return True
        if not authorization or authorization[:len(BEARER)].lower() != BEARER:
            return False
        try:
            given = authorization[len(BEARER):].strip().encode()
        except UnicodeEncodeError:
            return False
        ok = False
        for k in self._keys:
            ok |= hmac.compare_digest(given, k)
        return ok
