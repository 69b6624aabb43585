"""The signed token `Lock.serialize` hands to another process and `restore_lock` reads back.

The token is signed with SECRET_KEY (`django.core.signing`), so a holder can pass it through
a task queue or a client without letting anyone forge an acquisition.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from django.core import signing

from .exceptions import InvalidLockToken

TOKEN_SALT = "django_keel_lock.token"


class Token(NamedTuple):
    """What a token says: enough to act as the holder of one acquisition."""

    key: str
    ttl: float
    owner: str
    fence: int
    holder: str
    store: str
    #: When the lock runs out unless extended (seconds since the epoch, the signer's clock);
    #: None in tokens made before tokens carried it.
    expires_at: float | None = None
    #: "shared", or a semaphore's limit; None: exclusive (and tokens made before modes).
    mode: str | int | None = None
    #: A multi-key lock's keys and each one's fence (in that order); None: one key.
    keys: list[str] | None = None
    fences: list[int] | None = None


# Short payload names keep tokens small; they are part of the token format.
_FIELDS: dict[str, tuple[str, type | tuple[type, ...]]] = {
    "k": ("key", str),
    "t": ("ttl", (int, float)),
    "o": ("owner", str),
    "f": ("fence", int),
    "h": ("holder", str),
    "s": ("store", str),
}
_OPTIONAL: dict[str, tuple[str, type | tuple[type, ...]]] = {
    "e": ("expires_at", (int, float)),
    "m": ("mode", (str, int)),
    "K": ("keys", list),
    "F": ("fences", list),
}


def dumps(token: Token) -> str:
    """`token` signed and compressed, as a URL-safe string."""
    payload = {name: getattr(token, field) for name, (field, _) in (_FIELDS | _OPTIONAL).items()}
    if token.keys is None:  # one key: the token as it was before multi-key locks
        del payload["K"], payload["F"]
    return signing.dumps(payload, salt=TOKEN_SALT, compress=True)


def loads(text: object) -> Token:
    """The `Token` `text` carries; InvalidLockToken for garbage, tampered or foreign tokens."""
    if not isinstance(text, str):
        raise InvalidLockToken(f"lock token must be a str, got {type(text).__name__}")
    try:
        data = signing.loads(text, salt=TOKEN_SALT)
    except signing.BadSignature as exc:
        raise InvalidLockToken(
            "lock token is not valid: it was altered, truncated, or signed with another SECRET_KEY"
        ) from exc
    except Exception as exc:  # undecodable payload behind a valid signature cannot happen,
        raise InvalidLockToken(f"lock token could not be decoded: {exc}") from exc  # but be sure
    if not isinstance(data, dict) or not _shape_ok(data) or not _keys_ok(data):
        raise InvalidLockToken("lock token is signed but does not describe a lock")
    values: list[Any] = [data.get(name) for name in _FIELDS | _OPTIONAL]
    return Token(*values)


def _shape_ok(data: dict[str, Any]) -> bool:
    return all(isinstance(data.get(name), kind) for name, (_, kind) in _FIELDS.items()) and all(
        data.get(name) is None or isinstance(data[name], kind)
        for name, (_, kind) in _OPTIONAL.items()
    )


def _keys_ok(data: dict[str, Any]) -> bool:
    """A multi-key token's keys are strings, each with an int fence; neither, or both."""
    keys, fences = data.get("K"), data.get("F")
    if keys is None or fences is None:
        return keys is None and fences is None
    return (
        len(keys) == len(fences) > 0
        and all(isinstance(key, str) for key in keys)
        and all(isinstance(fence, int) and not isinstance(fence, bool) for fence in fences)
    )
