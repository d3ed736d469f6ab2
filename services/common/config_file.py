"""YAML config files: ``--config FILE`` (or ``PDSERVE_CONFIG``) gives every service a file of settings
that :func:`services.common.config.from_args` reads after flags and env vars, before the defaults.

:func:`parse_settings` is what a service's ``main`` calls: its config classes' flags plus ``--config``,
each class built with the file's top level and the service's own section, and a check that the
section names only settings the service has (a typo is a one-line error with a suggestion).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from services.common.cli_args import ArgParser
from services.common.config import ConfigError, _config_fields, add_dataclass_args, env_value, from_args

CONFIG_ENV = "PDSERVE_CONFIG"
SECTIONS = ("up", "router", "prefill", "decode", "kvstore")
"""Sections of a config file: the settings of one service (``up``: ``pdserve up`` itself)."""


@dataclasses.dataclass(frozen=True)
class ConfigFile:
    """Settings from a YAML file (``--config FILE`` / ``PDSERVE_CONFIG``), read with ``yaml.safe_load``
    (no tags, no code). Top-level keys apply to every service that has a setting of that name (the
    others ignore them); a section holds one service's settings and wins over the top level there:

        model: /models/SmolLM2-135M-Instruct.Q4_1.gguf   # every service with --model
        max_model_len: 4096
        log_level: INFO
        router:
          served_model_name: smol
          policy: least_loaded
        decode:
          max_pending: 128

    Keys are setting names as in the flags (``max_model_len`` or ``max-model-len``); values are YAML
    scalars or lists, or strings in the flag syntax. A flag or a ``PDSERVE_*`` env var wins over the file.
    """

    path: str
    shared: Mapping[str, Any]
    sections: Mapping[str, Mapping[str, Any]]

    @staticmethod
    def _keys(where: str, mapping: Mapping[Any, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in mapping.items():
            if not isinstance(k, str) or not k.strip():
                raise ConfigError(f"{where}: keys must be setting names, got {k!r}")
            out[k.strip().replace("-", "_")] = v
        return out

    @classmethod
    def load(cls, path: str) -> ConfigFile:
        """Read and shape-check the file; ConfigError naming the file for anything wrong."""
        import yaml

        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"--config / {CONFIG_ENV}: cannot read {path}: {e.strerror or e}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            raise ConfigError(f"config file {path}: not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: the top level must be a mapping of settings, "
                              f"got {type(data).__name__}")
        shared, sections = {}, {}
        for key, value in cls._keys(f"config file {path}", data).items():
            if key in SECTIONS:
                if not isinstance(value, dict):
                    raise ConfigError(f"config file {path}: section {key} must be a mapping of settings")
                sections[key] = cls._keys(f"config file {path}: {key}", value)
            elif isinstance(value, dict):
                raise ConfigError(f"config file {path}: {key} is a mapping but not a section "
                                  f"({', '.join(SECTIONS)})")
            else:
                shared[key] = value
        return cls(path, shared, sections)

    def values(self, section: str) -> dict[str, Any]:
        """The settings one service sees: the top level, overlaid by its section."""
        return {**self.shared, **self.sections.get(section, {})}

    def where(self, key: str, section: str) -> str:
        """Where a key of ``values(section)`` was written, for error messages."""
        return f"{self.path}: {section}.{key}" if key in self.sections.get(section, {}) else f"{self.path}: {key}"

    def check(self, section: str, classes: Sequence[type], *, shared: bool = False) -> None:
        """ConfigError for a key of ``section`` (and with ``shared``, of the top level too) that names
        no setting of ``classes``, with the closest name as a suggestion."""
        known = {f.name for cls in classes for f in _config_fields(cls)}
        keys = [(k, f"{section}.{k}") for k in self.sections.get(section, {})]
        keys += [(k, k) for k in self.shared] if shared else []
        for key, shown in keys:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(f"config file {self.path}: {shown}: no such setting{hint}")


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` (or ``PDSERVE_CONFIG``): a YAML file of settings (:class:`ConfigFile`)."""
    parser.add_argument("--config", metavar="FILE", default=None,
                        help=f"YAML file of settings: keys are the settings' names (max_model_len), sections "
                             f"{', '.join(SECTIONS)} hold one service's own; a flag or PDSERVE_* env var wins "
                             f"over it. [env: {CONFIG_ENV}]")


def config_file(ns: argparse.Namespace | None, environ: Mapping[str, str] | None = None) -> ConfigFile | None:
    """The file ``--config`` names, else ``PDSERVE_CONFIG``'s, loaded; None when neither is set."""
    path = getattr(ns, "config", None) or (env_value(CONFIG_ENV) if environ is None else environ.get(CONFIG_ENV))
    return ConfigFile.load(path) if path else None


def parse_settings(classes: Sequence[type], argv: Sequence[str] | None, *, prog: str, section: str,
                   description: str | None = None,
                   parser: argparse.ArgumentParser | None = None) -> list[Any]:
    """A service's settings: one flag group per class plus ``--config``; each class built from flags,
    env, the config file's top level and ``section``, defaults. A key in the file's own section that
    names no setting here is an error. Raises ConfigError (argparse exits on malformed flags)."""
    p = parser or ArgParser(prog=prog, description=description)
    add_config_arg(p)
    for cls in classes:
        add_dataclass_args(p, cls)
    ns = p.parse_args(argv)
    file = config_file(ns)
    out = [from_args(cls, ns, file=file, section=section) for cls in classes]
    if file is not None:
        file.check(section, classes)
    return out
