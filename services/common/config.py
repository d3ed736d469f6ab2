"""Config dataclasses -> CLI flags with PDSERVE_* env fallbacks, declared once.

Each subsystem declares one dataclass whose fields carry their help text:

    @dataclass
    class SchedulerConfig:
        max_num_seqs: int = opt(256, "Most sequences in one batch.")
        policy: str = opt("fcfs", "Queue order.", choices=("fcfs", "priority"))

        def __post_init__(self) -> None:
            require(self.max_num_seqs > 0, self, "max_num_seqs", f"must be > 0, got {self.max_num_seqs}")

A field becomes the flag ``--max-num-seqs`` and the env var ``PDSERVE_MAX_NUM_SEQS`` (a ``prefix``
adds to both: prefix "decode-" gives ``--decode-max-num-seqs`` / ``PDSERVE_DECODE_MAX_NUM_SEQS``), and
the key ``max_num_seqs`` of a YAML config file (``--config FILE`` / ``PDSERVE_CONFIG``, see
services/common/config_file.py). Precedence: flag, then env var, then config file, then the field default. Every
bad value raises ``ConfigError`` whose message names the flag and the env var (and the file's key).
This module is the only reader of ``os.environ``.

Value syntax (flags and env vars alike): bool ``1/true/yes/on`` or ``0/false/no/off`` (flags also take
``--x`` / ``--no-x``); list fields are comma-separated; ``X | None`` fields take ``none`` or an empty
string for None; enum fields take the member value.

Ruff's RUF009 flags ``opt(...)`` on fields annotated with a mutable or enum type (``list[str]``, an
Enum); pyproject should list ``services.common.config.opt`` under
``[tool.ruff.lint.flake8-bugbear] extend-immutable-calls``. Until then use ``tuple[str, ...]`` or
``dataclasses.field(default=..., metadata={"help": ...})``, which this module reads the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from services.common.cli_args import ArgParser

if TYPE_CHECKING:
    from services.common.config_file import ConfigFile

T = TypeVar("T")

ENV_PREFIX = "PDSERVE_"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_NONE = frozenset({"", "none", "null"})
_UNSET = object()


class ConfigError(ValueError):
    """A setting is invalid. The message names the field's flag and env var."""

    def __init__(self, message: str, *, field_name: str | None = None, detail: str | None = None) -> None:
        super().__init__(message)
        self.field_name = field_name
        self.detail = detail if detail is not None else message


def opt(
    default: Any,
    help: str,
    *,
    choices: Sequence[Any] | None = None,
    env: str | None = None,
    group: str | None = None,
) -> Any:
    """Declare a config field: default, help text, optional allowed values and env var override.

    ``env`` replaces the derived env var name (it is used as given, prefix included). ``group`` puts the
    flag under its own heading in ``--help`` (default: the class's). Mutable defaults (list, dict, set)
    are copied per instance.
    """
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None, "env": env,
                "group": group}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def reuse(cls: type, name: str, *, group: str | None = None, default: Any = dataclasses.MISSING) -> Any:
    """Field ``name`` of config class ``cls`` declared again for another command with the same default,
    help, choices and env var, so a setting several commands take has one declaration (``pdserve up
    --policy`` is the router's ``--policy``, read from ``PDSERVE_POLICY`` by both). ``default`` replaces
    the default where the other command has a better one (it must be one of the choices)."""
    f = _field(cls, name)
    choices = f.metadata.get("choices")
    if default is dataclasses.MISSING:
        default = _default_of(f)
    elif choices is not None and default not in choices:
        raise ValueError(f"default {default!r} of reused {cls.__name__}.{name} is not one of {choices}")
    return opt(default, f.metadata.get("help", ""), choices=choices, env=env_name(f), group=group)


def flag_name(name: str, prefix: str = "") -> str:
    """``max_num_seqs`` -> ``--max-num-seqs`` (with ``prefix`` inserted after the dashes)."""
    return "--" + (prefix + name).replace("_", "-")


def env_name(f: dataclasses.Field[Any] | str, prefix: str = "") -> str:
    """The env var of a field: its ``opt(env=...)`` or ``PDSERVE_`` + prefix + NAME."""
    if isinstance(f, dataclasses.Field):
        explicit = f.metadata.get("env")
        if explicit:
            return str(explicit)
        name = f.name
    else:
        name = f
    return ENV_PREFIX + (prefix + name).replace("-", "_").upper()


def _dest(name: str, prefix: str) -> str:
    return (prefix + name).replace("-", "_")


def _field(cls: type, name: str) -> dataclasses.Field[Any]:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def field_error(cfg: Any, name: str, detail: str, *, prefix: str = "") -> ConfigError:
    """A ConfigError for field ``name`` of config ``cfg`` (instance or class)."""
    cls = cfg if isinstance(cfg, type) else type(cfg)
    f = _field(cls, name)
    return ConfigError(
        f"{flag_name(name, prefix)} / {env_name(f, prefix)}: {detail}", field_name=name, detail=detail
    )


