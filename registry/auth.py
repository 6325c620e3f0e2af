"""The registry token: generated or given at start, kept only as a hash, compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from fedpool.registry.errors import AuthError

TOKEN_FILE = "registry.token"
TOKEN_ENV = "FEDPOOL_REGISTRY_TOKEN"
TOKEN_FILE_ENV = "FEDPOOL_REGISTRY_TOKEN_FILE"
MIN_TOKEN_CHARS = 16


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def check_token(token: str | None, expected_digest: str) -> None:
    """Raise AuthError unless `token` hashes to the expected digest (constant-time comparison)."""
    if not token:
        raise AuthError("this registry call changes the pool and needs the registry token: pass --token-file-path "
                        "with the file STATE_DIR/registry.token of the registry (its --state-dir), or set "
                        "FEDPOOL_REGISTRY_TOKEN (or FEDPOOL_REGISTRY_TOKEN_FILE)")
    if not hmac.compare_digest(token_digest(token), expected_digest):
        raise AuthError("the registry token given is wrong")


def read_saved_token(state_dir: Path) -> str | None:
    path = state_dir / TOKEN_FILE
    return path.read_text(encoding="utf-8").strip() if path.exists() else None


def check_length(token: str, where: str) -> None:
    """A token shorter than MIN_TOKEN_CHARS could be guessed: refused where it is set."""
    if len(token) < MIN_TOKEN_CHARS:
        raise AuthError(f"{where}: a registry token needs at least {MIN_TOKEN_CHARS} characters, this one has "
                        f"{len(token)}")


def ensure_token(state_dir: Path, token: str | None = None) -> str:
    """The token to start a registry with: the given one (saved), the saved one, or a new random one.

    The file is created with mode 0600 so other users of a shared head node cannot read it.
    """
    path = state_dir / TOKEN_FILE
    state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)
    if token is None and path.exists():
        token = path.read_text(encoding="utf-8").strip()
        check_length(token, str(path))
        return token
    if token is not None:
        check_length(token, "the registry token given")
    token = token or secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(token + "\n")
    return token


def resolve_client_token(
    *, token: str | None = None, token_file: str | os.PathLike[str] | None = None,
    state_dir: Path | None = None, environ: dict[str, str] | None = None,
) -> str | None:
    """Where a client finds the token: argument, file argument, env var, env file, the state dir."""
    env = environ if environ is not None else dict(os.environ)
    if token:
        return token
    for candidate in (token_file, env.get(TOKEN_FILE_ENV)):
        if candidate:
            return Path(candidate).read_text(encoding="utf-8").strip()
    if env.get(TOKEN_ENV):
        return env[TOKEN_ENV]
    if state_dir is not None and (state_dir / TOKEN_FILE).exists():
        return (state_dir / TOKEN_FILE).read_text(encoding="utf-8").strip()
    return None


def token_source(*, token_file: str | os.PathLike[str] | None = None, state_dir: Path | None = None,
                 environ: dict[str, str] | None = None) -> str:
    """Where resolve_client_token found the token, in words (for errors): the flag, the variable or the file."""
    env = environ if environ is not None else dict(os.environ)
    if token_file:
        return f"--token-file-path {token_file}"
    if env.get(TOKEN_FILE_ENV):
        return f"{TOKEN_FILE_ENV}={env[TOKEN_FILE_ENV]}"
    if env.get(TOKEN_ENV):
        return TOKEN_ENV
    return f"{state_dir / TOKEN_FILE}" if state_dir is not None else "nowhere"
