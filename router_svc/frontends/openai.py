"""The router's OpenAI-compatible HTTP front end: a FastAPI app in the router's event loop, over the same
request path as gRPC (``router_svc.request_path``), with no extra hop.

Errors use OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``; a routing error's
``Status`` maps to an HTTP status in one table. A streamed response starts only once the chosen worker
produced its first output, so every failure before that is a proper HTTP status; a failure after it ends
the stream with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import math
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field

import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from google.protobuf import json_format
from opentelemetry import propagate
from opentelemetry.trace import SpanKind
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router_svc import metrics
from router_svc.errors import RoutingError, Status
from router_svc.frontends.openai_responses import ResponseObjects
from router_svc.frontends.openai_tools import HeldReply, ToolUse, renders_tools
from router_svc.frontends.openai_schema import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                 ResponsesRequest, TokenizeRequest, without_unhonoured)
from router_svc.frontends.preparation import Preparation, Submission
from router_svc.request_path import RoutedRequest, Router, WorkerOutput
from tandem.decision import RoutingDecision
from tandem.errors import ContextLengthExceeded, InvalidRequestError
from tandem.protocol import encode_chat, structured_output_message
from tandem.security import BearerTokenAuth, ServerTLS
from tandem.streams import merged
from tandem.telemetry import mark_failed, mark_failed_status, tracer
from tandem.v1 import common_pb2, worker_pb2

logger = logging.getLogger(__name__)
_tracer = tracer("tandem.router")

_HTTP_STATUS = {
    Status.INVALID_ARGUMENT: 400, Status.OUT_OF_RANGE: 400, Status.FAILED_PRECONDITION: 400,
    Status.UNAUTHENTICATED: 401, Status.PERMISSION_DENIED: 403, Status.NOT_FOUND: 404,
    Status.RESOURCE_EXHAUSTED: 429, Status.CANCELLED: 499, Status.UNIMPLEMENTED: 501,
    Status.UNAVAILABLE: 503, Status.DEADLINE_EXCEEDED: 504,
}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable_error",
                504: "timeout_error"}
_FINISH_REASONS = {common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_STOP: "stop",
                   common_pb2.FINISH_REASON_EOS: "stop"}
# Worker and router field names, as the OpenAI API spells them (a sampling setting: its own name).
_OPENAI_FIELDS = {"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt", "prompt_text": "prompt",
                  "chat.messages": "messages", "policy": "tandem.policy", "length_key": "tandem.length_key"}
RETRY_AFTER_S = 1
TIMEOUT_HEADER = "x-request-timeout"


class HttpError(Exception):
    """An error answered with OpenAI's envelope."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @classmethod
    def of(cls, exc: RoutingError | InvalidRequestError, budget_field: str = "max_tokens",
           structured_field: str = "") -> "HttpError":
        """``budget_field``, ``structured_field``: the request's own names for its output budget and its
        structured output."""
        if isinstance(exc, InvalidRequestError):
            param = budget_field if exc.field == "max_new_tokens" else \
                structured_field if structured_field and exc.field.startswith("sampling.structured_output") else \
                _openai_field(exc.field)
            code = "context_length_exceeded" if isinstance(exc, ContextLengthExceeded) else None
            return cls(400, f"{param}: {exc.reason}", param, code)
        status = _HTTP_STATUS.get(exc.status, 500)
        param = None
        if status == 400:  # a worker's validation message starts with the field it names
            field, sep, _ = str(exc).partition(":")
            param = _openai_field(field) if sep and " " not in field else None
        if status == 429:
            return cls(status, str(exc), code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})
        return cls(status, str(exc), param)

    def body(self) -> dict:
        error_type = _ERROR_TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": error_type, "param": self.param, "code": self.code}}

    def response(self, request_id: str | None = None) -> JSONResponse:
        headers = {**self.headers, **({"x-request-id": request_id} if request_id else {})}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


@dataclass(frozen=True)
class ServedModel:
    """The model the router serves over HTTP: its id, and aliases a request may name instead."""

    id: str
    aliases: tuple[str, ...] = ()
    created: int = 0

    @property
    def names(self) -> tuple[str, ...]:
        return (self.id, *self.aliases)


