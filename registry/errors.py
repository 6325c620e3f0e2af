"""Typed errors of the registry's public API."""

from __future__ import annotations

from collections.abc import Callable


class RegistryError(Exception):
    """Base class of every error the registry raises on purpose."""


class AuthError(RegistryError):
    """A mutation came without the registry token, or with a wrong one."""


class RegistrationError(RegistryError):
    """A registration was refused; `field` or `check` names the culprit."""

    def __init__(self, server_id: str, reason: str, *, field: str | None = None, check: str | None = None):
        self.server_id = server_id
        self.reason = reason
        self.field = field
        self.check = check
        where = f"field '{field}'" if field else f"check '{check}'" if check else "registration"
        super().__init__(f"server {server_id!r}: {where} failed: {reason}")

    def __reduce__(self) -> tuple[Callable[..., RegistrationError], tuple[object, ...]]:
        # keeps the fields across Ray's (de)serialisation of actor errors
        return (_rebuild_registration_error, (self.server_id, self.reason, self.field, self.check))


def _rebuild_registration_error(
    server_id: str, reason: str, field: str | None, check: str | None
) -> RegistrationError:
    return RegistrationError(server_id, reason, field=field, check=check)


class UnknownServerError(RegistryError):
    """The named server id is not registered; `removed`: it was removed on purpose (`fedpool server remove`, or
    drained and idle), so the launcher that runs it stops rather than registering it again."""

    def __init__(self, server_id: str, removed: bool = False):
        self.server_id = server_id
        self.removed = removed
        why = " (it was removed: by `fedpool server remove`, or drained and idle)" if removed else ""
        super().__init__(f"no server with id {server_id!r} is registered{why}")

    def __reduce__(self) -> tuple[type[UnknownServerError], tuple[str, bool]]:
        return (UnknownServerError, (self.server_id, self.removed))
