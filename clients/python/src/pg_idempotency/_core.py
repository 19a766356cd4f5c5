"""What the job API and the ASGI middleware share: the SQL, durations, the
stored-result envelope and the errors.

Every call is one schema-qualified statement with named arguments, run with
``prepare=False``: no session state and no named prepared statement spans two
calls, so claim, heartbeat and finish may run on different server connections
behind PgBouncer in transaction pooling mode.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as _dt
import json
import re
import time
import weakref
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Dict, Mapping, Optional, Tuple, TypeVar, Union

import psycopg
import psycopg_pool
from psycopg.rows import tuple_row

__all__ = [
    "Duration",
    "IdempotencyError",
    "InProgressError",
    "MismatchError",
    "ExpiredError",
    "StoredFailureError",
    "KeyLostError",
    "MisconfiguredError",
]

#: This package's version, named in the errors that ask for a newer extension.
PACKAGE_VERSION = "0.6.0"

#: The oldest extension version this package runs on: its claim, finish,
#: extend, release and lookup calls name only the arguments of 1.0 (the
#: claim reads phase and phase_data through to_jsonb, NULL before 1.4).
#: ``checkpoint()`` and ``session_bound=True`` need 1.4 and say so, the
#: ``remember`` option 1.7, ``keep_request`` and completers 1.8.
MIN_EXTENSION = (1, 0)
CHECKPOINT_EXTENSION = (1, 4)
REMEMBER_EXTENSION = (1, 7)
COMPLETER_EXTENSION = (1, 8)

#: A duration: seconds (int or float) or a ``datetime.timedelta``.
Duration = Union[int, float, _dt.timedelta]

MAX_KEY_LENGTH = 255

# SQLSTATEs of a token call meaning "this attempt no longer owns the key": the
# token is dead (taken over or reset), another token finished the key, or the
# key is gone (released by whoever took it over, or past its retention).
LOST_SQLSTATES = frozenset({"55006", "55000", "P0002"})

# The claim's last two columns, phase and phase_data (the checkpoint a
# takeover resumes from), are read through to_jsonb so that the same
# statement also runs on extension versions before 1.4, which have neither
# (both read as NULL there); only a takeover can carry them, so no other
# outcome pays for the conversion.
#
# session_bound and keep_request are named only when they are true, for the
# same reason, and remember only when the caller set it (REMEMBER_ARG).
_CLAIM_SQL = """
SELECT c.outcome, c.token, c.attempt, c.status, c.response_code, c.response_body,
       c.retry_after,
       CASE WHEN c.outcome = 'claimed' AND c.attempt > 1
            THEN pg_catalog.to_jsonb(c) ->> 'phase' END,
       CASE WHEN c.outcome = 'claimed' AND c.attempt > 1
            THEN pg_catalog.to_jsonb(c) -> 'phase_data' END
  FROM idempotency.idem_claim(key       => %(key)s,
                              request   => %(request)s,
                              scope     => %(scope)s,
                              lease     => %(lease)s::interval,
                              retention => %(retention)s::interval,
                              wait      => %(wait)s::interval{bound}{remember}{keep}) AS c"""

# The remember argument of idem_claim and idem_finish: named only when the
# caller set the option, so that a client without it keeps working on
# extension versions before 1.7, which lack the argument.
REMEMBER_ARG = ",\n                              remember  => %(remember)s::interval"
_SESSION_BOUND_ARG = ",\n                              session_bound => true"
_KEEP_REQUEST_ARG = ",\n                              keep_request => true"


def _remembering(sql: str) -> Dict[bool, str]:
    """A statement's text by whether it names remember (at ``{remember}``)."""
    return {False: sql.replace("{remember}", ""), True: sql.replace("{remember}", REMEMBER_ARG)}


def _keeping(sql: str, keep_request: bool) -> str:
    """A claim's text naming keep_request (at ``{keep}``) only when it is true."""
    return sql.replace("{keep}", _KEEP_REQUEST_ARG if keep_request else "")


def claim_sql(session_bound: bool, remember: bool, keep_request: bool = False) -> str:
    """The job's claim, naming session_bound, remember and keep_request only
    when used."""
    return _remembering(_keeping(_CLAIM_SQL.replace(
        "{bound}", _SESSION_BOUND_ARG if session_bound else ""), keep_request))[remember]


CHECKPOINT_SQL = """
SELECT idempotency.idem_checkpoint(key   => %(key)s,
                                   token => %(token)s,
                                   phase => %(phase)s,
                                   data  => %(data)s,
                                   scope => %(scope)s)"""

