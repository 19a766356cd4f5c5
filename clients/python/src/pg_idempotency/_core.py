"""What the job API and the ASGI middleware share: the SQL, durations, the
stored-result envelope and the errors.

Every call is one schema-qualified statement with named arguments, run with
``prepare=False``: no session state and no named prepared statement spans two
calls, so claim, heartbeat and finish may run on different server connections
behind PgBouncer in transaction pooling mode.
"""

from __future__ import annotations

import base64
import datetime as _dt
import json
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Union

import psycopg

__all__ = [
    "Duration",
    "IdempotencyError",
    "InProgressError",
    "MismatchError",
    "StoredFailureError",
    "KeyLostError",
]

#: A duration: seconds (int or float) or a ``datetime.timedelta``.
Duration = Union[int, float, _dt.timedelta]

MAX_KEY_LENGTH = 255

# SQLSTATEs of a token call meaning "this attempt no longer owns the key": the
# token is dead (taken over or reset), another token finished the key, or the
# key is gone (released by whoever took it over, or past its retention).
LOST_SQLSTATES = frozenset({"55006", "55000", "P0002"})

CLAIM_SQL = """
SELECT outcome, token, attempt, status, response_code, response_body, retry_after
  FROM idempotency.idem_claim(key       => %(key)s,
                              request   => %(request)s,
                              scope     => %(scope)s,
                              lease     => %(lease)s::interval,
                              retention => %(retention)s::interval,
                              wait      => %(wait)s::interval)"""

FINISH_SQL = """
SELECT idempotency.idem_finish(key           => %(key)s,
                               token         => %(token)s,
                               response_code => %(code)s::int,
                               response_body => %(body)s,
                               scope         => %(scope)s,
                               status        => %(status)s,
                               retention     => %(retention)s::interval)"""

EXTEND_SQL = """
SELECT idempotency.idem_extend(key   => %(key)s,
                               token => %(token)s,
                               lease => %(lease)s::interval,
                               scope => %(scope)s)"""

RELEASE_SQL = """
SELECT idempotency.idem_release(key => %(key)s, token => %(token)s, scope => %(scope)s)"""

LOOKUP_SQL = """
SELECT expires_at FROM idempotency.idem_lookup(key => %(key)s, scope => %(scope)s)"""


def to_timedelta(value: Optional[Duration]) -> Optional[_dt.timedelta]:
    if value is None:
        return None
    if isinstance(value, _dt.timedelta):
        return value
    return _dt.timedelta(seconds=value)


def to_seconds(value: Duration) -> float:
    if isinstance(value, _dt.timedelta):
        return value.total_seconds()
    return float(value)


def is_lost(err: BaseException) -> bool:
    return isinstance(err, psycopg.Error) and err.sqlstate in LOST_SQLSTATES


@dataclass(frozen=True)
class ClaimRow:
    outcome: str                      # claimed | replay | in_progress | mismatch
    token: Optional[int]
    attempt: Optional[int]
    status: Optional[str]             # succeeded | failed (replay)
    response_code: Optional[int]
    response_body: Any
    retry_after: Optional[int]


# ---- errors -----------------------------------------------------------------


class IdempotencyError(Exception):
    """Base class of the errors this library raises."""

    def __init__(self, message: str, *, key: str, scope: str) -> None:
        super().__init__(message)
        self.key = key
        self.scope = scope


class InProgressError(IdempotencyError):
    """Another attempt holds a live claim on the key; try again after ``retry_after`` seconds."""

    def __init__(self, *, key: str, scope: str, retry_after: int) -> None:
        super().__init__(
            f"key {key!r} is in progress elsewhere; retry after {retry_after} s",
            key=key, scope=scope)
        self.retry_after = retry_after


class MismatchError(IdempotencyError):
    """The key was already used with a different request payload."""

    def __init__(self, *, key: str, scope: str) -> None:
        super().__init__(f"key {key!r} was used with a different request", key=key, scope=scope)


class StoredFailureError(IdempotencyError):
    """The key's earlier attempt failed for good and stored that failure.

    ``name`` and ``message`` are the stored error's (``error`` envelope);
    ``body`` is the stored ``response_body`` as it is.
    """

    def __init__(self, *, key: str, scope: str, name: str, message: str,
                 body: Any, response_code: Optional[int]) -> None:
        super().__init__(f"key {key!r} failed earlier: {name}: {message}", key=key, scope=scope)
        self.name = name
        self.error_message = message
        self.body = body
        self.response_code = response_code