class OpenAIFrontEnd:
    """The routes, bound to one router, tokenizer and served model."""

    def __init__(self, router: Router, tokenizer, model: ServedModel, preparation: Preparation,
                 auth: BearerTokenAuth | None = None):
        self.router = router
        self.tokenizer = tokenizer
        self.model = model
        self.preparation = preparation
        self.auth = auth
        self.renders_tools = renders_tools(tokenizer)  # else tools go in the generic format (openai_tools)
        self._token_text = functools.lru_cache(maxsize=65536)(lambda token_id: tokenizer.decode([token_id]))

    def app(self) -> FastAPI:
        # The router traces each request itself (one SERVER span, parent of `route` and the worker call) and
        # keeps its own metrics; FastAPI's built-in telemetry would add a second server span per request.
        app = FastAPI(title="Tandem router", docs_url=None, redoc_url=None, openapi_url=None,
                      telemetry={"tracing": False, "metrics": False, "logs": False})
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/responses", self.responses, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        app.add_api_route("/tandem/v1/explain", self.explain, methods=["POST"])
        app.add_api_route("/tandem/v1/backends", self.backends, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_exception_handler(HttpError, lambda request, exc: exc.response(request.headers.get("x-request-id")))
        app.add_exception_handler(404, lambda request, exc: HttpError(404, f"no route {request.url.path}").response())
        app.add_exception_handler(405, lambda request, exc: HttpError(
            405, f"{request.method} is not allowed on {request.url.path}").response())
        app.add_middleware(CountRequests, routes=frozenset(route.path for route in app.routes))
        return app

    # --- OpenAI routes -------------------------------------------------------------------------------

    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.model.created, "owned_by": "tandem"}
            for name in self.model.names
        ]})

    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request)
        body = await self._parse(request, ChatCompletionRequest)
        return await _unless_disconnected(request, self._generate(request, body))

    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        body = await self._parse(request, CompletionRequest)
        return await _unless_disconnected(request, self._generate(request, body))

    async def tokenize(self, request: Request) -> JSONResponse:
        """vLLM's /tokenize: the token ids of a prompt or of a chat, as a completion or chat request would send."""
        self._authorize(request)
        body = await self._parse(request, TokenizeRequest)
        if (body.messages is None) == (body.prompt is None):
            raise HttpError(400, "prompt: give either prompt or messages", "prompt")
        if body.messages is not None:
            conversation = [{"role": m.role, "content": m.text} for m in body.messages]
            try:
                tokens = await encode_chat(self.tokenizer, conversation, "messages", body.add_generation_prompt)
            except InvalidRequestError as exc:
                raise HttpError.of(exc) from None
        else:
            tokens = await asyncio.to_thread(
                lambda: list(self.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]))
        limits = self.router.registry.model_limits()
        return JSONResponse({"count": len(tokens), "max_model_len": limits[0] if limits else None, "tokens": tokens,
                             "token_strs": [self._token_text(t) for t in tokens] if body.return_token_strs else None})

    async def detokenize(self, request: Request) -> JSONResponse:
        """vLLM's /detokenize: the text of token ids."""
        self._authorize(request)
        body = await self._parse(request, DetokenizeRequest)
        limits = self.router.registry.model_limits()
        if limits is not None and any(token >= limits[1] for token in body.tokens):
            raise HttpError(400, f"tokens: token ids must lie in [0, {limits[1]})", "tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(body.tokens)})

    # --- Tandem's own routes ------------------------------------------------------------------------

    async def explain(self, request: Request) -> JSONResponse:
        """The decision a chat or completion request would get now, as JSON (a dry run: nothing is generated)."""
        self._authorize(request)
        schema = ChatCompletionRequest if "messages" in await _json_object(request) else CompletionRequest
        body = await self._parse(request, schema)
        prompt = (await self._prompt_ids(body, self._tool_use(body)))[0]  # of a batch of prompts, the first
        routed = await self._routed(body, prompt, self._request_id(request))
        span = self._span(request, "POST /tandem/v1/explain")
        try:
            decision = await self.router.decide(routed, span)
        except RoutingError as exc:
            mark_failed_status(span, exc.status.name, str(exc))
            raise HttpError.of(exc) from None
        finally:
            span.end()
        return JSONResponse(asdict(decision))

    async def backends(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse({"backends": [json_format.MessageToDict(b.message(), preserving_proto_field_name=True)
                                          for b in self.router.registry.listed()],
                             "output_lengths": [asdict(learned) for learned in self.router.output_lengths.learned()]})

    async def health(self, request: Request) -> Response:
        healthy = self.router.registry.healthy()
        if not healthy:
            raise HttpError(503, "no healthy worker: " + ", ".join(
                f"{b.name} ({b.describe()})" for b in self.router.registry.workers.values()))
        return JSONResponse({"status": "ok", "healthy_workers": [b.name for b in healthy]})

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    # --- the request path -----------------------------------------------------------------------------

    def _tool_use(self, body: ChatCompletionRequest | CompletionRequest) -> ToolUse | None:
        """A chat's tools and how the model may use them, built once per request; None for a completion."""
        if not isinstance(body, ChatCompletionRequest):
            return None
        try:
            return body.tool_use(self.renders_tools)
        except InvalidRequestError as exc:
            raise HttpError.of(exc) from None

    async def _prompt_ids(self, body: ChatCompletionRequest | CompletionRequest,
                          tool_use: ToolUse | None) -> list[list[int]]:
        """The token ids of each prompt: the chat's one (its tools as ``tool_use`` has them), or each of the
        completion's."""
        if isinstance(body, ChatCompletionRequest):
            try:
                return [_truncated(body, await encode_chat(self.tokenizer, body.conversation(tool_use), "messages",
                                                           body.add_generation_prompt, body.continue_final_message,
                                                           body.chat_template_kwargs, tool_use.template_tools()))]
            except InvalidRequestError as exc:
                raise HttpError.of(exc) from None
        texts = [prompt for prompt in body.prompts if isinstance(prompt, str)]
        encoded = iter(await asyncio.to_thread(lambda: [list(self.tokenizer(text)["input_ids"]) for text in texts])
                       if texts else [])
        prompts = [list(prompt) if isinstance(prompt, list) else next(encoded) for prompt in body.prompts]
        if not all(prompts):
            raise HttpError(400, "prompt: must not be empty", "prompt")
        return [_truncated(body, prompt) for prompt in prompts]

    async def _parse(self, request: Request, schema):
        body = _validated(schema, await _json_object(request))
        if body.model is not None and body.model not in self.model.names:
            raise HttpError(404, f"the model {body.model!r} does not exist; this server serves "
                                 f"{', '.join(map(repr, self.model.names))}", "model", "model_not_found")
        return body

    def _authorize(self, request: Request) -> None:
        if self.auth is not None and not self.auth.authorized(request.headers.get("authorization")):
            raise HttpError(401, "missing or invalid bearer token (header 'Authorization: Bearer <token>')",
                            code="invalid_api_key")

    def _shown_token(self, body: ChatCompletionRequest | CompletionRequest) -> Callable[[int], str] | None:
        """How the request's log-probabilities show a token: its text, "token_id:N", or None without any."""
        if body.num_logprobs is None:
            return None
        return _token_id_text if body.return_tokens_as_token_ids else self._token_text

    def _request_id(self, request: Request) -> str:
        given = request.headers.get("x-request-id", "")
        return given if 0 < len(given) <= 128 and given.isprintable() else uuid.uuid4().hex

    def _span(self, request: Request, name: str):
        return _tracer.start_span(name, context=propagate.extract(dict(request.headers)), kind=SpanKind.SERVER,
                                  attributes={"http.request.method": request.method, "url.path": request.url.path})

    async def _routed(self, body, prompt: list[int], request_id: str, deadline: float | None = None) -> RoutedRequest:
        try:
            structured = body.structured_output()
        except InvalidRequestError as exc:
            raise HttpError.of(exc) from None
        sampling = common_pb2.SamplingParams(logit_bias=body.logit_bias, allowed_token_ids=body.allowed_token_ids, **{
            name: value for name, value in (
                ("temperature", body.temperature), ("top_p", body.top_p),
                ("top_k", None if body.top_k is None else max(0, body.top_k)), ("min_p", body.min_p),
                ("seed", body.seed), ("presence_penalty", body.presence_penalty),
                ("frequency_penalty", body.frequency_penalty), ("repetition_penalty", body.repetition_penalty),
                ("min_tokens", body.min_tokens), ("logprobs", body.num_logprobs),
                ("prompt_logprobs", body.num_prompt_logprobs)) if value is not None})
        if structured is not None:
            sampling.structured_output.CopyFrom(structured_output_message(*structured[1:]))
        tandem = body.tandem
        try:
            return await self.preparation.prepare(Submission(
                request_id=request_id, prompt_token_ids=prompt, max_new_tokens=body.requested_max_tokens(),
                frontend="http", prompt_field=body.prompt_field,
                policy=tandem.policy if tandem and tandem.policy else "", length_key=tandem.length_key if tandem else "",
                sampling=sampling, stop=tuple(body.stop or ()), stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos, include_stop_string=body.include_stop_str_in_output,
                keep_special_tokens=not body.skip_special_tokens, deadline=deadline, n=body.n,
            ))
        except InvalidRequestError as exc:
            raise HttpError.of(exc, budget_field=body.budget_field,
                               structured_field=structured[0] if structured else "") from None

    async def _generate(self, request: Request, body: ChatCompletionRequest | CompletionRequest) -> Response:
        chat = isinstance(body, ChatCompletionRequest)
        tool_use = self._tool_use(body)
        prompts = await self._prompt_ids(body, tool_use)
        request_id = self._request_id(request)
        deadline = _deadline(request)
        routed = [await self._routed(body, prompt, request_id if len(prompts) == 1 else f"{request_id}-{index}",
                                     deadline) for index, prompt in enumerate(prompts)]
        span = self._span(request, f"POST {request.url.path}")
        generations = await self._started(routed, request_id, span)
        echoed = self._echoed(body, prompts)
        chunks = Chunks(f"{'chatcmpl' if chat else 'cmpl'}-{request_id}", body.model, chat, body.include_usage,
                        body.continuous_usage, sum(map(len, prompts)), self._shown_token(body), body.n,
                        tool_use if tool_use is not None and tool_use.active else None)
        headers = {"x-request-id": request_id, "x-tandem-worker": ",".join(g.worker for g in generations)}
        if body.stream:
            return _event_stream(self._stream(generations, echoed, chunks, span), headers)
        outcomes = await self._collected(generations, span)
        headers["x-tandem-worker"] = ",".join(g.worker for g in generations)
        return JSONResponse(chunks.complete(outcomes, echoed), headers=headers)

    async def _started(self, routed: list[RoutedRequest], request_id: str, span) -> list["Generation"]:
        """A generation per routed request, each past its first output; a failure before any is an HTTP error."""
        span.set_attributes({"tandem.request_id": request_id,
                             "gen_ai.usage.input_tokens": sum(each.prompt_tokens for each in routed),
                             "gen_ai.request.max_tokens": routed[0].max_new_tokens})
        generations = [Generation(self.router.generate(each, span), index) for index, each in enumerate(routed)]
        try:
            await _all([generation.start() for generation in generations])
        except RoutingError as exc:
            mark_failed_status(span, exc.status.name, str(exc))
            span.end()
            await _all([generation.close() for generation in generations])
            raise HttpError.of(exc) from None
        except BaseException:
            span.end()
            await _all([generation.close() for generation in generations])
            raise
        return generations

    @staticmethod
    async def _collected(generations: list["Generation"], span) -> list["Outcome"]:
        """Every generation's outcomes, prompt by prompt, each prompt's samples in order."""
        try:
            return [outcome for outcomes in await _all([generation.collect() for generation in generations])
                    for outcome in outcomes]
        except RoutingError as exc:
            mark_failed_status(span, exc.status.name, str(exc))
            raise HttpError.of(exc) from None
        finally:
            span.end()
            await _all([generation.close() for generation in generations])

    async def responses(self, request: Request) -> Response:
        """The Responses API, stateless: the conversation rendered as a chat; one message, or calls, out."""
        self._authorize(request)
        body = await self._parse(request, ResponsesRequest)
        return await _unless_disconnected(request, self._respond(request, body))

    async def _respond(self, request: Request, body: ResponsesRequest) -> Response:
        try:
            tool_use = body.tool_use(self.renders_tools)
            prompt = _truncated(body, await encode_chat(self.tokenizer, body.conversation(tool_use), "input",
                                                        tools=tool_use.template_tools()))
        except InvalidRequestError as exc:
            raise HttpError.of(exc) from None
        request_id = self._request_id(request)
        routed = await self._routed(body, prompt, request_id, _deadline(request))
        span = self._span(request, f"POST {request.url.path}")
        generations = await self._started([routed], request_id, span)
        objects = ResponseObjects(f"resp_{request_id}", body, tool_use)
        headers = {"x-request-id": request_id, "x-tandem-worker": generations[0].worker}
        if body.stream:
            return _event_stream(self._response_events(generations[0], objects, span), headers)
        outcome, = await self._collected(generations, span)
        calls = tool_use.calls(outcome.text) if tool_use.active else None
        return JSONResponse(objects.response(outcome.text, outcome.result, calls), headers=headers)

    async def _response_events(self, generation: "Generation", objects: ResponseObjects, span) -> AsyncIterator[bytes]:
        """The stream's events; with tools, text that may be a call is held back until it is known (``HeldReply``),
        and the message opens only once some text is known to be one."""
        try:
            for event in objects.opening_events():
                yield _event(event)
            held = HeldReply(objects.tool_use) if objects.tool_use.active else None
            text: list[str] = []

            def message_text(delta: str) -> list[dict]:
                if not delta:
                    return []
                opening = [] if text else objects.message_opening_events()
                text.append(delta)
                return [*opening, objects.delta_event(delta)]

            async for response in generation.responses():
                for event in message_text(held.feed(response.text) if held else response.text):
                    yield _event(event)
                if not response.HasField("result"):
                    continue
                calls, rest = held.end() if held else (None, "")
                if calls:
                    events = objects.call_events(calls, response.result)
                else:
                    events = message_text(rest)
                    if not text:
                        events += objects.message_opening_events()
                    events += objects.closing_events("".join(text), response.result)
                for event in events:
                    yield _event(event)
        except RoutingError as exc:
            mark_failed_status(span, exc.status.name, str(exc))
            yield _event(objects.event("error", **HttpError.of(exc).body()["error"]))
        except BaseException as exc:
            mark_failed(span, exc)
            raise
        finally:
            await generation.close()
            span.end()

    def _echoed(self, body: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]]) -> list["Echo | None"]:
        """What a completion with ``echo`` repeats of each prompt: its text as given (or decoded from token ids),
        and its token ids for log-probabilities; None for each without."""
        if isinstance(body, ChatCompletionRequest) or not body.echo:
            return [None] * len(prompts)
        return [Echo(given if isinstance(given, str) and not body.truncate_prompt_tokens else self.tokenizer.decode(ids),
                     ids)
                for given, ids in zip(body.prompts, prompts)]

    async def _stream(self, generations: list["Generation"], echoed: list["Echo | None"], chunks: "Chunks",
                      span) -> AsyncIterator[bytes]:
        try:
            for generation, echo in zip(generations, echoed):
                for index in chunks.choices(generation.index):
                    if chunks.chat:
                        yield _data(chunks.chunk({"role": "assistant", "content": ""}, index=index))
                    elif echo is not None:
                        logprobs = chunks.echo_logprobs(echo, generation.prompt_logprobs, index)
                        yield _data(chunks.chunk(echo.text, index=index, logprobs=logprobs))
            usage = []
            async with contextlib.aclosing(merged([g.responses() for g in generations])) as responses:
                async for prompt_index, response in responses:
                    chunks.streamed_tokens += len(response.token_ids)
                    for chunk in chunks.streamed(chunks.choice(prompt_index, response.index), response):
                        yield _data(chunk)
                    if response.HasField("result"):
                        usage.append((response.index, response.result.usage))
            if chunks.include_usage:
                yield _data(chunks.usage_chunk(usage))
            yield _DONE
        except RoutingError as exc:
            mark_failed_status(span, exc.status.name, str(exc))
            yield _data(HttpError.of(exc).body())
        except BaseException as exc:
            mark_failed(span, exc)
            raise
        finally:
            await _all([generation.close() for generation in generations])
            span.end()


