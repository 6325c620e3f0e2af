"""Configuration for the `fedpool` CLI from flags, a config file and the environment, in that order of
precedence, and `--show-config` to print what a command would run with (secrets masked).

The config file is TOML (`fedpool.toml`) or YAML (`.yaml`/`.yml`), found at `--config PATH`, else
`$FEDPOOL_CONFIG`, else `./fedpool.toml`, else `~/.fedpool/config.toml`. Top-level keys apply to every
command that has that option; a table named after a command (`[gateway]`, `[eval]`, `["eval run"]`,
`[jobs]`, ...) applies to that command and its actions, the more specific table winning. Keys are option
names with dashes or underscores (`api-key-file`, `max_running_jobs`). Environment variables are
`FEDPOOL_` + the option name in capitals with underscores (`FEDPOOL_ADDRESS`, `FEDPOOL_POLICY`).
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedpool.pipeline.artifact import SECRET_NAME

SECRET_WORDS = ("token", "secret", "password", "api_key")
# Environment variables of this form that are not options (tokens are read where they are used).
NOT_OPTIONS = frozenset({"FEDPOOL_CONFIG", "FEDPOOL_REGISTRY_TOKEN", "FEDPOOL_REGISTRY_TOKEN_FILE",
                         "FEDPOOL_JOBS_TOKEN", "FEDPOOL_JOBS_URL", "FEDPOOL_VENV", "FEDPOOL_WHEELHOUSE",
                         "FEDPOOL_BUILD_JOBS", "FEDPOOL_VLLM_PYTHON", "FEDPOOL_VLLM_VENV", "FEDPOOL_VLLM_VERSION"})


class ConfigError(Exception):
    """The config file or an environment variable is wrong; the message names it and the key."""


@dataclass
class Applied:
    """Where each option's value comes from, for --show-config."""

    file: Path | None = None
    sources: dict[str, str] = field(default_factory=dict)  # dest -> "config file" | "env NAME"


def find_config_file(given: Path | None, environ: Mapping[str, str]) -> Path | None:
    if given is not None:
        if not given.is_file():
            raise ConfigError(f"--config {given}: no such file")
        return given
    if environ.get("FEDPOOL_CONFIG"):
        path = Path(environ["FEDPOOL_CONFIG"]).expanduser()
        if not path.is_file():
            raise ConfigError(f"FEDPOOL_CONFIG={path}: no such file")
        return path
    for candidate in (Path("fedpool.toml"), Path("~/.fedpool/config.toml").expanduser()):
        if candidate.is_file():
            return candidate
    return None


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        if path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        else:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        kind = "YAML" if path.suffix in (".yaml", ".yml") else "TOML"
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


def _key(name: str) -> str:
    return name.replace("-", "_")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions
            if a.option_strings and a.dest not in ("help", "config", "show_config")}


def _convert(action: argparse.Action, value: Any, where: str) -> Any:
    if isinstance(action, argparse._StoreTrueAction):
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [_convert_one(action, v, where) for v in items]
    return _convert_one(action, value, where)


