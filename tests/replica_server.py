"""A loopback stand-in for a vLLM replica's scale-out API, for the vllm-remote backend's failures.

aiohttp on 127.0.0.1 in its own thread (image_server.py's `LoopbackServer`). `GET /health`
answers 200 (the replica looks up), `GET /metrics` one vLLM gauge, and `POST
/inference/v1/generate` as `mode` says: 'ok' streams one token (ID) per chunk up to the
request's max_tokens, as vLLM's tokens output mode does; '5xx' and '4xx' answer an error body as
vLLM's; '413' as a body limit in front of vLLM does; 'cut' sends one token, then drops the
connection; 'error chunk' sends an error in the stream, as vLLM does for a failure after its
headers; 'stalled' answers nothing, /health neither, as a stopped replica (the connection is
accepted). The real vLLM's answers are tests/test_vllm.py's and
tests/test_vllm_remote_failures.py's.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from image_server import LoopbackServer

ID = 7
"""The token every 'ok' chunk carries."""
MESSAGE = "the stand-in replica refuses this"
STALLED_S = 3600.0
"""How long a 'stalled' stand-in takes to answer: longer than any test."""


class StandInReplica(LoopbackServer):
    """The stand-in (see the module docstring); `generated` counts the generate requests."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.generated = 0
        super().__init__("replica-server")

    @property
    def base_url(self) -> str:
        return self.url("")

    def _routes(self, app: web.Application) -> None:
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/inference/v1/generate", self._generate)

    async def _health(self, request: web.Request) -> web.Response:
        if self.mode == "stalled":
            await asyncio.sleep(STALLED_S)
        return web.Response()

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            text="# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.generated += 1
        if self.mode == "stalled":
            await asyncio.sleep(STALLED_S)
        if self.mode in ("5xx", "4xx", "413"):
            status = {"5xx": 500, "4xx": 400, "413": 413}[self.mode]
            return web.json_response({"error": {"message": MESSAGE, "code": status}},
                                     status=status)
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        tokens = body["sampling_params"]["max_tokens"]
        for index in range(tokens):
            last = index == tokens - 1
            await reply.write(_chunk({"choices": [{"index": 0, "token_ids": [ID],
                                                   "finish_reason": "length" if last else None}]}))
            if self.mode == "cut":
                assert request.transport is not None
                request.transport.close()
                return reply
            if self.mode == "error chunk":
                await reply.write(_chunk({"error": {"message": MESSAGE}}))
                break
        await reply.write(b"data: [DONE]\n\n")
        return reply


def _chunk(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()
