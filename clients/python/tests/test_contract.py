"""The HTTP contract shared with the Node library (clients/contract/http.json):
every case, against this middleware, over real HTTP, on a real PostgreSQL.
clients/contract/README.md says how the table is read."""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import httpx
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from conftest import Server, age, database_with_extension, with_pool_lifespan
from pg_idempotency import HookEvent, IdempotencyMiddleware
from pg_idempotency.asgi import PROBLEMS as LIBRARY_PROBLEMS

CONTRACT = Path(os.environ.get("IDEM_CONTRACT")
                or Path(__file__).resolve().parent.parent.parent / "contract" / "http.json")
SPEC: Dict[str, Any] = json.loads(CONTRACT.read_text(encoding="utf-8"))
PROBLEMS: Dict[str, Any] = SPEC["problems"]

# runner-level options, not passed to the middleware as they are
RUNNER_OPTIONS = ("keyHeader", "pool", "hooks")


def snake(name: str) -> str:
    return re.sub(r"[A-Z]", lambda m: "_" + m.group(0).lower(), name)


class Handler:
    """The case's one route, /things (any method), with its run count and the
    gate a held first run waits at."""

    def __init__(self, spec: Dict[str, Any]) -> None:
        self.spec = spec
        self.runs = 0
        self.started = threading.Event()       # a run has begun
        self.release = threading.Event()       # the held first run may answer
        self.finished = threading.Event()      # the held first run returned

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        assert scope["path"] == "/things", scope["path"]
        self.runs += 1
        first = self.runs == 1
        self.started.set()
        try:
            if first and self.spec.get("hold"):
                await asyncio.to_thread(self.release.wait)
            if self.spec.get("throws"):
                raise RuntimeError("the handler throws")
            if "echo" in self.spec:
                attempt = scope["state"]["idempotency"]
                body = json.dumps({f: getattr(attempt, f) for f in self.spec["echo"]}).encode()
                headers = [(b"content-type", b"application/json")]
                status = 200
            else:
                body = payload(self.spec)
                headers = [(k.encode("latin-1"), v.encode("latin-1"))
                           for k, v in self.spec.get("headers", {}).items()]
                status = self.spec.get("status", 200)
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        finally:
            if first:
                self.finished.set()


def payload(spec: Dict[str, Any], run: str = "") -> bytes:
    if "bodyBytes" in spec:
        return b"x" * int(spec["bodyBytes"])
    return str(spec.get("body", "")).replace("{run}", run).encode("utf-8")


def make_app(handler: Handler, pool: AsyncConnectionPool, options: Dict[str, Any],
             heard: List[HookEvent]) -> Any:
    kwargs = {snake(k): v for k, v in options.items() if k not in RUNNER_OPTIONS}
    if "keyHeader" in options:
        name = options["keyHeader"]
        kwargs["key"] = lambda req: req.header(name)
    if "hooks" in options:
        throws = options["hooks"] == "throw"

        def hook(event: HookEvent) -> None:
            heard.append(event)
            if throws:
                raise RuntimeError(f"the on_{event.kind} hook raises")
        for name in ("claim", "replay", "conflict", "mismatch", "expired", "error"):
            kwargs[f"on_{name}"] = hook
    return with_pool_lifespan(IdempotencyMiddleware(handler, pool=pool, **kwargs), pool)


def key_of(spec: Dict[str, Any], run: str) -> Optional[str]:
    """The key a request names in its header, as the hooks see it."""
    value = spec.get("headers", {}).get("idempotency-key")
    if value is None:
        return None
    value = value.replace("{run}", run)
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] == '"' else value


@pytest.fixture(scope="module")
def database_without_extension() -> Iterator[str]:
    with psycopg.connect(autocommit=True) as admin, \
            database_with_extension(admin, "idem_py_noext_", None) as name:
        yield name


def send_request(client: httpx.Client, spec: Dict[str, Any], run: str) -> httpx.Response:
    headers = {k: v.replace("{run}", run) for k, v in spec.get("headers", {}).items()}
    return client.request(spec.get("method", "POST"), spec.get("path", "/things"),
                          headers=headers, content=payload(spec, run))


def claim_waiting(admin: psycopg.Connection) -> bool:
    """The server shows a claim of the runner's pool waiting."""
    row = admin.execute(
        "SELECT EXISTS (SELECT FROM pg_catalog.pg_stat_activity"
        " WHERE application_name = 'idem-contract' AND state = 'active'"
        "   AND wait_event_type IN ('Extension', 'Lock', 'Timeout')"
        "   AND query LIKE '%%idem_claim%%')").fetchone()
    return bool(row and row[0])


def send_waiting(server_url: str, spec: Dict[str, Any], run: str,
                 handler: Handler) -> httpx.Response:
    """A request that may wait: the held handler is released once its claim
    waits on the server, or once it has its answer."""
    result: Dict[str, Any] = {}

    def send() -> None:
        with httpx.Client(base_url=server_url, timeout=60) as own:
            result["response"] = send_request(own, spec, run)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    with psycopg.connect(autocommit=True) as admin:
        while thread.is_alive() and not claim_waiting(admin):
            thread.join(0.005)
    handler.release.set()
    thread.join(60)
    return result["response"]


