"""Command-line flags and config files for ``hydra-lm train``, both mapped onto ``TrainConfig``.

Every flag defaults to ``None`` so that only what the user typed overrides lower layers
(field defaults < the run's saved config < the config file < the command line).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .options import FIELDS, KEY_ALIASES, MODEL_ALIASES, REMOVED_KEYS, normalize

MODEL_PREFIX = "--model."


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="TOML (or YAML, with pyyaml) file whose keys mirror these "
                                                       "flags; a [model] table overrides model config fields")
    add_field_arguments(parser, FIELDS)
    parser.add_argument("--8bit_adam", dest="alias_8bit_adam", action="store_true", default=None,
                        help="same as --optimizer adam8bit (needs CUDA and torchao or bitsandbytes)")
    parser.add_argument("--adafactor", dest="alias_adafactor", action="store_true", default=None,
                        help="same as --optimizer adafactor")
    parser.add_argument("--experimental_cuda_graphs", dest="alias_experimental_cuda_graphs", action="store_true",
                        default=None, help="same as --cuda_graph")
    for name, kind in MODEL_ALIASES.items():
        extra = dict(action=argparse.BooleanOptionalAction) if kind is bool else dict(type=kind)
        parser.add_argument(f"--{name}", dest=f"model_alias_{name}", default=None,
                            help=f"same as --model.{name}", **extra)
    parser.epilog = ("Model config fields: --model.FIELD VALUE (e.g. --model.mod_capacity 0.5); values are "
                     "parsed as JSON where possible (numbers, true/false, null, lists), else as a number (.5, +1, "
                     "nan), else as text.")


def add_field_arguments(parser: argparse.ArgumentParser, fields: dict[str, Any]) -> None:
    """One flag per dataclass field (``opt`` metadata), default None (= not typed); booleans also get
    their ``--no-NAME`` form. The ``model`` field is the ``--model.FIELD`` overrides, not a flag."""
    for name, f in fields.items():
        meta = f.metadata
        if name == "model":
            continue
        flags = (f"--{name}",)
        if meta["type"] is bool:
            parser.add_argument(*flags, dest=name, default=None, action=argparse.BooleanOptionalAction,
                                help=meta["help"])
        else:
            parser.add_argument(*flags, dest=name, default=None, type=meta["type"], choices=meta.get("choices"),
                                help=meta["help"])
    for name, message in REMOVED_KEYS.items():  # hidden: typed, they say what replaced them
        if name not in fields:
            parser.add_argument(f"--{name}", nargs="?", action=_Removed, message=message, help=argparse.SUPPRESS)


class _Removed(argparse.Action):
    """A flag that no longer exists: typing it stops with what to do instead."""

    def __init__(self, *args, message: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.message = message

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(self.message)


def split_model_overrides(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Take ``--model.KEY VALUE`` / ``--model.KEY=VALUE`` out of argv (argparse cannot declare them)."""
    rest: list[str] = []
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token.startswith(MODEL_PREFIX):
            key = token[len(MODEL_PREFIX):]
            if "=" in key:
                key, raw = key.split("=", 1)
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):  # not the next flag (a negative number is)
                i += 1
                raw = argv[i]
            else:
                raise ValueError(f"{token} needs a value (--model.KEY VALUE or --model.KEY=VALUE)")
            if not key:
                raise ValueError(f"{token}: missing the model field name")
            overrides[key] = parse_value(raw)
        else:
            rest.append(token)
        i += 1
    return rest, overrides


def parse_value(raw: str) -> Any:
    lowered = raw.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return json.loads(raw)
    except ValueError:
        pass
    # Numbers JSON does not write but Python reads, as the typed flags do (--lr .5): .5, +1, 1e3, nan, inf.
    for number in (int, float):
        try:
            return number(raw)
        except ValueError:
            pass
    return raw


def cli_values(args: argparse.Namespace, model_overrides: dict[str, Any]) -> dict[str, Any]:
    """The train settings the user typed, as TrainConfig keys."""
    values = {name: getattr(args, name) for name in FIELDS if name != "model" and getattr(args, name, None) is not None}
    given: dict[str, str] = {}  # field -> the flag that set it, as typed
    for alias, (field, target) in KEY_ALIASES.items():
        if getattr(args, f"alias_{alias}", None):
            if field in values and values[field] != target:
                typed = (f"--{field}" if values[field] else f"--no-{field}") if isinstance(values[field], bool) \
                    else f"--{field} {values[field]}"
                raise ValueError(f"--{alias} contradicts {given.get(field, typed)}")
            values[field], given[field] = target, f"--{alias}"
    for name in MODEL_ALIASES:
        if getattr(args, f"model_alias_{name}", None) is not None:
            values[name] = getattr(args, f"model_alias_{name}")
    if model_overrides:
        values["model"] = dict(model_overrides)
    return normalize(values, "the command line")


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML/YAML config file into normalized TrainConfig keys (a ``[model]`` table included)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ValueError(f"{path}: YAML config files need pyyaml (pip install pyyaml); "
                                 "or write the file as TOML") from None
            data = yaml.safe_load(text) or {}
        elif suffix == ".json":
            data = json.loads(text)
        else:
            try:
                import tomllib
            except ImportError:  # Python 3.10: the same parser as a package (a dependency there)
                import tomli as tomllib

            data = tomllib.loads(text)
    except ValueError as err:
        if str(err).startswith(str(path)):
            raise
        raise ValueError(f"config file {path} cannot be parsed: {err}") from None
    except Exception as err:  # yaml raises its own error types
        raise ValueError(f"config file {path} cannot be parsed: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: expected a table of keys at the top level")
    if isinstance(data.get("train"), dict):  # allow a [train] table beside [model]
        data = {**{k: v for k, v in data.items() if k != "train"}, **data["train"]}
    return normalize(data, f"config file {path}")


def to_toml(values: dict[str, Any]) -> str:
    """TOML for the flat train settings plus a [model] table (None values are left out: TOML has no null)."""
    lines = []
    tables = {k: v for k, v in values.items() if isinstance(v, dict)}
    for key, value in values.items():
        if value is None or isinstance(value, dict):
            continue
        lines.append(f"{key} = {_toml_value(value)}")
    for name, table in tables.items():
        lines.append(f"\n[{name}]")
        for key, value in table.items():
            if value is not None:
                lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))
