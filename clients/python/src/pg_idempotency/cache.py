"""An in-process LRU cache of finished results, so that a replay can be
answered without a database round trip."""

from __future__ import annotations

import datetime as _dt
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

__all__ = ["ResultCache", "CachedResult"]


@dataclass(frozen=True)
class CachedResult:
    fingerprint: str              # canonical text of the request fingerprint
    status: str                   # succeeded | failed
    response_code: Optional[int]
    response_body: Any
    expires_at: _dt.datetime
    #: PostgreSQL's text of the stored JSON body, sent as it is (None: no JSON body)
    body_text: Optional[str] = None


class ResultCache:
    """At most ``max`` finished results keyed by ``(scope, key)``.

    An entry is served only for the same fingerprint and only until the key's
    ``expires_at``; a different fingerprint goes to the database, which answers
    ``mismatch``. Expiry uses this process's clock against the server's
    ``expires_at``: keep clocks in sync (NTP) as for any TTL.
    """

    def __init__(self, max: int, *,
                 now: Callable[[], _dt.datetime] = lambda: _dt.datetime.now(_dt.timezone.utc)
                 ) -> None:
        if max < 1:
            raise ValueError("cache max must be at least 1")
        self.max = max
        self._now = now
        self._entries: OrderedDict[Tuple[str, str], CachedResult] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0

    def get(self, scope: str, key: str, fingerprint: str) -> Optional[CachedResult]:
        with self._lock:
            entry = self._entries.get((scope, key))
            if entry is None:
                return None
            if entry.expires_at <= self._now():
                del self._entries[(scope, key)]
                return None
            if entry.fingerprint != fingerprint:
                return None
            self._entries.move_to_end((scope, key))
            self.hits += 1
            return entry

    def put(self, scope: str, key: str, entry: CachedResult) -> None:
        with self._lock:
            self._entries[(scope, key)] = entry
            self._entries.move_to_end((scope, key))
            while len(self._entries) > self.max:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