class KeyLostError(IdempotencyError):
    """This attempt no longer owns the key (its lease ran out and another
    attempt took it over, or the key was settled or released by someone else):
    its result was not stored, and never will be."""

    def __init__(self, *, key: str, scope: str, sqlstate: Optional[str] = None) -> None:
        why = f" (SQLSTATE {sqlstate})" if sqlstate else ""
        super().__init__(f"lost the claim on key {key!r}{why}; the result was not stored",
                         key=key, scope=scope)
        self.sqlstate = sqlstate


# ---- the stored result envelope ------------------------------------------------


def value_envelope(value: Any) -> Dict[str, Any]:
    """A job's return value, as both libraries store it."""
    return {"v": 1, "json": value}


def error_envelope(error: BaseException) -> Dict[str, Any]:
    return {"v": 1, "error": {"name": type(error).__name__, "message": str(error)}}


def is_envelope(body: Any) -> bool:
    return isinstance(body, dict) and body.get("v") == 1


def envelope_value(body: Any) -> Any:
    """The value a job replay hands back: ``json``, the raw bytes of ``base64``,
    None for a body-less envelope, and a body that is no envelope (written by
    plain SQL) as it is."""
    if not is_envelope(body):
        return body
    if "json" in body:
        return body["json"]
    if "base64" in body:
        return base64.b64decode(body["base64"])
    return None


def envelope_error(body: Any) -> tuple[str, str]:
    """(name, message) of a stored failure, whatever shape it was stored in."""
    if is_envelope(body) and isinstance(body.get("error"), dict):
        err = body["error"]
        return str(err.get("name", "Error")), str(err.get("message", ""))
    if isinstance(body, dict) and "error" in body and not isinstance(body["error"], dict):
        return "Error", str(body["error"])
    return "Error", json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def headers_envelope(headers: Mapping[str, str], body: bytes,
                     content_type: Optional[str]) -> Dict[str, Any]:
    """An HTTP response as stored: ``json`` when the content type is JSON and the
    body parses as JSON that jsonb can hold, else ``base64`` (binary safe)."""
    env: Dict[str, Any] = {"v": 1, "headers": dict(headers)}
    if not body:
        return env
    if content_type is not None and is_json_media_type(content_type):
        parsed = _parse_json(body)
        if parsed is not _NOT_JSON:
            env["json"] = parsed
            return env
    env["base64"] = base64.b64encode(body).decode("ascii")
    return env


def is_json_media_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        "/" in media and media.endswith("+json"))


_NOT_JSON = object()


def _reject_constant(name: str) -> Any:
    raise ValueError(name)


def _parse_json(body: bytes) -> Any:
    try:
        text = body.decode("utf-8")
        # jsonb cannot hold U+0000 in a string: such a body is stored as bytes
        if "\\u0000" in text:
            return _NOT_JSON
        return json.loads(text, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError):
        return _NOT_JSON


def render_json(value: Any) -> bytes:
    """JSON text of a stored ``json`` body, as every response sends it: the text
    form PostgreSQL gives the jsonb value (``{"a": 1, "b": [1, 2]}``, keys in
    jsonb's order, UTF-8), which is also what the Node library sends, so that
    a first answer and every replay are the same bytes whichever library
    wrote the result."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8")


def envelope_body(body: Any) -> tuple[Dict[str, str], bytes]:
    """(headers, body bytes) of a stored HTTP result."""
    if not is_envelope(body):
        # a result stored by plain SQL without the envelope: its JSON as the body
        if body is None:
            return {}, b""
        return {"content-type": "application/json"}, render_json(body)
    headers = {str(k).lower(): str(v) for k, v in (body.get("headers") or {}).items()}
    if "json" in body:
        return headers, render_json(body["json"])
    if "base64" in body:
        return headers, base64.b64decode(body["base64"])
    if "error" in body:
        headers.setdefault("content-type", "application/json")
        return headers, render_json({"error": body["error"]})
    return headers, b""
