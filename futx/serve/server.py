"""The HTTP front end on aiohttp: OpenAI-compatible completions and chat completions over the Scheduler.

Requests are validated (4xx JSON errors) before they reach the scheduler; the scheduler's thread hands
events back to the event loop with call_soon_threadsafe. A client that disconnects cancels its request
(handler cancellation is on), which frees its cache slot at the next tick.

`GET /metrics`: the Prometheus text format (futx.serve.metrics); every generation request is counted there by
outcome (ok, client_error, disconnected, overloaded, error).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Optional

from aiohttp import web

from .metrics import ServerMetrics, outcome_of
from .protocol import ApiError, bad, chunk, new_id, parse_chat, parse_completion, response, usage
from .scheduler import QueueFull, RequestTooLong, Scheduler

log = logging.getLogger("futx.serve")
MAX_BODY = 8 * 1024 * 1024   # bytes; a larger body is answered 413
# per-request state of the outcome counter (typed keys where aiohttp has them, 3.12+)
_key = getattr(web, "RequestKey", None)
OUTCOME = _key("futx_outcome", str) if _key else "futx_outcome"   # set where the status does not say it
COUNTED = _key("futx_counted", bool) if _key else "futx_counted"  # already counted (a stream, before its end)


GENERATE = ("/v1/completions", "/v1/chat/completions")


class App:
    def __init__(self, scheduler: Scheduler, tokenizer, model_names: tuple[str, ...], vocab_size: int,
                 metrics: Optional[ServerMetrics] = None):
        self.scheduler, self.tokenizer = scheduler, tokenizer
        self.models, self.vocab = tuple(model_names), vocab_size
        self.created = int(time.time())
        self.metrics = metrics if metrics is not None else ServerMetrics(scheduler)

    def build(self) -> web.Application:
        app = web.Application(middlewares=[self._count, self._errors], client_max_size=MAX_BODY)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    @web.middleware
    async def _count(self, request, handler):
        """Outermost: every generation request counted once, by outcome."""
        if request.path not in GENERATE:
            return await handler(request)
        try:
            resp = await handler(request)
        except (asyncio.CancelledError, ConnectionResetError):
            if not request.get(COUNTED):
                self.metrics.request("disconnected")
            raise
        except web.HTTPException as e:
            self.metrics.request(outcome_of(e.status))
            raise
        except BaseException:
            self.metrics.request("error")
            raise
        if not request.get(COUNTED):
            self.metrics.request(request.get(OUTCOME) or outcome_of(resp.status))
        return resp

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:  # unknown route, wrong method, body too large
            if e.status < 400:
                raise
            return web.json_response(ApiError(e.status, e.reason, type="invalid_request_error").body(),
                                     status=e.status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # noqa: BLE001 -- one bad request must never take the server down
            log.exception("internal error")
            return web.json_response(ApiError(500, f"internal error: {e}", type="server_error").body(), status=500)

    async def health(self, request):
        return web.json_response({"status": "ok", **self.scheduler.load, "capacity": self.scheduler.engine.capacity,
                                  "vocab_size": self.vocab})

    async def metrics_text(self, request):
        return web.Response(body=self.metrics.render(), headers={"Content-Type": self.metrics.content_type})

    async def list_models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "created": self.created, "owned_by": "futx"} for m in self.models]})

    async def completions(self, request):
        return await self.generate(request, chat=False)

    async def chat_completions(self, request):
        return await self.generate(request, chat=True)

    async def generate(self, request: web.Request, chat: bool):
        try:
            body = json.loads(await request.text())
        except (ValueError, UnicodeDecodeError):   # JSONDecodeError is a ValueError
            raise bad("the request body is not valid JSON (UTF-8)") from None
        except RecursionError:
            raise bad("the request body is nested too deeply") from None
        parse = parse_chat if chat else parse_completion
        req = parse(body, self.tokenizer, self.models, self.scheduler.engine.capacity, self.vocab)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        try:
            handle = self.scheduler.submit(req.prompt, req.params,
                                           sink=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        except RequestTooLong as e:
            raise ApiError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
        except QueueFull as e:
            raise ApiError(503, str(e), type="server_overloaded", code="queue_full") from None
        rid = new_id(chat)
        try:
            if req.stream:
                return await self._stream(request, events, chat, rid, req)
            text, ev = "", None
            while ev is None or ev.finish_reason is None:
                ev = await events.get()
                text += ev.text
            if ev.finish_reason == "error":
                raise ApiError(500, ev.error or "generation failed", type="server_error")
            return web.json_response(response(chat, rid, req.model, text, ev.finish_reason, ev.prompt_tokens,
                                              ev.completion_tokens))
        finally:
            handle.cancel()  # no-op once finished; frees the slot if the client went away

    async def _stream(self, request, events: asyncio.Queue, chat: bool, rid: str, req):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(obj) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        try:
            if chat:
                await send(chunk(True, rid, req.model, None, role=True))
            while True:
                ev = await events.get()
                if ev.finish_reason == "error":
                    request[OUTCOME] = "error"
                    await send(ApiError(500, ev.error or "generation failed", type="server_error").body())
                    break
                if ev.text:
                    await send(chunk(chat, rid, req.model, ev.text))
                if ev.finish_reason is not None:
                    await send(chunk(chat, rid, req.model, None, ev.finish_reason))
                    if req.include_usage:
                        await send({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                    "created": int(time.time()), "model": req.model, "choices": [],
                                    "usage": usage(ev.prompt_tokens, ev.completion_tokens)})
                    break
            # counted before the client can see the end (as a plain response is counted before it is sent)
            self.metrics.request(request.get(OUTCOME) or "ok")
            request[COUNTED] = True
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:   # the client went away mid-stream: its slot is freed by the caller
            request[OUTCOME] = "disconnected"
        return resp


class ServerThread:
    """The app on its own event loop in a background thread (tests, embedding). `url` once started."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0):
        self.app, self.host, self.port = app, host, port
        self.url: Optional[str] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._thread = threading.Thread(target=self._run, name="futx-http", daemon=True)

    def start(self) -> "ServerThread":
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join()

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            runner = await start_site(self.app, self.host, self.port)
        except BaseException as e:  # noqa: BLE001 -- reported to start()
            self._error = e
            self._ready.set()
            return
        self.port = runner.addresses[0][1]
        self.url = f"http://{self.host}:{self.port}"
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()


async def start_site(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
