"""Two small ASGI middlewares: API-key auth and a request-body size limit, both answering in OpenAI's error shape.

Pure ASGI (not BaseHTTPMiddleware), so they never wrap `receive` in a way that hides a client's disconnect from a
streaming response.
"""
from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from brrr.server.protocol import APIError

OPEN_PATHS = ("/health", "/metrics")  # scraped by infrastructure; everything else needs the key


class APIKeyAuth:
    def __init__(self, app, api_key: str):
        self.app, self.api_key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        header = Headers(scope=scope).get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
            error = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'" if header
                             else "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
            response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


def _too_large(limit: int) -> JSONResponse:
    error = APIError(413, f"request body is larger than this server's limit of {limit} bytes", code="request_too_large")
    return JSONResponse(error.body(), status_code=413, headers={"Connection": "close"})


class BodySizeLimit:
    """413 when Content-Length says the body is over the limit (before reading it), or when a chunked body grows
    past it: then the app is handed a truncated body and whatever it answers is replaced by the 413."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit():
            if int(length) > self.max_bytes:
                return await _too_large(self.max_bytes)(scope, receive, send)
            # HTTP/1.1 framing stops the body at Content-Length: nothing to guard, and a stream's every SSE event
            # skips one wrapper (the server's per-token cost is what bounds HTTP throughput on a fast GPU)
            return await self.app(scope, receive, send)
        received, over, replaced, responding = 0, False, False, False

        async def limited_receive():
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request" and not over:
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def guarded_send(message):
            nonlocal replaced, responding
            if message["type"] == "http.response.start" and over and not responding:
                replaced = True
                return await _too_large(self.max_bytes)(scope, receive, send)
            if replaced:  # the app's own answer to the truncated body is dropped
                return
            responding = True
            await send(message)

        await self.app(scope, limited_receive, guarded_send)
