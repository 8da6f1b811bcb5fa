"""Requests OpenAI's API refuses, refused with HTTP 400 and one line naming the problem, where
vLLM 0.32 serves them: unknown fields (vLLM ignores them, logging at debug level: a misspelt
`temprature` silently samples at the default) and a chat with no messages (vLLM's request
model has no check for one). Opt-in, through vLLM's own middleware flag:

    vllm serve ... --middleware vllm_onlinespec.serving.compat.strict_requests.StrictRequests

Checked on POST /v1/chat/completions and /v1/completions against the fields (and aliases) of
vLLM's request models; everything else passes through untouched. The body is read once and
replayed to vLLM, and later receive() calls reach the client's connection, so a client that
disconnects mid-stream still aborts its request.
"""

from __future__ import annotations

import functools
import json
from typing import Any


@functools.cache
def _fields(path: str) -> frozenset[str]:
    if path == "/v1/chat/completions":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as M
    else:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as M
    names = set()
    for name, f in M.model_fields.items():
        names.add(name)
        if getattr(f, "alias", None):
            names.add(f.alias)
    return frozenset(names)


_PATHS = ("/v1/chat/completions", "/v1/completions")


def _object(body: bytes) -> dict | None:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def unknown_fields(path: str, body: bytes) -> list[str]:
    """The top-level keys of a JSON object body that `path`'s request model does not have
    ([] for a body that is not a JSON object: vLLM's own validation answers that one)."""
    data = _object(body)
    return [] if data is None else sorted(set(data) - _fields(path))


def problem(path: str, body: bytes) -> tuple[str, str] | None:
    """(the parameter, one line) of what OpenAI's API would refuse in this body, or None."""
    unknown = unknown_fields(path, body)
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        return unknown[0], f"Unrecognized request argument(s) supplied: {names}"
    data = _object(body)
    if path == "/v1/chat/completions" and data is not None and data.get("messages") == []:
        return "messages", "messages: must hold at least one message (got [])"
    return None


def error_body(param: str, message: str) -> bytes:
    """OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": param,
                                 "code": 400}}).encode()


class StrictRequests:
    """A pure ASGI middleware (vLLM's `--middleware` adds a class with app.add_middleware)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or \
                scope.get("path") not in _PATHS:
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left before sending its body
                return
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        found = problem(scope["path"], body)
        if found is not None:
            out = error_body(*found)
            await send({"type": "http.response.start", "status": 400, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(out)).encode())]})
            await send({"type": "http.response.body", "body": out})
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # a disconnect, while vLLM streams the answer

        await self.app(scope, replay, send)
