"""The OpenAI-compatible HTTP API over a Scheduler (FastAPI; imported only by the server commands).

Endpoints: POST /v1/completions and /v1/chat/completions (with `stream: true`: server-sent events in
OpenAI's chunk format, then `data: [DONE]`; `stream_options.include_usage` adds a usage chunk),
GET /v1/models, GET /health, GET /metrics (Prometheus text) and, with admin on, POST
/admin/spec-policy (switch the speculation policy of the running server) and POST /admin/forget (the
drafter forgets what it learned from earlier requests, before the next one joins: suffix's index).
With an API key every path but /health needs `Authorization: Bearer KEY` (compared in constant time).

Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 bad JSON or a request
this server cannot serve (unknown model, prompt + max_tokens over the context, n > 1, logprobs),
422 a field of the wrong type or out of range (max_tokens < 1, temperature < 0, top_p outside
(0, 1]), 413 a body over the size limit, 401 a bad key, 429 a full queue, 503 shutting down or a lost
device (code "device_lost": a sticky CUDA error; /health then answers 503 with the reason), 500 a
request that failed while generating (the server goes on serving the others). Usage carries the
request's speculation counters: usage.speculation = {steps, drafted, accepted, acceptance_rate,
mean_accepted_length}.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.types import ASGIApp, Receive, Scope, Send

from specdec.config import SamplingParams
from specdec.errors import UserError
from specdec.server.scheduler import DeviceLost, Event, GenerationRequest, QueueFull, Scheduler, ShuttingDown

OPEN_PATHS = ("/health",)
MAX_STOPS = 4  # as OpenAI's API
MAX_STOP_CHARS = 256
DISCONNECT_POLL_S = 0.25
TEXT_MARK = "\x00specdec-text\x00"  # stands for a chunk's text while the chunk's template is rendered


@dataclass(frozen=True)
class AppSettings:
    model_name: str
    device: str = "cpu"
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256  # when a request gives none (capped by the context left)
    admin: bool = False
    drain_s: float = 0.0  # at shutdown, after uvicorn's own wait: seconds left for in-flight requests


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = {401: "authentication_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}
    body = {"error": {"message": message, "type": kind.get(status, "invalid_request_error"), "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


# ---- request bodies -----------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown OpenAI fields (user, presence_penalty, ...) are ignored

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # an extension, as in vLLM: 0 = off
    min_p: float | None = Field(None, ge=0, lt=1)  # an extension, as in vLLM: 0 = off
    speculate: bool = True  # an extension: false opts this request out of speculation (usage still counts)
    return_token_ids: bool = False  # an extension, as in vLLM: the choice carries the output's `token_ids`
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)  # any 64-bit value; taken modulo 2**63
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    logprobs: bool | int | None = None

    @field_validator("stop")
    @classmethod
    def bounded_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        """At most MAX_STOPS stop strings of at most MAX_STOP_CHARS characters (each is searched for in
        every row's new text at every step)."""
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        if any(len(x) > MAX_STOP_CHARS for x in stops):
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
        return stop


class CompletionBody(SamplingFields):
    prompt: str | list[str] | list[int]


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None


class ChatBody(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class PolicyBody(BaseModel):
    policy: str
    threshold: int | None = None


# ---- the app ------------------------------------------------------------------------------------


def create_app(scheduler: Scheduler, settings: AppSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.outbox = Outbox(asyncio.get_running_loop())
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop, settings.drain_s)

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    started = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, e: RequestValidationError) -> JSONResponse:
        return validation_response(e.errors())

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        ids = completion_prompt_ids(scheduler, body.prompt)
        return await generate(scheduler, settings, request, body, ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        messages = [{"role": m.role, "content": message_text(m)} for m in body.messages]
        try:
            ids = scheduler.codec.encode_chat(messages)
        except Exception as e:  # a chat template refusing the roles or their order
            raise ApiError(400, f"the chat template rejected the messages: {e}", "messages") from e
        return await generate(scheduler, settings, request, body, ids, body.max_completion_tokens or body.max_tokens,
                              chat=True)

    @app.get("/v1/models")
    async def models():
        card = {"id": settings.model_name, "object": "model", "created": started, "owned_by": "specdec",
                "max_model_len": scheduler.config.context}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        state = await answer(scheduler.health())
        body = {"status": state["status"], "model": settings.model_name, "device": settings.device,
                **{k: v for k, v in state.items() if k != "status"}}
        return JSONResponse(body, status_code=200 if state["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        text = await answer(scheduler.metrics_text(settings.model_name))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    if settings.admin:
        @app.post("/admin/spec-policy")
        async def switch_policy(body: PolicyBody):
            try:
                return await answer(scheduler.switch_policy(body.policy, body.threshold))
            except UserError as e:
                raise ApiError(400, str(e), "policy") from e

        @app.post("/admin/forget")
        async def forget():
            return await answer(scheduler.forget_requests())

    return app


async def answer(value):
    """A scheduler call's value: a Scheduler in this process answers at once; one in another process
    (frontend.RemoteScheduler) answers with a future, settled (or raising the call's error) by its reply."""
    return await value if isinstance(value, asyncio.Future) else value


def validation_response(errors: list[dict]) -> JSONResponse:
    """400 for a body that is not JSON, 422 naming each field that is wrong."""
    for err in errors:
        if err.get("type") == "json_invalid":
            reason = (err.get("ctx") or {}).get("error", "")
            return error_response(400, f"the body is not valid JSON: {reason}".rstrip(": "), code="invalid_json")
    parts = []
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
    first = errors[0].get("loc", ()) if errors else ()
    param = ".".join(str(x) for x in first if x != "body") or None
    return error_response(422, "; ".join(parts), param, "invalid_value")


def message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    if any(part.type != "text" for part in message.content):
        raise ApiError(400, "only text content parts are supported", "messages")
    return "".join(part.text or "" for part in message.content)


def completion_prompt_ids(scheduler: Scheduler, prompt: str | list[str] | list[int]) -> list[int]:
    if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
        vocab = scheduler.vocab_size
        if not all(0 <= x < vocab for x in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(prompt)
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(400, f"one prompt per request, got {len(prompt)}", "prompt")
        prompt = prompt[0]
    if not prompt.strip():
        raise ApiError(400, "the prompt is empty", "prompt")
    return scheduler.codec.encode_text(prompt)


def sampling_params(body: SamplingFields) -> SamplingParams:
    return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                          top_k=body.top_k or 0, top_p=1.0 if body.top_p is None else body.top_p,
                          min_p=body.min_p or 0.0, seed=body.seed)


def check_request(body: SamplingFields, settings: AppSettings, context: int, prompt_len: int,
                  max_tokens: int | None) -> int:
    """The request's max_tokens, after the checks only the server can make (400 on failure)."""
    if body.model is not None and body.model != settings.model_name:
        raise ApiError(400, f"model {body.model!r} is not served here; this server serves {settings.model_name!r}",
                       "model", "model_not_found")
    if body.n != 1:
        raise ApiError(400, "n must be 1 (one choice per request)", "n")
    if body.logprobs:
        raise ApiError(400, "logprobs are not supported", "logprobs")
    if prompt_len == 0:
        raise ApiError(400, "the prompt is empty", "prompt")
    if prompt_len >= context:
        raise ApiError(400, f"the prompt has {prompt_len} tokens; the context is {context}", "prompt",
                       "context_length_exceeded")
    if max_tokens is None:
        return min(settings.default_max_tokens, context - prompt_len)
    if prompt_len + max_tokens > context:
        raise ApiError(400, f"max_tokens {max_tokens} + the prompt's {prompt_len} tokens exceed the context of "
                       f"{context} tokens", "max_tokens", "context_length_exceeded")
    return max_tokens


async def generate(scheduler: Scheduler, settings: AppSettings, request: Request, body: SamplingFields,
                   ids: list[int], max_tokens: int | None, chat: bool):
    max_tokens = check_request(body, settings, scheduler.config.context, len(ids), max_tokens)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    sampling = sampling_params(body)  # fields already range-checked by the body model
    events, outbox = asyncio.Queue(), request.app.state.outbox
    job = GenerationRequest(ids, max_tokens, sampling, stop, emit=partial(outbox.put, events), wake=outbox.wake,
                            speculate=body.speculate)
    try:
        await answer(scheduler.submit(job))
    except QueueFull as e:
        raise ApiError(429, str(e), code="queue_full") from e
    except ShuttingDown as e:
        raise ApiError(503, str(e), code="device_lost" if isinstance(e, DeviceLost) else "shutting_down") from e
    reply = Reply(chat, settings.model_name)
    if body.stream and body.return_token_ids:
        scheduler.cancel(job)
        raise ApiError(400, "return_token_ids is supported without stream", "return_token_ids")
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return EventStream(stream_events(events, reply, include_usage), on_close=lambda: scheduler.cancel(job))
    try:
        texts, token_ids, last = [], [], None
        while last is None or not last.final:
            waiting = await next_events(events, request)
            if waiting is None:  # the client went away
                return error_response(499, "client closed the request")
            texts += [event.text for event in waiting]
            token_ids += [t for event in waiting for t in event.token_ids]
            last = waiting[-1]
    finally:
        scheduler.cancel(job)  # a no-op once the request is done
    if last.error is not None:
        return error_response(500, last.error, code="generation_failed")
    return reply.complete("".join(texts), last, token_ids if body.return_token_ids else None)


class Outbox:
    """Events from the decode thread to this event loop's requests: the decode thread puts a step's events
    for every request, then wakes the loop once (a wake-up while one is pending is dropped); the loop then
    hands them to their requests' queues."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[tuple[asyncio.Queue, Event]] = []
        self.woken = False  # a flush is scheduled on the loop

    def put(self, events: asyncio.Queue, event: Event) -> None:
        """Decode thread: queue one request's event."""
        with self.lock:
            self.pending.append((events, event))

    def wake(self) -> None:
        """Decode thread: have the loop flush what was put, unless a flush is already scheduled."""
        with self.lock:
            if self.woken or not self.pending:
                return
            self.woken = True
        self.loop.call_soon_threadsafe(self.flush)

    def flush(self) -> None:
        """Event loop: hand every pending event to its request."""
        with self.lock:
            pending, self.pending, self.woken = self.pending, [], False
        for events, event in pending:
            events.put_nowait(event)


async def take_waiting(events: asyncio.Queue) -> list[Event]:
    """The next event and every event queued behind it: one wake-up of the reader for all of them."""
    taken = [await events.get()]
    while not events.empty():
        taken.append(events.get_nowait())
    return taken


async def next_events(events: asyncio.Queue, request: Request) -> list[Event] | None:
    """The events waiting (at least one), or None once the client has disconnected."""
    while True:
        try:
            return await asyncio.wait_for(take_waiting(events), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            if await request.is_disconnected():
                return None


@dataclass
class Reply:
    """OpenAI response bodies of one request (text completion or chat)."""

    chat: bool
    model: str

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.templates = {first: chunk_template(self, first) for first in (True, False)}

    def envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def complete(self, text: str, last: Event, token_ids: list[int] | None = None) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": last.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids  # the output's tokens (an EOS that ended it included)
        return {**self.envelope([choice], chunk=False), "usage": last.usage}

    def chunk(self, text: str | None, finish_reason: str | None, first: bool) -> dict:
        if self.chat:
            delta = {} if text is None else ({"role": "assistant", "content": text} if first else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self.envelope([choice], chunk=True)

    def text_event(self, text: str, first: bool) -> str:
        """sse(self.chunk(text, None, first)) from the template rendered once per request: a token's event
        encodes only its text."""
        template = self.templates[first]
        return template.head + json.dumps(text) + template.tail


@dataclass(frozen=True)
class ChunkTemplate:
    """A text chunk's server-sent event: head + json.dumps(text) + tail."""

    head: str
    tail: str


def chunk_template(reply: Reply, first: bool) -> ChunkTemplate:
    """The text chunk rendered once with a marker for its text. The text is the chunk's last string (only
    logprobs and finish_reason, both null, follow it), so the marker's last occurrence is the text's place."""
    head, _, tail = sse(reply.chunk(TEXT_MARK, None, first)).rpartition(json.dumps(TEXT_MARK))
    return ChunkTemplate(head, tail)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def stream_events(events: asyncio.Queue, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    """The request's server-sent events; the events waiting when the stream wakes go out in one write."""
    first, done = True, False
    while not done:
        parts = []
        for event in await take_waiting(events):
            if event.error is not None:
                parts.append(sse({"error": {"message": event.error, "type": "server_error", "param": None,
                                            "code": "generation_failed"}}))
                done = True
                break
            if event.text or (first and reply.chat):
                parts.append(reply.text_event(event.text, first))
                first = False
            if event.final:
                parts.append(sse(reply.chunk(None, event.finish_reason, first)))
                if include_usage:
                    parts.append(sse({**reply.envelope([], chunk=True), "usage": event.usage}))
                done = True
                break
        if done:
            parts.append(sse("[DONE]"))
        if parts:
            yield "".join(parts)


class EventStream(StreamingResponse):
    """Server-sent events that call on_close however the response ends (done, client gone, error)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class Guard:
    """ASGI middleware: the API key (Bearer, constant-time comparison) and the body size limit (413),
    checked before the app reads anything. The body is read here and replayed to the app."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        guarded = self.expected is not None and scope["path"] not in OPEN_PATHS
        if guarded and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            return await error_response(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                        code="invalid_api_key")(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_big = error_response(413, f"the body exceeds {self.max_body_bytes} bytes", code="body_too_large")
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return await too_big(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                return await too_big(scope, receive, send)
        body = b"".join(chunks)

        async def replay() -> dict:
            nonlocal body
            if body is not None:
                message, body = {"type": "http.request", "body": body, "more_body": False}, None
                return message
            return await receive()

        await self.app(scope, replay, send)
