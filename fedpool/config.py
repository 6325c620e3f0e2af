"""A command's settings from flags, the environment, a config file and the defaults, in that order of precedence
(pydantic-settings merges the sources), and `--show-config` to print them with where each came from.

The config file is TOML (`fedpool.toml`) or YAML (`.yaml`/`.yml`), found at `--config PATH`, else
`$FEDPOOL_CONFIG`, else `./fedpool.toml`, else `~/.fedpool/config.toml`. Top-level keys apply to every
command that has that option; a table named after a command (`[gateway]`, `[eval]`, `["eval run"]`,
`[jobs]`, ...) applies to that command and its actions, the more specific table winning. Keys are option
names with dashes or underscores (`api-key-file`, `max_running_jobs`). Environment variables are
`FEDPOOL_` + the option name in capitals with underscores (`FEDPOOL_ADDRESS`, `FEDPOOL_POLICY`).
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml
from pydantic import SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, InitSettingsSource

from fedpool.options import EnvOnly, Options, flag_names, key_of, marker, option_fields
from fedpool.pipeline.artifact import SECRET_NAME

SECRET_WORDS = ("token", "secret", "password", "api_key")
OUR_MESSAGES = frozenset({"number", "range", "choice"})  # options.py's errors, which say what was given


class ConfigError(Exception):
    """A flag, an environment variable or the config file is wrong; the message names it (and the key)."""


def find_config_file(given: Path | None, environ: Mapping[str, str]) -> Path | None:
    named = given or (Path(environ["FEDPOOL_CONFIG"]).expanduser() if environ.get("FEDPOOL_CONFIG") else None)
    if named is not None:  # the file named must be there
        if not named.is_file():
            raise ConfigError(f"{f'--config {named}' if given else f'FEDPOOL_CONFIG={named}'}: no such file")
        return named
    for candidate in (Path("fedpool.toml"), Path("~/.fedpool/config.toml").expanduser()):
        if candidate.is_file():
            return candidate
    return None


def read_config_file(path: Path) -> dict[str, Any]:
    kind = "YAML" if path.suffix in (".yaml", ".yml") else "TOML"
    try:
        text = path.read_text(encoding="utf-8")
        data = (yaml.safe_load(text) or {}) if kind == "YAML" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not valid {kind} ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start} cannot be decoded)") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except PermissionError:
        raise ConfigError(f"{path}: not readable (permission denied)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a table of options")
    return data


def env_name(key: str) -> str:
    return "FEDPOOL_" + key.upper()


def file_options(model: type[BaseSettings]) -> set[str]:
    """The keys a config file may set for a command: its options, less those read from the environment only."""
    return {key for key, field in option_fields(model).items() if marker(field, EnvOnly) is None}


@dataclass(frozen=True)
class Applied:
    """The config file and the environment, checked against every command: what each command's settings are
    built from, under its flags."""

    file: Path | None
    config: Mapping[str, Any]
    environ: Mapping[str, str]


@dataclass(frozen=True)
class Layers:
    """One command's values by where they come from, the most important first: each becomes one of
    pydantic-settings' sources, which merges them over the defaults."""

    flags: dict[str, Any]
    env: dict[str, str]
    table: dict[str, Any]  # the config file's values for this command
    where: dict[str, str]  # key -> how the file spells it, for messages ("eval run.concurrency")
    file: Path | None

    @classmethod
    def of(cls, model: type[Options], command: str, flags: dict[str, Any], applied: Applied) -> Layers:
        # Read from the mapping given rather than by pydantic-settings' EnvSettingsSource, which reads
        # os.environ itself: main() passes the environment in, and the variable behind each value is known.
        env = {key: applied.environ[env_name(key)] for key in option_fields(model)
               if env_name(key) in applied.environ}
        # The file's top-level keys, then the table of each enclosing command (`eval`, then `eval run`), the more
        # specific winning. (pydantic-settings' TOML and YAML sources read a whole file as one model's values;
        # fedpool's file holds every command's.)
        table: dict[str, Any] = {}
        where: dict[str, str] = {}
        settable = file_options(model)
        words = command.split()
        for name in (" ".join(words[:depth]) for depth in range(len(words) + 1)):  # "", "eval", "eval run"
            layer = applied.config.get(name) if name else applied.config
            for raw_key, value in (layer.items() if isinstance(layer, dict) else ()):
                key = raw_key.replace("-", "_")
                if key in settable and not isinstance(value, dict):
                    table[key] = value
                    where[key] = f"{applied.file}: {name + '.' if name else ''}{raw_key}"
        return cls(flags, env, table, where, applied.file)

    def settings(self, model: type[Options]) -> Options:
        """flags > environment > config file > defaults, each value checked. (`_build_sources` is BaseSettings'
        own argument for sources made beforehand; mypy sees only the fields' __init__.)"""
        sources = tuple(InitSettingsSource(model, layer) for layer in (self.flags, self.env, self.table))
        return model(_build_sources=(sources, self.flags))  # type: ignore[call-arg]

    def origin(self, key: str) -> str:
        if key in self.flags:
            return "flag"
        if key in self.env:
            return f"env {env_name(key)}"
        return f"config file {self.file}" if key in self.table else "default"

    def culprit(self, key: str, field: FieldInfo) -> str:
        if key in self.flags:
            return flag_names(key, field)[-1]
        if key in self.env:
            return f"environment {env_name(key)}"
        return self.where.get(key, f"the default of {flag_names(key, field)[-1]}")  # (a default no longer valid)