_FINISH_SQL = """
SELECT idempotency.idem_finish(key           => %(key)s,
                               token         => %(token)s,
                               response_code => %(code)s::int,
                               response_body => %(body)s,
                               scope         => %(scope)s,
                               status        => %(status)s,
                               retention     => %(retention)s::interval{remember})"""

#: The job's finish, by whether it names remember.
FINISH_SQL = _remembering(_FINISH_SQL)

EXTEND_SQL = """
SELECT idempotency.idem_extend(key   => %(key)s,
                               token => %(token)s,
                               lease => %(lease)s::interval,
                               scope => %(scope)s)"""

RELEASE_SQL = """
SELECT idempotency.idem_release(key => %(key)s, token => %(token)s, scope => %(scope)s)"""

LOOKUP_SQL = """
SELECT status, response_code, response_body, expires_at
  FROM idempotency.idem_lookup(key => %(key)s, scope => %(scope)s)"""

# The HTTP middleware's claim also reads PostgreSQL's text of the stored JSON
# body (the envelope's "json" member, or a whole body stored without the
# envelope), so that a replay sends the bytes the Node library sends.
_HTTP_CLAIM_SQL = """
SELECT c.outcome, c.token, c.attempt, c.status, c.response_code, c.response_body,
       c.retry_after,
       CASE WHEN pg_catalog.jsonb_typeof(c.response_body -> 'v') = 'number'
                 AND c.response_body -> 'v' = '1'::jsonb
            THEN (c.response_body -> 'json')::text
            ELSE c.response_body::text END AS body_text
  FROM idempotency.idem_claim(key       => %(key)s,
                              request   => %(request)s::jsonb,
                              scope     => %(scope)s,
                              lease     => %(lease)s::interval,
                              retention => %(retention)s::interval,
                              wait      => %(wait)s::interval{remember}{keep}) AS c"""


def http_claim_sql(remember: bool, keep_request: bool) -> str:
    """The middleware's claim, naming remember and keep_request only when used."""
    return _remembering(_keeping(_HTTP_CLAIM_SQL, keep_request))[remember]

# The envelope goes as text that PostgreSQL parses: a JSON body is stored as
# the handler wrote it, and the first answer is PostgreSQL's text of it, the
# same bytes every replay sends. When that text is not the handler's own
# (``raw``), the handler's ETag named other bytes and is not stored.
_HTTP_FINISH_SQL = """
SELECT f.expires_at, (e.body -> 'json')::text AS json_text
  FROM (SELECT CASE WHEN %(raw)s::text IS NOT NULL
                         AND (%(body)s::jsonb -> 'json')::text IS DISTINCT FROM %(raw)s::text
                    THEN %(body)s::jsonb #- '{headers,etag}'
                    ELSE %(body)s::jsonb END AS body) AS e,
       idempotency.idem_finish(key           => %(key)s,
                               token         => %(token)s,
                               response_code => %(code)s::int,
                               response_body => e.body,
                               scope         => %(scope)s,
                               status        => %(status)s,
                               retention     => %(retention)s::interval{remember})
       AS f(expires_at)"""

#: The middleware's finish, by whether it names remember.
HTTP_FINISH_SQL = _remembering(_HTTP_FINISH_SQL)


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


def remember_option(value: Optional[Duration]) -> Optional[_dt.timedelta]:
    """The ``remember`` option as the interval sent, None when not set (the
    server's ``idempotency.remember`` applies); 0 turns it off for the key."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, _dt.timedelta)):
        raise TypeError(f"remember must be seconds or a timedelta, not {type(value).__name__}")
    if to_seconds(value) < 0:
        raise ValueError(f"remember must be 0 or more seconds, got {value!r}")
    return to_timedelta(value)


def require_remember(info: "ServerInfo", remember: Optional[_dt.timedelta]) -> None:
    """``remember`` needs extension 1.7; without it nothing does."""
    if remember is not None:
        require_version(info, REMEMBER_EXTENSION, " (remember)")


def keep_request_option(value: Any) -> bool:
    """The ``keep_request`` option: a bool (None: False)."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TypeError(f"keep_request must be a bool, not {type(value).__name__}")
    return value


def require_keep_request(info: "ServerInfo", keep_request: bool) -> None:
    """``keep_request`` needs extension 1.8; without it nothing does."""
    if keep_request:
        require_version(info, COMPLETER_EXTENSION, " (keep_request)")