def require(ok: bool, cfg: Any, name: str, detail: str) -> None:
    """Validation helper for ``__post_init__``: raise ``field_error`` unless ``ok``."""
    if not ok:
        raise field_error(cfg, name, detail)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (tp, False)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != len(typing.get_args(tp)):
            if len(args) != 1:
                raise TypeError(f"unsupported config type {tp!r}: only X | None unions")
            return args[0], True
        raise TypeError(f"unsupported config type {tp!r}: only X | None unions")
    return tp, False


def _scalar_parser(tp: Any) -> Callable[[str], Any]:
    if tp is bool:
        def parse_bool(s: str) -> bool:
            v = s.strip().lower()
            if v in _TRUE:
                return True
            if v in _FALSE:
                return False
            raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {s!r}")
        return parse_bool
    if tp is int:
        def parse_int(s: str) -> int:
            try:
                return int(s.strip().replace("_", ""), 0)
            except ValueError:
                raise ValueError(f"expected an integer, got {s!r}") from None
        return parse_int
    if tp is float:
        def parse_float(s: str) -> float:
            try:
                return float(s.strip())
            except ValueError:
                raise ValueError(f"expected a number, got {s!r}") from None
        return parse_float
    if tp is str:
        return str
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        def parse_enum(s: str) -> enum.Enum:
            for member in tp:
                if s == str(member.value) or s == member.name:
                    return member
            allowed = ", ".join(str(m.value) for m in tp)
            raise ValueError(f"expected one of {allowed}, got {s!r}")
        return parse_enum
    raise TypeError(f"unsupported config type {tp!r}")


def _value_parser(tp: Any) -> Callable[[str], Any]:
    """A str -> value converter for a field type (raises ValueError with a readable message)."""
    inner, optional = _unwrap_optional(tp)
    origin = typing.get_origin(inner)
    if origin in (list, tuple):
        args = typing.get_args(inner) or (str,)
        if origin is tuple and (len(args) != 2 or args[1] is not Ellipsis):
            raise TypeError(f"unsupported config type {inner!r}: use tuple[X, ...]")
        item = _scalar_parser(args[0])

        def parse_seq(s: str) -> Any:
            return origin(item(part.strip()) for part in s.split(",") if part.strip())
        base: Callable[[str], Any] = parse_seq
    else:
        base = _scalar_parser(inner)
    if not optional:
        return base

    def parse_optional(s: str) -> Any:
        return None if s.strip().lower() in _NONE else base(s)
    return parse_optional


def _hints(cls: type) -> dict[str, Any]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    return typing.get_type_hints(cls)


def _config_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _UNSET


