"""The FastAPI app the HTTP tests serve with uvicorn, and gates that let a test
hold a handler where it wants it."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import threading
from typing import Any, AsyncIterator, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from psycopg_pool import AsyncConnectionPool

from pg_idempotency import IdempotencyMiddleware

BINARY = bytes(range(256)) * 3 + b"\x00\xff\r\n"


class Gate:
    """entered: the handler runs; release: the test lets it return."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()


class Probe:
    """An outer ASGI wrapper: done is set when the inner app (the middleware)
    returned for a request, that is after it stored the result."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.done = threading.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            if scope["type"] == "http":
                self.done.set()


def make_app(pool: Optional[AsyncConnectionPool] = None, **options: Any) -> Any:
    """(app, calls, gates): calls counts handler runs per path."""
    pool = pool or AsyncConnectionPool("", min_size=1, max_size=4, open=False)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        await pool.open()
        yield
        await pool.close()

    app = FastAPI()
    app.router.lifespan_context = lifespan
    calls: Dict[str, int] = {}
    gates: Dict[str, Gate] = {}
    app.state.calls = calls
    app.state.gates = gates

    def count(name: str) -> int:
        calls[name] = calls.get(name, 0) + 1
        return calls[name]

    @app.post("/orders")
    async def orders(request: Request) -> Response:
        n = count("orders")
        body = await request.json()
        return JSONResponse({"order": n, "item": body.get("item"), "note": "caf\u00e9"},
                            status_code=201, headers={"Location": f"/orders/{n}",
                                                      "X-Not-Stored": "1"})

    @app.post("/binary")
    async def binary(request: Request) -> Response:
        count("binary")
        raw = await request.body()
        return Response(BINARY + raw, media_type="application/octet-stream")

    @app.post("/text")
    async def text() -> Response:
        count("text")
        return PlainTextResponse("plain words")

    @app.post("/json-bad")
    async def json_bad() -> Response:
        count("json-bad")
        return Response(b"{not json", media_type="application/json")

    @app.post("/echo-json")
    async def echo_json(request: Request) -> Response:
        count("echo-json")
        return Response(await request.body(), media_type="application/json",
                        headers={"ETag": '"v1"'})

    @app.post("/huge-number")
    async def huge_number() -> Response:
        count("huge-number")
        # JSON that Python's parser reads (as a float inf) and jsonb refuses
        return Response(b'{"n": 1e1000000}', status_code=201, media_type="application/json")

    @app.post("/gzip")
    async def gzipped() -> Response:
        count("gzip")
        return Response(gzip.compress(b'{"packed": true}'), media_type="application/json",
                        headers={"Content-Encoding": "gzip"})

    @app.post("/empty")
    async def empty() -> Response:
        count("empty")
        return Response(status_code=204)

    @app.post("/status/{code}")
    async def status(code: int) -> Response:
        count(f"status/{code}")
        return JSONResponse({"status": code}, status_code=code)

    @app.post("/boom")
    async def boom() -> Response:
        count("boom")
        raise RuntimeError("handler failed")

    @app.post("/slow/{name}")
    async def slow(name: str) -> Response:
        count(f"slow/{name}")
        gate = gates[name]
        gate.entered.set()
        await asyncio.to_thread(gate.release.wait)
        return JSONResponse({"slow": name}, status_code=201)

    @app.patch("/things/{n}")
    async def patch(n: int) -> Response:
        count("patch")
        return JSONResponse({"patched": n})

    @app.get("/things/{n}")
    async def get(n: int) -> Response:
        count("get")
        return JSONResponse({"thing": n})

    @app.post("/charges")
    async def charges(request: Request) -> Response:
        count("charges")
        body = await request.json()
        return JSONResponse({"charged": body["amount"]}, status_code=201)

    app.add_middleware(IdempotencyMiddleware, pool=pool, **options)
    return app


def gate(app: Any, name: str) -> Gate:
    g = Gate()
    app.state.gates[name] = g
    return g


def calls(app: Any) -> Dict[str, int]:
    result: Dict[str, int] = app.state.calls
    return result


__all__: List[str] = ["BINARY", "Gate", "Probe", "make_app", "gate", "calls"]