def is_lost(err: BaseException) -> bool:
    return isinstance(err, psycopg.Error) and err.sqlstate in LOST_SQLSTATES


# SQLSTATEs worth another try of the same statement: a key busy with another
# call, a serialization failure, a deadlock.
TRANSIENT_SQLSTATES = frozenset({"55P03", "40001", "40P01"})


def is_transient(err: BaseException) -> bool:
    """A busy key, or a lost connection (an OperationalError without a
    SQLSTATE, the pool's timeout included): the same statement may succeed."""
    if not isinstance(err, psycopg.Error):
        return False
    if err.sqlstate is None:
        return isinstance(err, psycopg.OperationalError)
    return err.sqlstate in TRANSIENT_SQLSTATES


# SQLSTATEs (and classes) of a store that is briefly unavailable: a lost or
# refused connection, a shutdown or recovery, too many connections, a busy
# key, a serialization failure or deadlock, a read-only server after a
# failover, a cancelled statement. Anything else while claiming is a
# misconfiguration: repeating the request does not fix it.
UNAVAILABLE_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "53300", "55P03", "40001",
                                   "40P01", "25006", "57014"})

# What libpq says when a login is refused (the server answers before any
# SQLSTATE reaches psycopg 3.1): the cause, and what to do about it.
_LOGIN_REFUSALS = (
    ("does not exist", "{msg}: check the database name and role in the pool's conninfo"),
    ("password authentication failed", "{msg}: check the pool's credentials"),
    ("no pg_hba.conf entry", "{msg}: allow this client in pg_hba.conf"),
    ("is not permitted to log in", "{msg}: grant LOGIN to the pool's role"),
    ("permission denied for database", "{msg}: GRANT CONNECT on the database to the pool's role"),
)


def misconfiguration(err: BaseException, database: Optional[str] = None,
                     action: str = "claim") -> Optional[str]:
    """The detail (cause and fix) when ``err`` means the setup is wrong, None
    when it is (or may be) a passing unavailability."""
    where = f" in database \"{database}\"" if database else ""
    if isinstance(err, psycopg_pool.PoolClosed):
        return (f"The connection pool is not open ({err}): open it at startup "
                "(await pool.open(), or AsyncConnectionPool(..., open=True)).")
    if not isinstance(err, psycopg.Error):
        return None
    state = err.sqlstate
    if state is None:
        if not isinstance(err, psycopg.OperationalError) or isinstance(
                err, psycopg_pool.PoolTimeout):
            return None
        msg = str(err).strip()
        for needle, fix in _LOGIN_REFUSALS:
            if needle in msg:
                return fix.format(msg=msg.splitlines()[0].rstrip(".")) + "."
        return None
    if state.startswith("08") or state in UNAVAILABLE_SQLSTATES:
        return None
    if state in ("42883", "3F000"):
        return (f"The idempotency extension is not installed{where}: run CREATE EXTENSION "
                "idempotency.")
    if state == "42501":
        return (f"Permission denied{where} ({err.diag.message_primary or err}): grant the "
                "role USAGE on schema idempotency (and EXECUTE on its functions).")
    if state.startswith("28"):
        return f"The server refused the login ({err}): check the pool's credentials."
    if state == "3D000":
        return f"The database does not exist ({err}): check the pool's conninfo."
    return f"The idempotency {action} failed{where} with SQLSTATE {state}: {err}"


@dataclass(frozen=True)
class ServerInfo:
    """What a pool's database says once, at first use."""
    database: str
    extversion: Tuple[int, ...]
    max_response_size: int


DEFAULT_MAX_RESPONSE_SIZE = 1024 * 1024

SERVER_INFO_SQL = """
SELECT pg_catalog.current_database(),
       (SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'idempotency'),
       (SELECT setting FROM pg_catalog.pg_settings
         WHERE name = 'idempotency.max_response_size'),
       (SELECT unit FROM pg_catalog.pg_settings
         WHERE name = 'idempotency.max_response_size')"""

_UNITS = {"": 1, "B": 1, "kB": 1024, "MB": 1024 ** 2, "GB": 1024 ** 3, "TB": 1024 ** 4}


