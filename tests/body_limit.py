"""A body limit for a real `vllm serve` (its `--middleware body_limit.BodyLimit`, with tests/ on its
PYTHONPATH): vLLM 0.32 sets none of its own (it took a 1.1 GB generate body), so a limit is what
an operator puts in front of it, here Starlette's own (vLLM's HTTP stack), which answers 413
`Content Too Large` (text/plain). LIMIT_ENV holds the limit in bytes; each 413 it answers
appends a line to the file REFUSED_ENV names, so a test can tell what reached the replica.
"""

from __future__ import annotations

import os

from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LIMIT_ENV = "MMLANE_TEST_BODY_LIMIT"
REFUSED_ENV = "MMLANE_TEST_BODY_REFUSED"


class BodyLimit(RequestBodyLimitMiddleware):
    def __init__(self, app: ASGIApp) -> None:
        super().__init__(app, max_body_size=int(os.environ[LIMIT_ENV]))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 413:
                with open(os.environ[REFUSED_ENV], "a") as log:
                    log.write(f"{scope.get('path')}\n")
            await send(message)

        await super().__call__(scope, receive, counted)