def _convert_one(action: argparse.Action, value: Any, where: str) -> Any:
    try:
        converted = action.type(str(value)) if callable(action.type) else value  # type: ignore[misc]
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigError(f"{where}: {converted!r} is not one of {', '.join(map(str, action.choices))}")
    return converted


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[
        tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for name, child in _subparsers(parser).items():
        yield from _walk(child, (*path, name))


def apply_defaults(parser: argparse.ArgumentParser, config: Mapping[str, Any], config_path: Path | None,
                   environ: Mapping[str, str]) -> Applied:
    """Set every (sub)parser's defaults from the config file, then from the environment (which wins over
    the file); flags given on the command line win over both (flags > environment > file > defaults, the
    usual order). Unknown keys are errors, named."""
    applied = Applied(file=config_path)
    known_keys: set[str] = set()
    for path, sub in _walk(parser):
        options = _options(sub)
        known_keys.update(options)
        values: dict[str, Any] = {}
        for dest, action in options.items():
            # the file: top level, then each enclosing command's table, most specific last
            layers = [config] + [config.get(" ".join(path[:i])) for i in range(1, len(path) + 1)]
            for depth, layer in enumerate(layers):
                if not isinstance(layer, dict):
                    continue
                for raw_key, value in layer.items():
                    if isinstance(value, dict) or _key(raw_key) != dest:
                        continue
                    where = f"{config_path}: {' '.join(path[:depth]) + '.' if depth else ''}{raw_key}"
                    values[dest] = _convert(action, value, where)
                    applied.sources[dest] = f"config file {config_path}"
            env_name = "FEDPOOL_" + dest.upper()
            if env_name in environ and env_name not in NOT_OPTIONS:
                values[dest] = _convert(action, environ[env_name], f"environment {env_name}")
                applied.sources[dest] = f"env {env_name}"
        if values:
            sub.set_defaults(**values)
    commands = {" ".join(p) for p, _ in _walk(parser) if p}
    for key, value in config.items():
        if isinstance(value, dict):
            if key not in commands:
                raise ConfigError(f"{config_path}: [{key}] is not a fedpool command")
            for inner in value:
                if not isinstance(value[inner], dict) and _key(inner) not in known_keys:
                    raise ConfigError(f"{config_path}: [{key}] {inner}: no such option")
        elif _key(key) not in known_keys:
            raise ConfigError(f"{config_path}: {key}: no such option")
    return applied


def mask(dest: str, value: Any) -> Any:
    """Secrets are shown as *** (a token file's path is not a secret; its content is never read here), and so
    are the values of KEY=VALUE items whose KEY names a secret (`--env HF_TOKEN=...`)."""
    if isinstance(value, str) and value and any(w in dest for w in SECRET_WORDS) and "file" not in dest \
            and "path" not in dest:
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


def show(args: argparse.Namespace, parser_defaults: Mapping[str, Any], applied: Applied) -> dict[str, Any]:
    """Every option of the chosen command with its value and where it came from."""
    out: dict[str, Any] = {}
    for dest, value in sorted(vars(args).items()):
        if dest in ("func", "show_config", "config") or callable(value):
            continue
        if dest in applied.sources and parser_defaults.get(dest, object()) == value:
            source = applied.sources[dest]
        elif dest in parser_defaults and parser_defaults[dest] == value:
            source = "default"
        else:
            source = "flag" if dest not in ("command",) and not dest.endswith("_command") else "command"
        shown = str(value) if isinstance(value, Path) else value
        out[dest] = {"value": mask(dest, shown), "from": source}
    return {"config_file": str(applied.file) if applied.file else None, "options": out}


def effective_defaults(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, Any]:
    """The defaults (after apply_defaults) of the parsers the command line goes through."""
    defaults: dict[str, Any] = {}
    current = parser
    words = [w for w in argv if not w.startswith("-")]
    while True:
        defaults.update({a.dest: a.default for a in current._actions if a.option_strings})
        defaults.update(current._defaults)
        subs = _subparsers(current)
        nxt = next((w for w in words if w in subs), None)
        if nxt is None:
            return defaults
        words = words[words.index(nxt) + 1:]
        current = subs[nxt]


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """`--config PATH` and `--show-config` on every command (before or after the command's name)."""
    for _, sub in _walk(parser):
        sub.add_argument("--config", type=Path, default=argparse.SUPPRESS,
                         help="config file (TOML or YAML; default $FEDPOOL_CONFIG, ./fedpool.toml, "
                              "~/.fedpool/config.toml)")
        sub.add_argument("--show-config", action="store_true", default=argparse.SUPPRESS,
                         help="print the configuration this command would run with (secrets masked), then exit")


def config_flag(argv: list[str]) -> Path | None:
    """--config's value, read before parsing (the file sets the parsers' defaults)."""
    for i, word in enumerate(argv):
        if word == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1]).expanduser()
        if word.startswith("--config="):
            return Path(word.split("=", 1)[1]).expanduser()
    return None