class CountRequests:
    """Counts every HTTP response by route and status (``tandem_router_http_requests_total``); a plain ASGI
    middleware, so streamed responses pass through untouched."""

    def __init__(self, app, routes: frozenset[str]):
        self.app = app
        self.routes = routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                metrics.HTTP_REQUESTS.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


class Generation:
    """One routed generation, the ``index``-th choice of its response. ``start`` waits for the chosen worker's
    first output, so that a failure before it is still an error the HTTP status can carry."""

    def __init__(self, events: AsyncIterator[RoutingDecision | WorkerOutput], index: int = 0):
        self._events = events
        self._first: worker_pb2.GenerateResponse | None = None
        self.index = index
        self.worker = ""

    async def start(self) -> None:
        async for event in self._events:
            if isinstance(event, RoutingDecision):
                self.worker = event.chosen_worker
                continue
            self._first = event.response
            return

    @property
    def prompt_logprobs(self):
        """The prompt's log-probabilities, if the request asked for them (they come with the first output)."""
        return self._first.prompt_logprobs if self._first is not None else []

    async def responses(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        if self._first is not None:
            yield self._first
        async for event in self._events:
            if isinstance(event, WorkerOutput):
                yield event.response

    async def collect(self) -> list["Outcome"]:
        """Each sample's whole generation, in sample order."""
        samples: dict[int, tuple[list, list, list, list]] = {}
        async for response in self.responses():
            text, token_ids, logprobs, result = samples.setdefault(response.index, ([], [], [], []))
            text.append(response.text)
            token_ids.extend(response.token_ids)
            logprobs.extend(response.logprobs)
            if response.HasField("result"):
                result.append(response.result)
        return [Outcome("".join(text), token_ids, logprobs, self.prompt_logprobs, result[0], index)
                for index, (text, token_ids, logprobs, result) in sorted(samples.items())]

    async def close(self) -> None:
        await self._events.aclose()


@dataclass(frozen=True)
class Outcome:
    """A whole generation: its text, token ids, their log-probabilities (if asked for), the prompt's (with
    ``echo``), and how it ended."""

    text: str
    token_ids: list[int]
    logprobs: list[common_pb2.PositionLogprobs]
    prompt_logprobs: list[common_pb2.PositionLogprobs]
    result: worker_pb2.GenerateResult
    sample: int = 0  # of its prompt's samples (``n``)


@dataclass(frozen=True)
class Echo:
    """A prompt that a completion with ``echo`` repeats: its text and token ids."""

    text: str
    token_ids: list[int]


@dataclass
class Chunks:
    """Makes the response objects of one request, chat or completion, streamed or not.

    ``continuous_usage``: every streamed chunk carries the usage so far. ``token_text``: how a token id is
    shown in log-probabilities; None when the request asked for none.
    """

    id: str
    model: str
    chat: bool
    include_usage: bool
    continuous_usage: bool = False
    prompt_tokens: int = 0
    token_text: Callable[[int], str] | None = None
    samples: int = 1  # choices per prompt (``n``): prompt i's sample j is choice i * samples + j
    tool_use: ToolUse | None = None  # chat with tools the model may call
    streamed_tokens: int = 0
    created: int = 0
    text_offsets: dict[int, int] = field(default_factory=dict)  # completions: each choice's text so far
    held: dict[int, tuple[HeldReply, dict | None]] = field(default_factory=dict)  # tools: per choice, held text

    def __post_init__(self):
        self.created = int(time.time())

    def choice(self, prompt_index: int, sample: int) -> int:
        return prompt_index * self.samples + sample

    def choices(self, prompt_index: int) -> range:
        return range(self.choice(prompt_index, 0), self.choice(prompt_index + 1, 0))

    def chunk(self, delta, finish_reason: str | None = None, logprobs: dict | None = None, index: int = 0) -> dict:
        choice = ({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason} if self.chat
                  else {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason})
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.model, "choices": [choice]}
        if self.continuous_usage:
            chunk["usage"] = _usage_counts(self.prompt_tokens, self.streamed_tokens)
        elif self.include_usage:
            chunk["usage"] = None
        return chunk

    def streamed(self, index: int, response: worker_pb2.GenerateResponse) -> list[dict]:
        """The chunks of choice ``index`` that one worker response makes. With tools, text that may be a call is
        held back (``HeldReply``), with its log-probabilities, until the choice ends as calls or as content."""
        text, logprobs = response.text, self.logprobs(response.token_ids, response.logprobs, index)
        chunks = []
        if self.tool_use is not None:
            reply, held_logprobs = self.held.get(index) or (HeldReply(self.tool_use), None)
            text, logprobs = reply.feed(text), _joined(held_logprobs, logprobs)
            if not text and reply.holding is not False:  # held back, with its log-probabilities
                self.held[index], logprobs = (reply, logprobs), None
            else:
                self.held[index] = (reply, None)
        if text or (logprobs and self.token_text):
            chunks.append(self.chunk({"content": text} if self.chat else text, index=index, logprobs=logprobs))
        if response.HasField("result"):
            finish_reason = _FINISH_REASONS.get(response.result.finish_reason)
            if self.tool_use is not None:
                reply, held_logprobs = self.held.pop(index)
                calls, rest = reply.end()
                if calls:
                    finish_reason = "tool_calls"
                    for position, call in enumerate(calls):
                        chunks.append(self.chunk({"tool_calls": [{"index": position, "id": call.id, "type": "function",
                                                                  "function": {"name": call.name, "arguments": ""}}]},
                                                 index=index))
                        chunks.append(self.chunk({"tool_calls": [{"index": position,
                                                                  "function": {"arguments": call.arguments}}]},
                                                 index=index))
                elif rest:
                    chunks.append(self.chunk({"content": rest}, index=index, logprobs=held_logprobs))
            chunks.append(self.chunk({} if self.chat else "", finish_reason, index=index))
        return chunks

    def usage_chunk(self, usages: list[tuple[int, common_pb2.Usage]]) -> dict:
        return {**self.chunk(None), "choices": [], "usage": _usage(usages)}

    def complete(self, outcomes: list[Outcome], echoed: list[Echo | None]) -> dict:
        """``outcomes``: each prompt's samples in order; ``echoed``: per prompt."""
        choices = []
        for index, outcome in enumerate(outcomes):
            echo = echoed[index // self.samples]
            finish_reason = _FINISH_REASONS.get(outcome.result.finish_reason)
            echoed_logprobs = self.echo_logprobs(echo, outcome.prompt_logprobs, index) if echo else None
            logprobs = _joined(echoed_logprobs, self.logprobs(outcome.token_ids, outcome.logprobs, index))
            message = {"role": "assistant", "content": outcome.text}
            calls = self.tool_use.calls(outcome.text) if self.tool_use is not None else None
            if calls:
                message = {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                    for call in calls]}
                finish_reason, logprobs = "tool_calls", None
            choices.append({"index": index, "message": message,
                            "logprobs": logprobs, "finish_reason": finish_reason} if self.chat
                           else {"index": index, "text": (echo.text if echo else "") + outcome.text,
                                 "logprobs": logprobs, "finish_reason": finish_reason})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": _usage([(outcome.sample, outcome.result.usage) for outcome in outcomes])}

    def logprobs(self, token_ids, positions, index: int = 0) -> dict | None:
        """The log-probabilities of ``token_ids`` as the chat or the completions API shows them."""
        if self.token_text is None:
            return None
        text = self.token_text
        if self.chat:
            return {"content": [
                {**_chat_logprob(text(token), position.logprob),
                 "top_logprobs": [_chat_logprob(text(top.token_id), top.logprob) for top in position.top]}
                for token, position in zip(token_ids, positions)]}
        return self._completion_logprobs([text(token) for token in token_ids], [p.logprob for p in positions],
                                         [{text(top.token_id): top.logprob for top in p.top} for p in positions], index)

    def echo_logprobs(self, echo: Echo, positions, index: int) -> dict | None:
        """The prompt's part of a completion's log-probabilities, which come first: its first token has none."""
        if self.token_text is None:
            return None
        text = self.token_text
        return self._completion_logprobs([text(token) for token in echo.token_ids],
                                         [None, *(p.logprob for p in positions)],
                                         [None, *({text(t.token_id): t.logprob for t in p.top} for p in positions)],
                                         index)

    def _completion_logprobs(self, tokens: list[str], logprobs: list, tops: list, index: int) -> dict:
        """``text_offset`` counts on from the choice's tokens shown before."""
        offsets = list(itertools.accumulate((len(token) for token in tokens), initial=self.text_offsets.get(index, 0)))
        self.text_offsets[index] = offsets[-1]
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets[:-1]}


