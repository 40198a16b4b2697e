"""The "bare" baseline of the gateway-overhead benchmark: the smallest OpenAI-compatible server
around an in-process engine (the synthetic one by default). One process, no Redis, no limits, one
bearer-key check; /v1/completions streamed and not. What a gateway adds is measured against this.

    python -m kvgate.bench.baseline --model DIR --port 9000 --api-key sk-...
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import time

import click
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from worker.engine.tokenizer import encode_prompt
from worker.engine.types import EngineRejected, RequestOutput, SamplingParams


class EngineLoop:
    """Steps the engine while it has work and hands each output to its request's queue."""

    def __init__(self, engine):
        self.engine = engine
        self.queues: dict[str, asyncio.Queue] = {}
        self.wake = asyncio.Event()
        self.ids = itertools.count()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        request_id = f"cmpl-{next(self.ids)}"
        self.engine.add_request(request_id, prompt_ids, params)
        self.queues[request_id] = queue = asyncio.Queue()
        self.wake.set()
        return request_id, queue

    def abort(self, request_id: str) -> None:
        if self.queues.pop(request_id, None) is not None:
            self.engine.abort(request_id)

    async def run(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self.wake.clear()
                await self.wake.wait()
            for out in self.engine.step():
                queue = self.queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
                    if out.finished:
                        del self.queues[out.request_id]
            await asyncio.sleep(0)  # let the HTTP side run between steps


def _error(status: int, message: str, kind: str, code: str | None = None) -> Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def create_app(engine, api_key: str | None) -> Starlette:
    loop = EngineLoop(engine)
    expected = f"Bearer {api_key}".encode() if api_key else None

    async def completions(request: Request) -> Response:
        given = request.headers.get("authorization", "").encode()
        if expected is not None and not hmac.compare_digest(given, expected):
            return _error(401, "Incorrect API key provided", "authentication_error", "invalid_api_key")
        try:
            body = orjson.loads(await request.body())
            prompt = body["prompt"]
            ids = list(prompt) if isinstance(prompt, list) else encode_prompt(engine.tokenizer, prompt)
            params = SamplingParams(max_tokens=int(body.get("max_tokens") or 16),
                                    ignore_eos=bool(body.get("ignore_eos", False)))
            request_id, queue = loop.submit(ids, params)
        except (ValueError, KeyError, TypeError, EngineRejected) as exc:
            return _error(400, str(exc), "invalid_request_error")
        shape = _Shape(request_id, body.get("model", ""), len(ids))
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_sse(loop, request_id, queue, shape, usage), media_type="text/event-stream")
        text, out = [], None
        try:
            while out is None or not out.finished:
                out = await queue.get()
                text.append(out.text)
        finally:
            loop.abort(request_id)
        return Response(orjson.dumps(shape.final("".join(text), out)), media_type="application/json")

    async def models(request: Request) -> Response:
        return Response(orjson.dumps({"object": "list", "data": [{"id": "synthetic", "object": "model"}]}),
                        media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.get_running_loop().create_task(loop.run())
        yield
        task.cancel()

    async def healthz(request: Request) -> Response:
        return Response("ok")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models), Route("/healthz", healthz)], lifespan=lifespan)


class _Shape:
    def __init__(self, request_id: str, model: str, prompt_tokens: int):
        self.id, self.model, self.prompt_tokens = request_id, model, prompt_tokens
        self.created = int(time.time())

    def _obj(self, choices: list, usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def usage(self, out: RequestOutput) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": out.num_output_tokens,
                "total_tokens": self.prompt_tokens + out.num_output_tokens}

    def chunk(self, out: RequestOutput) -> dict:
        reason = out.finish_reason if out.finished else None
        return self._obj([{"index": 0, "text": out.text, "logprobs": None, "finish_reason": reason}])

    def final(self, text: str, out: RequestOutput) -> dict:
        return self._obj([{"index": 0, "text": text, "logprobs": None, "finish_reason": out.finish_reason}],
                         self.usage(out))


async def _sse(loop: EngineLoop, request_id: str, queue: asyncio.Queue, shape: _Shape, usage: bool):
    try:
        while True:
            out = await queue.get()
            yield b"data: " + orjson.dumps(shape.chunk(out)) + b"\n\n"
            if out.finished:
                break
        if usage:
            yield b"data: " + orjson.dumps(shape._obj([], shape.usage(out))) + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        loop.abort(request_id)  # a no-op when the request finished


@click.command()
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False), help="Model folder")
@click.option("--engine", type=click.Choice(["synthetic", "paged"]), default="synthetic", show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=9000, show_default=True)
@click.option("--api-key", envvar="KVGATE_BASELINE_API_KEY", default=None, help="Required bearer key")
def main(model: str, engine: str, host: str, port: int, api_key: str | None) -> None:
    """Serve MODEL's engine bare: one process, one bearer-key check."""
    import uvicorn

    from shared.settings import WorkerSettings
    from worker.main import build_engine

    app = create_app(build_engine(WorkerSettings(model=model, engine=engine, device="cpu")), api_key)
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
