"""A loopback image server for tests: aiohttp on 127.0.0.1 in its own thread, http or https.

Routes serve a small PNG, redirect (to the image, to a link-local address, in a loop), send
bodies over a cap with and without Content-Length, never answer, answer slowly, or fail with 5xx.
"""

from __future__ import annotations

import asyncio
import ssl
import threading

from aiohttp import web

from bench.images import encode, make_image

PNG = encode(make_image(32, 32), "PNG")
SLOW_S = 1.0
"""How long /slow.png waits before it answers."""


class LoopbackServer:
    """An aiohttp app on 127.0.0.1, on a free port, served from a thread and loop of its own;
    a subclass adds its routes (`_routes`)."""

    def __init__(self, name: str, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls
        """Serve https with this server context; None: plain http."""
        self.loop = asyncio.new_event_loop()
        self.port = 0
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True,
                                       name=name)
        self.thread.start()
        started.wait(10)

    def url(self, path: str) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}{path}"

    def _routes(self, app: web.Application) -> None:
        raise NotImplementedError

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        self._routes(app)
        self.runner = web.AppRunner(app, shutdown_timeout=0.5)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=self.tls)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        started.set()
        self.loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _stop(self) -> None:
        await self.runner.cleanup()
        # handlers still asleep (/never-answers) would be destroyed pending with the loop
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)


class ImageServer(LoopbackServer):
    """Image routes that misbehave on purpose."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.hits: dict[str, int] = {}
        self.events: list[str] = []
        """'start /slow.png?x' and 'end /slow.png?x' as slow answers begin and end."""
        super().__init__("image-server", tls)

    def _routes(self, app: web.Application) -> None:
        app.router.add_get("/{name}", self._handle)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        self.hits[name] = self.hits.get(name, 0) + 1
        if name == "image.png":
            return web.Response(body=PNG, content_type="image/png")
        if name == "to-metadata":
            raise web.HTTPFound("http://169.254.169.254/latest/meta-data")
        if name == "to-image":
            raise web.HTTPFound("/image.png")
        if name == "loop":
            raise web.HTTPFound("/loop")
        if name == "huge-chunked":  # no Content-Length: the cap must hold while streaming
            response = web.StreamResponse()
            response.enable_chunked_encoding()
            await response.prepare(request)
            for _ in range(64):
                await response.write(b"\0" * 16384)
            return response
        if name == "huge-declared":
            return web.Response(body=b"\0" * 2_000_000)
        if name == "slow.png":
            self.events.append(f"start {request.path_qs}")
            await asyncio.sleep(SLOW_S)
            self.events.append(f"end {request.path_qs}")
            return web.Response(body=PNG, content_type="image/png")
        if name == "never-answers":
            await asyncio.sleep(3600)
        if name == "flaky" and self.hits[name] < 3:
            raise web.HTTPServiceUnavailable()
        if name == "flaky":
            return web.Response(body=PNG)
        raise web.HTTPNotFound()