def _joined(first: dict | None, second: dict | None) -> dict | None:
    """Two consecutive parts of a completion's log-probabilities as one."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


async def _all(awaitables: list):
    """The results of ``awaitables``, run concurrently; the first failure raises once all have ended."""
    if len(awaitables) == 1:
        return [await awaitables[0]]
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def _truncated(body, prompt: list[int]) -> list[int]:
    """``prompt`` cut to its last ``truncate_prompt_tokens`` tokens, where the request asks for that."""
    return prompt[-body.truncate_prompt_tokens:] if body.truncate_prompt_tokens else prompt


def _openai_field(field: str) -> str:
    return _OPENAI_FIELDS.get(field, field.removeprefix("sampling."))


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def _chat_logprob(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def _usage_counts(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _usage(usages: list[tuple[int, common_pb2.Usage]]) -> dict:
    """The usage of a response from its choices' (sample index, usage): outputs added up, each prompt counted
    once (with its first sample)."""
    prompts = [usage for sample, usage in usages if not sample]
    return {**_usage_counts(sum(u.prompt_tokens for u in prompts), sum(u.output_tokens for _, u in usages)),
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in prompts)}}


def _deadline(request: Request) -> float | None:
    """The ``time.monotonic()`` instant by which the request must end, from the ``x-request-timeout`` header
    (seconds); None without one."""
    given = request.headers.get(TIMEOUT_HEADER)
    if given is None:
        return None
    try:
        seconds = float(given)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise HttpError(400, f"the {TIMEOUT_HEADER} header must be a positive number of seconds, got {given!r}",
                        TIMEOUT_HEADER)
    return time.monotonic() + seconds


def _event(payload: dict) -> bytes:
    """A server-sent event of the Responses API: named by its type."""
    return f"event: {payload['type']}\n".encode() + _data(payload)


def _data(payload: dict) -> bytes:
    """A server-sent event of chat and completions: one JSON object."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