def _show(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return repr(value) if isinstance(value, str) else str(value)


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> argparse._ArgumentGroup:
    """Add one flag per field of dataclass ``cls`` to ``parser`` (in a group named after the class).

    Flags default to "not given", so ``from_args`` can fall back to the env var, then the field default.
    """
    hints = _hints(cls)
    doc = (cls.__doc__ or "").strip().splitlines()
    fields = _config_fields(cls)
    main = parser.add_argument_group(cls.__name__, doc[0] if doc and not doc[0].startswith(cls.__name__ + "(") else None) \
        if any(not f.metadata.get("group") for f in fields) or not fields else None
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields:
        heading = f.metadata.get("group")
        if heading and heading not in groups:
            groups[heading] = parser.add_argument_group(heading)
        group = groups[heading] if heading else main
        assert group is not None
        tp = hints[f.name]
        inner, _ = _unwrap_optional(tp)
        choices = f.metadata.get("choices")
        if choices is None and isinstance(inner, type) and issubclass(inner, enum.Enum):
            choices = tuple(m.value for m in inner)
        default = _default_of(f)
        parts = [f.metadata.get("help", "").strip()]
        if choices:
            parts.append("choices: " + ", ".join(str(c) for c in choices) + ".")
        shown_default = "required" if default is _UNSET else _show(default)
        parts.append(f"[default: {shown_default}; env: {env_name(f, prefix)}]")
        kwargs: dict[str, Any] = {"dest": _dest(f.name, prefix), "default": None, "help": " ".join(p for p in parts if p)}
        if inner is bool:
            # --x / --no-x, and --x=false for symmetry with the env var.
            kwargs.update(action=_BoolAction, nargs="?", const="true", metavar="BOOL")
            group.add_argument(flag_name(f.name, prefix), flag_name("no_" + f.name, prefix), **kwargs)
        else:
            kwargs["metavar"] = f.name.upper()
            group.add_argument(flag_name(f.name, prefix), **kwargs)
    return main or next(iter(groups.values()))


class _BoolAction(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if option_string is not None and option_string.startswith("--no-"):
            if values not in (None, "true"):
                parser.error(f"{option_string} takes no value")
            values = "false"
        setattr(namespace, self.dest, values)


def _coerce(tp: Any, value: Any) -> Any:
    """A YAML value (bool, int, float, str, list, None) as field type ``tp``; strings go through the
    flag parser. Raises ValueError with a readable message."""
    inner, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise ValueError("must not be null")
    if isinstance(value, str):
        return _value_parser(tp)(value)
    origin = typing.get_origin(inner)
    if origin in (list, tuple):
        items = value if isinstance(value, list) else [value]
        item_tp = (typing.get_args(inner) or (str,))[0]
        return origin(_coerce(item_tp, v) for v in items)
    if inner is bool and isinstance(value, bool):
        return value
    if inner is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if inner is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        return _scalar_parser(inner)(str(value))
    want = getattr(inner, "__name__", str(inner))
    raise ValueError(f"expected {want}, got {value!r} ({type(value).__name__}){'; quote it' if want == 'str' else ''}")


def from_args(cls: type[T], ns: argparse.Namespace | Mapping[str, Any] | None = None, prefix: str = "",
              *, environ: Mapping[str, str] | None = None, file: ConfigFile | None = None,
              section: str = "") -> T:
    """Build ``cls`` from parsed flags (``ns``), env vars, the config ``file`` (its top level and
    ``section``), then field defaults; then validate.

    ``environ`` replaces ``os.environ`` (tests). Raises ConfigError naming the flag and env var.
    """
    env = os.environ if environ is None else environ
    given = vars(ns) if isinstance(ns, argparse.Namespace) else dict(ns or {})
    from_file = file.values(section) if file is not None else {}
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in _config_fields(cls):
        key = _dest(f.name, prefix)
        raw = given.get(key)
        source = "flag"
        if raw is None:
            ev = env_name(f, prefix)
            if ev in env:
                raw, source = env[ev], "env"
        if raw is None and key in from_file:
            assert file is not None
            try:
                raw, source = _coerce(hints[f.name], from_file[key]), "file"
            except ValueError as e:
                raise field_error(cls, f.name, f"{e} (from config file {file.where(key, section)})",
                                  prefix=prefix) from None
            if raw is None:  # null for an X | None setting
                kwargs[f.name] = None
                continue
        if raw is None:
            if _default_of(f) is _UNSET:
                raise field_error(cls, f.name, "is required (no default)", prefix=prefix)
            continue
        if isinstance(raw, str) and source != "file":
            try:
                value = _value_parser(hints[f.name])(raw)
            except ValueError as e:
                where = f"{source} value" if source == "flag" else f"env {env_name(f, prefix)}"
                raise field_error(cls, f.name, f"{e} (from {where})", prefix=prefix) from None
        else:
            value = raw
        choices = f.metadata.get("choices")
        if choices is not None and isinstance(value, str) and value not in choices:
            # Choices match case-insensitively (--log-level debug) and take the declared spelling.
            value = next((c for c in choices if isinstance(c, str) and c.lower() == value.lower()), value)
        if choices is not None:
            bad = [v for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None and v not in choices]
            if bad:
                allowed = ", ".join(str(c) for c in choices)
                raise field_error(cls, f.name, f"must be one of {allowed}, got {_show(bad[0])}", prefix=prefix)
        kwargs[f.name] = value
    try:
        cfg = cls(**kwargs)
        validate = getattr(cfg, "validate", None)
        if callable(validate):
            validate()
    except ConfigError as e:
        if e.field_name is not None and prefix:
            raise field_error(cls, e.field_name, e.detail, prefix=prefix) from None
        raise
    return cfg


@dataclasses.dataclass
class ContextConfig:
    """The context length a deployment serves, declared once for the router and the engines."""

    max_model_len: int = opt(0, "Longest sequence (prompt + output, tokens); 0: the model's own context. The "
                                "router refuses longer requests (HTTP 400), the engines size their schedules "
                                "to it: give every service the same value (pdserve up does).")


def parse_config(cls: type[T], argv: Sequence[str] | None = None, *, prog: str | None = None,
                 description: str | None = None) -> T:
    """One-config convenience: build a parser for ``cls``, parse ``argv`` and return the config."""
    parser = ArgParser(prog=prog, description=description)
    add_dataclass_args(parser, cls)
    return from_args(cls, parser.parse_args(argv))


def env_value(name: str, default: str | None = None) -> str | None:
    """A rare knob not worth a flag: the env var ``name`` (``PDSERVE_`` added when missing)."""
    key = name if name.startswith(ENV_PREFIX) else ENV_PREFIX + name
    return os.environ.get(key, default)


def env_flag(name: str, default: bool = False) -> bool:
    """A rare boolean knob: ``PDSERVE_<NAME>`` parsed like a bool field. Raises ConfigError if malformed."""
    key = name if name.startswith(ENV_PREFIX) else ENV_PREFIX + name
    raw = os.environ.get(key)
    if raw is None or raw.strip() == "":
        return default
    try:
        return bool(_scalar_parser(bool)(raw))
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def config_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain values (enums by value), for startup logs."""
    return {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in dataclasses.asdict(cfg).items()}