JSON_TYPES: Dict[str, Any] = {"string": str, "number": (int, float), "boolean": bool,
                              "object": dict, "array": list, "null": type(None)}


def check(response: httpx.Response, expect: Dict[str, Any], handler: Handler, what: str) -> None:
    assert response.status_code == expect["status"], f"{what}: {response.text[:300]}"
    if "problem" in expect:
        slug = expect["problem"]
        assert response.headers["content-type"] == "application/problem+json", what
        problem = response.json()
        assert problem["type"].endswith(slug), what
        assert problem["title"] == PROBLEMS[slug]["title"], what
        assert problem["status"] == PROBLEMS[slug]["status"] == expect["status"], what
        assert problem["detail"], what
    for name, value in expect.get("headers", {}).items():
        assert response.headers.get(name) == value, f"{what}: header {name}"
    for name, pattern in expect.get("headersMatch", {}).items():
        assert re.fullmatch(pattern, response.headers.get(name, "")), f"{what}: header {name}"
    if "body" in expect:
        assert response.text == expect["body"], what
    if "bodyJson" in expect:
        assert response.json() == expect["bodyJson"], what
    if "bodyBytes" in expect:
        assert len(response.content) == expect["bodyBytes"], what
    for member, value in expect.get("bodyMembers", {}).items():
        assert response.json()[member] == value, f"{what}: member {member}"
    for member, kind in expect.get("bodyTypes", {}).items():
        value = response.json()[member]
        assert isinstance(value, JSON_TYPES[kind]) and not (
            kind == "number" and isinstance(value, bool)), f"{what}: {member} is {value!r}"
    if "runs" in expect:
        assert handler.runs == expect["runs"], f"{what}: handler runs"


@pytest.mark.parametrize("case", SPEC["cases"], ids=[c["name"] for c in SPEC["cases"]])
def test_contract(case: Dict[str, Any], request: Any) -> None:
    options = case.get("options", {})
    conninfo = ""
    if options.get("pool") == "without-extension":
        conninfo = f"dbname={request.getfixturevalue('database_without_extension')}"
    handler = Handler(case["handler"])
    heard: List[HookEvent] = []
    # application_name tells the runner's claims from others' (a waiting claim)
    pool = AsyncConnectionPool(conninfo + " application_name=idem-contract",
                               min_size=1, max_size=4, open=False)
    run = uuid.uuid4().hex
    background: List[Any] = []
    with Server(make_app(handler, pool, options, heard)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        try:
            for i, spec in enumerate(case["requests"]):
                what = f"request {i + 1}"
                if spec.get("ageKey"):
                    with psycopg.connect(autocommit=True) as admin:
                        age(admin, str(key_of(spec, run)))
                if spec.get("background"):
                    result: Dict[str, Any] = {}
                    runs_before = handler.runs

                    def send_in_background(spec: Dict[str, Any] = spec,
                                           result: Dict[str, Any] = result) -> None:
                        with httpx.Client(base_url=server.url, timeout=60) as own:
                            result["response"] = send_request(own, spec, run)

                    thread = threading.Thread(target=send_in_background, daemon=True)
                    thread.start()
                    # go on once the handler runs for it (a condition, not a delay)
                    assert handler.started.wait(30) and handler.runs > runs_before, what
                    background.append((thread, result, spec, what))
                    continue
                response = (send_waiting(server.url, spec, run, handler) if spec.get("waits")
                            else send_request(client, spec, run))
                check(response, spec["expect"], handler, what)
                if "hooks" in spec["expect"]:
                    assert [e.kind for e in heard] == spec["expect"]["hooks"], f"{what}: hooks"
                    for e in heard:
                        assert e.key == key_of(spec, run), f"{what}: the on_{e.kind} hook's key"
                        assert e.scope == "", f"{what}: the on_{e.kind} hook's scope"
                        assert e.request is not None, f"{what}: the on_{e.kind} hook's request"
                heard.clear()
        finally:
            handler.release.set()
        for thread, result, spec, what in background:
            thread.join(60)
            check(result["response"], spec["expect"], handler, what + " (background)")
        if case["handler"].get("hold"):
            # a held run whose client already got its answer (504) ends before the server
            assert handler.finished.wait(60)


def test_every_case_ran_from_the_shared_file() -> None:
    """The runner reads the repository's file, not a copy of its own."""
    assert CONTRACT.name == "http.json" and CONTRACT.parent.name == "contract"
    assert len(SPEC["cases"]) >= 25 and set(PROBLEMS) >= {
        "idempotency-misconfigured", "idempotency-handler-timeout"}



def test_the_problem_table_is_the_contract_s() -> None:
    """Every problem this library answers, with its status and title, is the
    shared file's, and no other: a changed title or status fails here."""
    assert LIBRARY_PROBLEMS == PROBLEMS