def _bytes_setting(setting: Optional[str], unit: Optional[str]) -> int:
    """idempotency.max_response_size in bytes: a number in the setting's unit
    (the library loaded), or a placeholder's raw text such as "2MB" (not yet
    loaded in this session); the default when absent or unreadable."""
    if setting is None:
        return DEFAULT_MAX_RESPONSE_SIZE
    m = re.fullmatch(r"\s*(\d+)\s*([kMGT]?B)?\s*", setting)
    if m is None:
        return DEFAULT_MAX_RESPONSE_SIZE
    factor = _UNITS.get(m.group(2) or (unit or ""), None)
    if factor is None:       # a unit such as "8kB"
        um = re.fullmatch(r"(\d+)([kMGT]?B)", unit or "")
        factor = int(um.group(1)) * _UNITS[um.group(2)] if um else 1
    return int(m.group(1)) * factor


def _version_tuple(text: str) -> Tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)) or (0,)


def _version_text(version: Tuple[int, ...]) -> str:
    return ".".join(str(p) for p in version)


def server_info(row: Tuple[Any, ...], need: Tuple[int, ...] = MIN_EXTENSION) -> ServerInfo:
    """The ServerInfo of SERVER_INFO_SQL's row; MisconfiguredError when the
    extension is absent or older than ``need``."""
    database, extversion, setting, unit = row
    if extversion is None:
        raise MisconfiguredError(
            f"The idempotency extension is not installed in database \"{database}\": run "
            "CREATE EXTENSION idempotency.")
    info = ServerInfo(database, _version_tuple(extversion), _bytes_setting(setting, unit))
    require_version(info, need)
    return info


def require_version(info: ServerInfo, need: Tuple[int, ...], what: str = "") -> None:
    if info.extversion < need:
        raise MisconfiguredError(
            f"pg-idempotency {PACKAGE_VERSION}{what} needs the idempotency extension "
            f"{_version_text(need)} or later; database \"{info.database}\" has "
            f"{_version_text(info.extversion)}: run ALTER EXTENSION idempotency UPDATE.")


# One check per pool (or connection), for the pool's life.
_server_infos: "weakref.WeakKeyDictionary[Any, ServerInfo]" = weakref.WeakKeyDictionary()


def known_server_info(db: Any) -> Optional[ServerInfo]:
    return _server_infos.get(db)


def remember_server_info(db: Any, info: ServerInfo) -> None:
    _server_infos[db] = info


def too_large_envelope(headers: Mapping[str, str]) -> str:
    """The envelope of a response stored without its body: its status and
    outcome stay (a retry must not run the side effect again), its headers
    minus those that describe the missing body."""
    kept = {k: v for k, v in headers.items()
            if k not in ("content-type", "content-encoding", "content-language")}
    return json.dumps({"v": 1, "headers": kept, "omitted": "too-large"},
                      separators=(",", ":"))


RETRIES = 4
T = TypeVar("T")


def _retry_failed(err: psycopg.Error, attempt: int) -> bool:
    """True: give up and raise ``err``, marked ``idem_retried`` after a retry
    (a release then takes "absent" as its own earlier success whose reply was
    lost)."""
    if attempt >= RETRIES or not is_transient(err):
        if attempt > 0:
            setattr(err, "idem_retried", True)
        return True
    return False


def call_with_retry(fn: Callable[[], T]) -> T:
    """Run a token statement (finish, extend, release) again after a transient
    failure. Repeating them is safe: a finish repeated with its own token
    returns the same expiry."""
    attempt = 0
    while True:
        try:
            return fn()
        except psycopg.Error as e:
            if _retry_failed(e, attempt):
                raise
        time.sleep(0.05 * 2 ** attempt)
        attempt += 1


async def acall_with_retry(fn: Callable[[], Awaitable[T]]) -> T:
    """``call_with_retry`` for coroutines."""
    attempt = 0
    while True:
        try:
            return await fn()
        except psycopg.Error as e:
            if _retry_failed(e, attempt):
                raise
        await asyncio.sleep(0.05 * 2 ** attempt)
        attempt += 1


def released_before(err: BaseException) -> bool:
    """A release that answers "absent" after a retry: its first try released
    the key and the reply was lost."""
    return (isinstance(err, psycopg.Error) and err.sqlstate == "P0002"
            and getattr(err, "idem_retried", False))


@dataclass(frozen=True)
class ClaimRow:
    outcome: str                      # claimed | replay | in_progress | mismatch | expired
    token: Optional[int]
    attempt: Optional[int]
    status: Optional[str]             # succeeded | failed (replay, expired)
    response_code: Optional[int]
    response_body: Any
    retry_after: Optional[int]
    phase: Optional[str] = None       # a takeover's checkpoint to resume from
    phase_data: Any = None


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


