"""The HTTP + WebSocket server: serves the shipped web app (web/dist) and `/ws` on one port, in a
thread of its own so the model never waits on the network. Per-run token, origin check, size and
rate limits; each client has a bounded outbox that drops stale step frames instead of blocking."""
from __future__ import annotations

import asyncio
import collections
import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from aiohttp import WSMsgType, web

from megatron.scope.codec import encode_frame
from megatron.scope.protocol import MAX_MESSAGE_BYTES, ProtocolError, parse_message
from megatron.scope.webapp import REBUILD_COMMAND, WEB_DIST

_NOT_BUILT = f"""<!doctype html><meta charset=utf-8><title>MegaScope</title>
<p>The MegaScope web app is missing from {WEB_DIST}: it ships built with the package, so this
installation is incomplete. In a source checkout, <code>{REBUILD_COMMAND}</code> (Node.js 20+ and npm)
builds it again; then reload. The WebSocket at <code>/ws</code> works.</p>"""


@dataclass(kw_only=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    token: str = field(default_factory=lambda: secrets.token_urlsafe(18))
    allowed_origins: tuple[str, ...] = ()
    static_dir: Path = WEB_DIST
    outbox_limit: int = 64  # frames waiting per client before stale step frames are dropped
    rate_per_second: float = 20.0
    rate_burst: float = 40.0
    max_clients: int = 8


@dataclass(slots=True)
class Job:
    client: int
    type: str
    data: dict[str, Any]


class _Client:
    def __init__(self, ident: int, ws: web.WebSocketResponse, limit: int, rate: float, burst: float) -> None:
        self.ident, self.ws, self.limit = ident, ws, limit
        self.outbox: collections.deque[tuple[str, Any, bool]] = collections.deque()
        self.ready = asyncio.Event()
        self.dropped = 0
        self.rate, self.burst, self.tokens, self.stamp = rate, burst, burst, time.monotonic()

    def push(self, kind: str, payload: Any, droppable: bool) -> None:
        if len(self.outbox) >= self.limit:
            # The oldest droppable frame is the stalest view; control frames are never dropped.
            for index, (_, _, can_drop) in enumerate(self.outbox):
                if can_drop:
                    del self.outbox[index]
                    self.dropped += 1
                    break
            else:
                if droppable:
                    self.dropped += 1
                    return
        self.outbox.append((kind, payload, droppable))
        self.ready.set()

    def allow(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class ScopeServer:
    """`on_message(job)` runs on the server thread for every valid-JSON message; `hello()`
    builds the greeting. `send` may be called from any thread."""

    def __init__(self, config: ServerConfig, on_message: Callable[[Job], None],
                 hello: Callable[[], dict[str, Any]]) -> None:
        self.config = config
        self.on_message = on_message
        self.hello = hello
        self.clients: dict[int, _Client] = {}
        self._next_client = 1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.port = config.port

    # --- lifecycle ------------------------------------------------------------------
    def start(self) -> str:
        self._thread = threading.Thread(target=self._run, name="megascope-server", daemon=True)
        self._thread.start()
        self._started.wait(30)
        if self._error is not None:
            raise RuntimeError(f"MegaScope server could not listen on {self.config.host}:{self.config.port}: "
                               f"{self._error}") from self._error
        return self.url

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        return f"http://{host}:{self.port}/?token={self.config.token}"

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to start(); the trainer must not die with us
            self._error = exc
            self._started.set()
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application(client_max_size=MAX_MESSAGE_BYTES)
        app.router.add_get("/ws", self._websocket)
        app.router.add_get("/", self._index)
        app.router.add_get("/{path:.+}", self._static)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.port)
        await site.start()
        self.port = runner.addresses[0][1]
        self._started.set()
        await self._stop.wait()
        for client in list(self.clients.values()):
            await client.ws.close()
        await runner.cleanup()

    # --- outgoing -------------------------------------------------------------------
    def send(self, client: int | None, kind: str, payload: Any, droppable: bool = False) -> None:
        """Queue a message for one client, or all when None: "json" (a dict), "binary" (bytes) or
        "frame" ((header, arrays), encoded here on the server thread)."""
        if self._loop is None or self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(self._push, client, kind, payload, droppable)
        except RuntimeError:  # loop already closed while shutting down
            pass

    def _push(self, client: int | None, kind: str, payload: Any, droppable: bool) -> None:
        targets = self.clients.values() if client is None else [self.clients[client]] if client in self.clients else []
        for target in list(targets):
            target.push(kind, payload, droppable)

    def dropped(self, client: int) -> int:
        target = self.clients.get(client)
        return target.dropped if target else 0

    async def _writer(self, client: _Client) -> None:
        while not client.ws.closed:
            await client.ready.wait()
            client.ready.clear()
            while client.outbox and not client.ws.closed:
                kind, payload, _ = client.outbox.popleft()
                if kind == "binary":
                    await client.ws.send_bytes(payload)
                elif kind == "frame":
                    await client.ws.send_bytes(encode_frame(*payload))
                else:
                    await client.ws.send_str(json.dumps(payload))

    # --- incoming -------------------------------------------------------------------
    def _origin_allowed(self, request: web.Request) -> bool:
        origin = request.headers.get("Origin")
        if origin is None:
            return True  # not a browser: the token alone authenticates it
        allowed = {f"http://{h}:{self.port}" for h in ("127.0.0.1", "localhost", "[::1]", self.config.host)}
        return origin in allowed or origin in self.config.allowed_origins

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        token = request.query.get("token", "")
        if not hmac.compare_digest(token.encode(), self.config.token.encode()):
            return web.Response(status=403, text="missing or wrong token: open the URL the server printed")
        if not self._origin_allowed(request):
            return web.Response(status=403, text="origin not allowed (see --allow-origin)")
        if len(self.clients) >= self.config.max_clients:
            return web.Response(status=503, text="too many clients")
        # aiohttp's own cap sits above ours so an oversized message gets an error frame, not a drop.
        ws = web.WebSocketResponse(max_msg_size=4 * MAX_MESSAGE_BYTES, heartbeat=30)
        await ws.prepare(request)
        ident = self._next_client
        self._next_client += 1
        client = _Client(ident, ws, self.config.outbox_limit, self.config.rate_per_second, self.config.rate_burst)
        self.clients[ident] = client
        writer = asyncio.ensure_future(self._writer(client))
        client.push("json", dict(self.hello(), type="hello", client=ident), False)
        try:
            async for message in ws:
                if message.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                    continue
                if not client.allow():
                    client.push("json", {"type": "error", "code": "rate_limited",
                                         "message": f"more than {self.config.rate_per_second:g} messages/s"}, False)
                    continue
                try:
                    data = parse_message(message.data)
                    self.on_message(Job(ident, data["type"], data))
                except ProtocolError as exc:
                    client.push("json", {"type": "error", "code": exc.code, "message": str(exc)}, False)
        finally:
            self.clients.pop(ident, None)
            client.ready.set()
            writer.cancel()
        return ws

    async def _index(self, request: web.Request) -> web.StreamResponse:
        index = self.config.static_dir / "index.html"
        if not index.is_file():
            return web.Response(text=_NOT_BUILT, content_type="text/html", headers=self._headers())
        return web.FileResponse(index, headers=self._headers())

    async def _static(self, request: web.Request) -> web.StreamResponse:
        root = self.config.static_dir.resolve()
        target = (root / request.match_info["path"]).resolve()
        if root not in target.parents or not target.is_file():  # no path traversal out of dist/
            raise web.HTTPNotFound()
        return web.FileResponse(target, headers=self._headers())

    def _headers(self) -> dict[str, str]:
        return {"Content-Security-Policy": "default-src 'self'; connect-src 'self' ws: wss:; "
                                           "style-src 'self' 'unsafe-inline'; img-src 'self' data:",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