def load_settings(model: type[Options], command: str, flags: dict[str, Any],
                  applied: Applied) -> tuple[Options, Layers]:
    """`command`'s settings: flags > environment > config file > defaults, each value checked."""
    layers = Layers.of(model, command, flags, applied)
    try:
        return layers.settings(model), layers
    except ValidationError as exc:
        raise ConfigError("; ".join(_problems(model, layers, exc, with_missing=True))) from None


def _problems(model: type[Options], layers: Layers, exc: ValidationError, *, with_missing: bool) -> list[str]:
    fields = {key_of(name, field): field for name, field in model.model_fields.items()}
    problems, missing = [], []
    for error in exc.errors():
        key = str(error["loc"][0])
        if error["type"] == "missing":
            missing.append(flag_names(key, fields[key])[-1])
        else:
            given = "" if error["type"] in OUR_MESSAGES else f", got {error['input']!r}"
            problems.append(f"{layers.culprit(key, fields[key])}: {error['msg']}{given}")
    if missing and with_missing:
        problems.append(f"the following arguments are required: {', '.join(missing)}")
    return problems


class Commands(Protocol):
    @property
    def options(self) -> Mapping[str, type[Options]]: ...  # "eval run" -> its options model


def apply_defaults(commands: Commands, config: Mapping[str, Any], config_path: Path | None,
                   environ: Mapping[str, str]) -> Applied:
    """Check the config file and the environment against every command: an unknown key or table, a wrong type
    or a value outside an option's choices is refused with the file (or variable) and the key named. What it
    returns makes them the defaults of each command's flags."""
    for key, value in config.items():
        if not isinstance(value, dict):
            _check_key(f"{config_path}: {key}", key, commands.options.values())
            continue
        under = [m for name, m in commands.options.items() if f"{name} ".startswith(f"{key} ")]
        if not under:
            raise ConfigError(f"{config_path}: [{key}] is not a fedpool command")
        for inner, inner_value in value.items():
            if not isinstance(inner_value, dict):
                _check_key(f"{config_path}: [{key}] {inner}", inner, under)
    applied = Applied(config_path, config, environ)
    for name, model in commands.options.items():
        layers = Layers.of(model, name, {}, applied)
        try:
            layers.settings(model)
        except ValidationError as exc:  # options that must be given are not missing: the flags may give them
            problems = _problems(model, layers, exc, with_missing=False)
            if problems:
                raise ConfigError(problems[0]) from None
    return applied


def _check_key(where: str, key: str, models: Iterable[type[Options]]) -> None:
    if not any(key.replace("-", "_") in file_options(model) for model in models):
        raise ConfigError(f"{where}: no such option")


def mask(dest: str, value: Any) -> Any:
    """Secrets are shown as *** (a token file's path is not a secret; its content is never read here), and so
    are the values of KEY=VALUE items whose KEY names a secret (`--env HF_TOKEN=...`)."""
    if isinstance(value, SecretStr) or (isinstance(value, str) and value and any(w in dest for w in SECRET_WORDS)
                                        and "file" not in dest and "path" not in dest):
        return "***"
    if isinstance(value, list):
        return [_mask_item(v) for v in value]
    return value


def _mask_item(item: Any) -> Any:
    if isinstance(item, str) and "=" in item:
        key, _, _value = item.partition("=")
        if SECRET_NAME.search(key):
            return f"{key}=***"
    return item


def show(settings: Options, command: str, layers: Layers) -> dict[str, Any]:
    """Every option of the chosen command with its value and where it came from (`--show-config`)."""
    words = command.split()
    out: dict[str, Any] = {"command": {"value": words[0], "from": "command"}}
    if len(words) > 1:
        out[f"{words[0]}_command"] = {"value": words[1], "from": "command"}
    for name, field in type(settings).model_fields.items():
        key, value = key_of(name, field), getattr(settings, name)
        out[key] = {"value": mask(key, str(value) if isinstance(value, Path) else value), "from": layers.origin(key)}
    return {"config_file": str(layers.file) if layers.file else None, "options": dict(sorted(out.items()))}
