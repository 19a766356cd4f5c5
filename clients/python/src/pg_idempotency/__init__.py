"""Idempotency keys for Python on the ``idempotency`` PostgreSQL extension.

* ``idempotent(db, key, ...)``: a block that runs at most once per key, for
  jobs and queue consumers (``with`` on a sync connection or pool, ``async
  with`` on an async one); ``idempotent_job(...)``, its decorator form.
* ``IdempotencyMiddleware``: the ``Idempotency-Key`` HTTP header for any ASGI
  app (Starlette, FastAPI).
* ``completer(pool, handler=..., scope=...)``: finishes the keys of a scope
  whose attempt died, from their last recovery point with the request the
  claim kept (``keep_request=True``; extension 1.8).
"""

from ._core import (PACKAGE_VERSION, Duration, ExpiredError, IdempotencyError, InProgressError,
                    KeyLostError, MismatchError, MisconfiguredError, StoredFailureError)
from .asgi import (DEFAULT_STORE_HEADERS, FRAMING_HEADERS, IdempotencyAttempt,
                   IdempotencyMiddleware, IdempotencyRequest, StoreDecision, StorePolicy,
                   default_store_policy)
from .cache import CachedResult, ResultCache
from .completer import AsyncCompleter, Completer, completer
from .header import KeyHeader, parse_idempotency_key
from .hooks import Hook, HookEvent
from .jobs import (AsyncIdempotent, AsyncJob, Idempotent, Job, Retryable, current_job,
                   idempotent, idempotent_job)

__version__ = PACKAGE_VERSION

__all__ = [
    "AsyncCompleter", "AsyncIdempotent", "AsyncJob", "CachedResult", "Completer",
    "DEFAULT_STORE_HEADERS", "Duration", "ExpiredError", "FRAMING_HEADERS", "Hook", "HookEvent",
    "IdempotencyAttempt", "IdempotencyError", "IdempotencyMiddleware", "IdempotencyRequest",
    "Idempotent", "InProgressError", "Job", "KeyHeader", "KeyLostError", "MismatchError",
    "MisconfiguredError", "ResultCache", "Retryable", "StoreDecision", "StorePolicy",
    "StoredFailureError", "completer", "current_job", "default_store_policy", "idempotent",
    "idempotent_job", "parse_idempotency_key",
]
