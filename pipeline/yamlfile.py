"""Reading YAML configuration with errors that name the file, the line and the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError


def read_yaml(path: Path, error: type[Exception], missing: str = "no such file") -> Any:
    """The parsed file; `error(message)` for a missing file or bad YAML, with `file:line` where known."""
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{path}: {missing}") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, not a file") from None
    except PermissionError:
        raise error(f"{path}: not readable (permission denied)") from None
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte {exc.start} cannot be decoded)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise error(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None


def field_problems(exc: ValidationError) -> str:
    """`field 'a.b': message; ...` for every error pydantic found."""
    return "; ".join(
        f"field '{'.'.join(str(p) for p in err['loc']) or '(root)'}': {err['msg']}" for err in exc.errors()
    )