class ExpiredError(IdempotencyError):
    """The key was used and its result has expired, but the server remembers
    it (the ``remember`` option, or the server's ``idempotency.remember``): the
    work ran and is not run again.

    ``status``: the key's outcome, "succeeded" or "failed"; ``response_code``:
    the stored HTTP status, None for a job's key.
    """

    def __init__(self, *, key: str, scope: str, status: str,
                 response_code: Optional[int]) -> None:
        super().__init__(f"key {key!r} was already used (it {status}); its stored result has "
                         "expired, and the work is not run again", key=key, scope=scope)
        self.status = status
        self.response_code = response_code


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


class MisconfiguredError(Exception):
    """The database cannot serve idempotency keys until someone changes it (the
    extension is missing or too old, a permission or a login is refused, the
    pool is not open): retrying the same call does not help. The message names
    the cause and the fix."""

    def __init__(self, message: str, *, cause: Optional[BaseException] = None) -> None:
        super().__init__(message)
        self.cause = cause


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
    v = body.get("v") if isinstance(body, dict) else None
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == 1


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


def http_envelope(headers: Mapping[str, str], body: bytes,
                  content_type: Optional[str]) -> Tuple[str, Optional[str]]:
    """(envelope text, JSON body text or None) of an HTTP response as stored:
    ``json`` holds the body's own text when the content type is JSON and the
    body is JSON that jsonb can hold, else ``base64`` (binary safe). The text
    is spliced in as it is, so that PostgreSQL parses the handler's bytes
    (no float rounding, no re-serialisation here)."""
    head = '{"v":1,"headers":' + json.dumps(dict(headers), separators=(",", ":"))
    if not body:
        return head + "}", None
    if content_type is not None and is_json_media_type(content_type):
        text = json_body_text(body)
        if text is not None:
            return head + ',"json":' + text + "}", text
    return head + ',"base64":"' + base64.b64encode(body).decode("ascii") + '"}', None


def is_json_media_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        "/" in media and media.endswith("+json"))


# jsonb refuses \u0000 and unpaired surrogate escapes; a body that holds
# such an escape (or anything that looks like one) is kept as bytes, as the
# Node library does.
_UNSTORABLE_ESCAPE = re.compile(r"\\u(0000|d[89a-f][0-9a-f]{2})", re.IGNORECASE)


def _reject_constant(name: str) -> Any:
    raise ValueError(name)


def json_body_text(body: bytes) -> Optional[str]:
    """The body as text when it is JSON that jsonb can hold, else None."""
    try:
        text = body.decode("utf-8")
        if _UNSTORABLE_ESCAPE.search(text):
            return None
        json.loads(text, parse_constant=_reject_constant)
        return text
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None


def render_json(value: Any) -> bytes:
    """JSON text of a value this process holds (a body stored without PostgreSQL's
    text at hand), in the layout PostgreSQL gives jsonb text."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8")


def envelope_body(body: Any, body_text: Optional[str] = None) -> tuple[Dict[str, str], bytes]:
    """(headers, body bytes) of a stored HTTP result. ``body_text``: PostgreSQL's
    text of the ``json`` member (of the whole body, for a body stored without
    the envelope), sent as it is."""
    if not is_envelope(body):
        # a result stored by plain SQL without the envelope: its JSON as the body
        if body is None:
            return {}, b""
        return {"content-type": "application/json"}, (
            body_text.encode("utf-8") if body_text is not None else render_json(body))
    headers = {str(k).lower(): str(v) for k, v in (body.get("headers") or {}).items()}
    if "json" in body:
        return headers, (body_text.encode("utf-8") if body_text is not None
                         else render_json(body["json"]))
    if "base64" in body:
        return headers, base64.b64decode(body["base64"])
    if "error" in body:
        headers.setdefault("content-type", "application/json")
        return headers, render_json({"error": body["error"]})
    return headers, b""


async def afetch_one(conn: "psycopg.AsyncConnection[Any]", sql: str,
                     params: Mapping[str, Any]) -> Optional[Tuple[Any, ...]]:
    """Run one statement, unprepared (no server-side state a pooler could
    hand to another client), and return its first row, if any."""
    cur = conn.cursor(row_factory=tuple_row)
    try:
        await cur.execute(sql, params, prepare=False)
        return await cur.fetchone()
    finally:
        await cur.close()