_DONE = b"data: [DONE]\n\n"


async def _unless_disconnected(request: Request, answer: Awaitable[Response]) -> Response:
    """``answer``, cancelled if the client disconnects first, so that no worker generates for nobody (a
    client that gives up waiting for a queued request, say). A stream that has started watches for the
    disconnect itself (``StreamingResponse``)."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, asyncio.current_task()))
    try:
        return await answer
    except asyncio.CancelledError:
        if not watcher.done() or watcher.cancelled():  # cancelled by someone else
            raise
        asyncio.current_task().uncancel()
        raise HttpError(499, "the client disconnected before the response") from None
    finally:
        watcher.cancel()


async def _cancel_on_disconnect(request: Request, task: asyncio.Task) -> None:
    """Cancel ``task`` once the client disconnects (the body has been read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    task.cancel()


def _event_stream(events: AsyncIterator[bytes], headers: dict[str, str]) -> StreamingResponse:
    """Server-sent events as they come, unbuffered by proxies on the way."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"})


async def _json_object(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HttpError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    return body


def _validated(schema, body: dict):
    try:
        return schema.model_validate(without_unhonoured(body))
    except InvalidRequestError as exc:
        raise HttpError.of(exc) from None
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        # the location without pydantic's tags for the member of a union it tried (``literal[...]``, a class name)
        param = ".".join(str(part) for part in error["loc"]
                         if not (isinstance(part, str) and ("[" in part or part[:1].isupper()))) or None
        raise HttpError(400, f"{param}: {error['msg']}" if param else error["msg"], param) from None


class EmbeddedServer(uvicorn.Server):
    """uvicorn inside the router's event loop. The router owns SIGTERM and SIGINT: it stops this server."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def http_server(front_end: OpenAIFrontEnd, host: str, port: int, tls: ServerTLS | None,
                grace_s: float) -> EmbeddedServer:
    """The HTTP server of ``front_end`` on ``host:port``: TLS with ``tls``, client certificates when it names a CA."""
    config = uvicorn.Config(
        front_end.app(), host=host, port=port, log_level="warning", lifespan="off", timeout_graceful_shutdown=grace_s,
        ssl_certfile=tls.cert_file if tls else None, ssl_keyfile=tls.key_file if tls else None,
        ssl_ca_certs=tls.client_ca_file if tls else None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.client_ca_file else ssl.CERT_NONE,
    )
    return EmbeddedServer(config)
