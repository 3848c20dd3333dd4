"""An OpenAI-compatible HTTP server with continuous batching (``hanzo-torch serve``).

Endpoints (the subset of OpenAI's API that llama-server serves):

- ``POST /v1/chat/completions``: ``messages`` rendered with the file's chat template.
- ``POST /v1/completions``: ``prompt`` a string or a list of token ids.
- ``GET /v1/models``, ``GET /health`` (``{"status": "ok"}``).

Both completion endpoints take ``max_tokens`` (or ``max_completion_tokens``), ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop`` (a string or up to 4), ``stream``
(server-sent events, ``data: {chunk}`` lines then ``data: [DONE]``), ``repeat_penalty`` and
``ignore_eos``; absent sampling fields take llama.cpp's defaults (temperature 0.8, top_k 40,
top_p 0.95, min_p 0.05). Bad fields get HTTP 400 with OpenAI's error object
``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``, checked before the
request is queued (so is a prompt plus ``max_tokens`` beyond the per-slot context); a chat
template that fails on the messages is 422; a failure while generating (non-finite logits) is
500 naming the file, and the server keeps serving.

One model worker thread owns the model (it holds the model's generate lock for its lifetime)
and runs a :class:`~hanzo_torch.batching.BatchEngine` of ``n_parallel`` KV-cache slots
(llama-server's ``-np``; each slot holds ``ctx_size / n_parallel`` tokens, as llama-server
divides ``-c``): a request joins the running batch at the next decode step in a free slot and
leaves when done. Requests beyond the free slots wait in a queue of ``max_queue``; when it is
full the answer is HTTP 503 with ``Retry-After``. A client that disconnects cancels its sequence
(its slot is free at the next step). SIGTERM/SIGINT stop accepting connections, let running
requests finish for up to ``shutdown_timeout`` seconds, then stop the worker.

Built on FastAPI (Starlette) and uvicorn: the ``[serve]`` extra.
"""
from __future__ import annotations

import asyncio
import json
import os
import queue
import threading
import time
import uuid
from typing import Any, Optional

from .batching import BatchEngine, BatchSequence
from .prompting import _generate_lock
from .sampling import (
    DEFAULT_MIN_P,
    DEFAULT_REPEAT_LAST_N,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    SamplingParams,
)

__all__ = ["ModelWorker", "create_app", "serve", "QueueFull"]

_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


class QueueFull(Exception):
    """The server's request queue is full (HTTP 503)."""


class _ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


class _Job:
    """One request in flight: its sequence and the asyncio queue its events go to."""

    def __init__(self, seq: BatchSequence, loop: asyncio.AbstractEventLoop):
        self.seq = seq
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.done = False

    def post(self, item: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is closed (shutdown)
            pass


class ModelWorker:
    """The thread that owns ``model`` and decodes every request on one :class:`BatchEngine`.

    Args:
        model: a loaded model (:func:`hanzo_torch.load`).
        n_parallel: KV-cache slots (sequences decoded at once), >= 1.
        max_queue: requests allowed to wait for a slot; more raise :class:`QueueFull`.
        cuda_graph: capture the decode step per batch size on CUDA/HIP/vulkan/the CPU.
    """

    def __init__(self, model: Any, n_parallel: int, max_queue: int = 64, cuda_graph: bool = True):
        self.model = model
        self.n_parallel = n_parallel
        self.max_queue = max_queue
        self.cuda_graph = cuda_graph
        self._inbox: "queue.Queue[tuple[str, _Job]]" = queue.Queue()
        self._pending = 0  # jobs submitted and not yet handed to the engine
        self._count_lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="hanzo-model-worker", daemon=True)
        self.error: Optional[BaseException] = None
        self.engine: Optional[BatchEngine] = None
        self.completed = 0  # requests answered in full
        self.cancelled = 0  # requests whose client went away before the end

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error

    def submit(self, job: _Job) -> None:
        """Queue ``job``; raises QueueFull when ``max_queue`` requests already wait for a slot,
        RuntimeError when the worker has stopped."""
        if self._stop.is_set() or not self._thread.is_alive():
            raise RuntimeError("the model worker is not running")
        with self._count_lock:
            waiting = self.waiting()
            if waiting >= self.max_queue:
                raise QueueFull(f"{waiting} requests are waiting for one of {self.n_parallel} slots")
            self._pending += 1
        self._inbox.put(("add", job))

    def cancel(self, job: _Job) -> None:
        """Cancel ``job`` (client gone): its slot is freed before the next decode step."""
        if not job.done:
            self._inbox.put(("cancel", job))

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)

    def waiting(self) -> int:
        """Requests submitted and not yet in a slot (a request leaves the count when its prefill starts)."""
        engine = self.engine
        return self._pending + (len(engine.waiting) if engine is not None else 0)

    def busy_slots(self) -> int:
        return self.engine.busy if self.engine is not None else 0

    def _main(self) -> None:
        lock = _generate_lock(self.model)
        try:
            ctx = lock.hold() if lock is not None else None
            if ctx is not None:
                ctx.__enter__()
            self.engine = engine = BatchEngine(self.model, self.n_parallel, self.cuda_graph)
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self.error = exc
            self._ready.set()
            return
        self._ready.set()
        jobs: dict[int, _Job] = {}
        try:
            while not self._stop.is_set():
                self._drain(engine, jobs, block=engine.idle())
                if engine.idle():
                    continue
                try:
                    events = engine.step()
                except Exception as exc:  # noqa: BLE001 - a failing step ends its sequences, not the server
                    for seq in [s for s in engine.slots if s is not None] + list(engine.waiting):
                        engine.cancel(seq)
                        self._end(jobs.pop(id(seq), None), error=exc)
                    continue
                for seq, piece in events:
                    job = jobs.get(id(seq))
                    if job is None:
                        continue
                    if piece:
                        job.post(("piece", piece))
                    if seq.finished:
                        jobs.pop(id(seq), None)
                        self.completed += seq.error is None
                        self._end(job, error=seq.error)
        finally:
            for job in jobs.values():
                engine.cancel(job.seq)
                self._end(job, error=RuntimeError("the server is shutting down"))
            if ctx is not None:
                ctx.__exit__(None, None, None)

    def _drain(self, engine: BatchEngine, jobs: dict, block: bool) -> None:
        while True:
            try:
                kind, job = self._inbox.get(timeout=0.2) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if kind == "add":
                with self._count_lock:  # one step, so waiting() never counts a job twice or not at all
                    self._pending -= 1
                    if job.done:  # cancelled before it was admitted
                        continue
                    jobs[id(job.seq)] = job
                    engine.add(job.seq)
            elif kind == "cancel" and id(job.seq) in jobs:
                engine.cancel(job.seq)
                jobs.pop(id(job.seq), None)
                self.cancelled += 1
                self._end(job)

    @staticmethod
    def _end(job: Optional[_Job], error: Optional[BaseException] = None) -> None:
        if job is None or job.done:
            return
        job.done = True
        job.post(("error", error) if error is not None else ("done", job.seq.result))


# ---------------------------------------------------------------------- request parsing
def _field(body: dict, name: str, kinds, default=None, check=None, what: str = ""):
    if name not in body or body[name] is None:
        return default
    v = body[name]
    if isinstance(v, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise _ApiError(400, f"'{name}' must be {what}, got a boolean", name)
    if not isinstance(v, kinds):
        raise _ApiError(400, f"'{name}' must be {what}, got {type(v).__name__}", name)
    if check is not None and not check(v):
        raise _ApiError(400, f"'{name}' must be {what}, got {v!r}", name)
    return v


def _sampling(body: dict) -> tuple[SamplingParams, Optional[int], list[str], Optional[int], bool]:
    num = (int, float)
    temperature = _field(body, "temperature", num, DEFAULT_TEMPERATURE, lambda v: 0 <= v <= 100,
                         "a number in [0, 100]")
    top_p = _field(body, "top_p", num, DEFAULT_TOP_P, lambda v: 0 < v <= 1, "a number in (0, 1]")
    top_k = _field(body, "top_k", int, DEFAULT_TOP_K, lambda v: v >= 0, "an integer >= 0")
    min_p = _field(body, "min_p", num, DEFAULT_MIN_P, lambda v: 0 <= v < 1, "a number in [0, 1)")
    penalty = _field(body, "repeat_penalty", num, 1.0, lambda v: 0 < v <= 100, "a number in (0, 100]")
    seed = _field(body, "seed", int, None, lambda v: -2**63 <= v < 2**63, "a 64-bit integer")
    stop = body.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop] if stop else []
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
        stops = list(stop)
    else:
        raise _ApiError(400, "'stop' must be a string or a list of at most 4 non-empty strings", "stop")
    max_tokens = _field(body, "max_tokens", int, None, lambda v: v >= 1, "an integer >= 1")
    if max_tokens is None:
        max_tokens = _field(body, "max_completion_tokens", int, None, lambda v: v >= 1, "an integer >= 1")
    ignore_eos = _field(body, "ignore_eos", bool, False, None, "a boolean")
    n = _field(body, "n", int, 1, lambda v: v == 1, "1 (one choice per request)")
    del n
    params = SamplingParams(float(temperature), int(top_k), float(top_p), float(min_p), float(penalty),
                            DEFAULT_REPEAT_LAST_N)
    return params, seed, stops, max_tokens, ignore_eos


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text ones
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise _ApiError(400, f"messages[{i}].content[{j}] must be a {{'type': 'text', 'text': str}} part",
                                "messages")
            parts.append(p["text"])
        return "".join(parts)
    raise _ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _ApiError(400, "'messages' must be a non-empty list of {'role', 'content'} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _ApiError(400, f"messages[{i}] must be an object with a string 'role'", "messages")
        out.append({"role": m["role"], "content": _message_text(m.get("content", ""), i)})
    return out


def _error_body(exc: _ApiError) -> dict:
    return {"error": {"message": exc.message, "type": exc.kind, "param": exc.param,
                      "code": exc.status}}


# ---------------------------------------------------------------------- the app
def create_app(model: Any, *, n_parallel: int = 1, max_queue: int = 64, model_name: Optional[str] = None,
               cuda_graph: bool = True, worker: Optional[ModelWorker] = None):
    """The FastAPI app serving ``model`` (see the module docstring). The model worker starts
    with the app (its lifespan) and stops with it. ``model.max_context`` is the per-slot context.

    Raises:
        ImportError: FastAPI is not installed (the ``[serve]`` extra).
    """
    try:
        from contextlib import asynccontextmanager

        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, StreamingResponse
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("hanzo-torch serve needs FastAPI and uvicorn: pip install 'hanzo-torch[serve]'") from exc

    tokenizer = model.tokenizer
    max_context = int(model.max_context)
    name = model_name or (os.path.basename(str(model.gguf.path)) if getattr(model, "gguf", None) else "hanzo-torch")
    worker = worker or ModelWorker(model, n_parallel, max_queue, cuda_graph)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        await asyncio.get_running_loop().run_in_executor(None, worker.start)
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop)

    app = FastAPI(title="hanzo-torch", lifespan=lifespan)
    app.state.worker = worker

    def error(exc: _ApiError, headers: Optional[dict] = None):
        return JSONResponse(_error_body(exc), status_code=exc.status, headers=headers)

    @app.get("/health")
    async def health():
        if worker.error is not None or not worker._thread.is_alive():
            return JSONResponse({"status": "error"}, status_code=503)
        return {"status": "ok", "slots_busy": worker.busy_slots(), "slots": worker.n_parallel,
                "requests_waiting": worker.waiting(), "requests_completed": worker.completed,
                "requests_cancelled": worker.cancelled}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "hanzo-torch", "meta": {"n_ctx_slot": max_context}}]}

    async def parse(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            raise _ApiError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise _ApiError(400, "the request body must be a JSON object")
        return body

    def make_job(prompt_ids: list[int], body: dict) -> tuple[_Job, bool]:
        params, seed, stops, max_tokens, ignore_eos = _sampling(body)
        stream = _field(body, "stream", bool, False, None, "a boolean")
        if not prompt_ids:
            raise _ApiError(400, "the prompt is empty", "prompt")
        room = max_context - len(prompt_ids)
        if room < 1:
            raise _ApiError(400, f"the prompt has {len(prompt_ids)} tokens, the context of a slot is "
                                 f"{max_context}", "messages" if "messages" in body else "prompt")
        if max_tokens is not None and max_tokens > room + 1:
            raise _ApiError(400, f"max_tokens={max_tokens} with a {len(prompt_ids)}-token prompt exceeds the "
                                 f"context of a slot ({max_context} tokens)", "max_tokens")
        budget = max_tokens if max_tokens is not None else room + 1
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") & (2**63 - 1)
        seq = BatchSequence(prompt_ids, budget, params, seed % 2**63, stops, tokenizer, ignore_eos, True,
                            max_context)
        return _Job(seq, asyncio.get_running_loop()), stream

    async def run(request: Request, job: _Job, stream: bool, shape):
        try:
            worker.submit(job)
        except QueueFull as exc:
            return error(_ApiError(503, f"server busy: {exc}; retry later", kind="server_busy"),
                         headers={"Retry-After": "1"})
        except RuntimeError as exc:
            return error(_ApiError(503, str(exc), kind="server_error"), headers={"Retry-After": "5"})
        rid = f"{shape.prefix}-{uuid.uuid4().hex[:24]}"
        if stream:
            async def events():
                try:
                    first = shape.first_chunk(rid)
                    if first is not None:
                        yield f"data: {json.dumps(first)}\n\n"
                    while True:
                        kind, value = await job.events.get()
                        if kind == "piece":
                            yield f"data: {json.dumps(shape.chunk(rid, value, None))}\n\n"
                        elif kind == "done":
                            last = shape.chunk(rid, "", _FINISH.get(value.stats.stop_reason, "stop"))
                            last["usage"] = _usage(job.seq)
                            yield f"data: {json.dumps(last)}\n\n"
                            break
                        else:
                            exc = _ApiError(500, str(value), kind="server_error")
                            yield f"data: {json.dumps(_error_body(exc))}\n\n"
                            break
                    yield "data: [DONE]\n\n"
                finally:
                    worker.cancel(job)  # a no-op once done; frees the slot of a client gone mid-stream

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(job.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        worker.cancel(job)
                        return error(_ApiError(499, "client disconnected"))
                    continue
                if kind == "done":
                    return JSONResponse(shape.full(rid, value, _usage(job.seq)))
                if kind == "error":
                    return error(_ApiError(500, str(value), kind="server_error"))
        finally:
            worker.cancel(job)

    def handler(endpoint):
        async def route(request: Request):
            try:
                body = await parse(request)
                return await endpoint(request, body)
            except _ApiError as exc:
                return error(exc)
            except ValueError as exc:  # SamplingParams, tokenizer input checks
                return error(_ApiError(400, str(exc)))
        return route

    async def chat(request: Request, body: dict):
        msgs = _messages(body)
        from .tokenizer import TokenizerError

        try:
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        except TokenizerError as exc:
            raise _ApiError(422, str(exc), "messages", kind="unprocessable_entity") from None
        if tokenizer.max_token_bytes and len(text) > max_context * tokenizer.max_token_bytes:
            raise _ApiError(400, f"the messages are longer than the context of a slot ({max_context} tokens)",
                            "messages")
        job, stream = make_job(tokenizer.encode(text, add_special_tokens=False), body)
        return await run(request, job, stream, _ChatShape(name))

    async def completions(request: Request, body: dict):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if tokenizer.max_token_bytes and len(prompt) > max_context * tokenizer.max_token_bytes:
                raise _ApiError(400, f"the prompt is longer than the context of a slot ({max_context} tokens)",
                                "prompt")
            ids = tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            bad = [i for i in prompt if not 0 <= i < tokenizer.vocab_size]
            if bad:
                raise _ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, "
                                     f"{tokenizer.vocab_size})", "prompt")
            ids = list(prompt)
        else:
            raise _ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                            "prompt")
        job, stream = make_job(ids, body)
        return await run(request, job, stream, _CompletionShape(name))

    # Starlette routes (the handler gets the Request; the body is validated by hand, for OpenAI's error shape)
    for path, endpoint in (("/v1/chat/completions", chat), ("/v1/completions", completions),
                           ("/chat/completions", chat), ("/completions", completions)):
        app.router.add_route(path, handler(endpoint), methods=["POST"])
    return app


def _usage(seq: BatchSequence) -> dict:
    p, c = len(seq.prompt_ids), len(seq.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class _ChatShape:
    prefix = "chatcmpl"

    def __init__(self, model: str):
        self.model = model

    def _base(self, rid: str, obj: str) -> dict:
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.model}

    def first_chunk(self, rid: str) -> dict:
        d = self._base(rid, "chat.completion.chunk")
        d["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
        return d

    def chunk(self, rid: str, text: str, finish: Optional[str]) -> dict:
        d = self._base(rid, "chat.completion.chunk")
        d["choices"] = [{"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}]
        return d

    def full(self, rid: str, result, usage: dict) -> dict:
        d = self._base(rid, "chat.completion")
        d["choices"] = [{"index": 0, "message": {"role": "assistant", "content": result.text},
                         "finish_reason": _FINISH.get(result.stats.stop_reason, "stop")}]
        d["usage"] = usage
        return d


class _CompletionShape(_ChatShape):
    prefix = "cmpl"

    def first_chunk(self, rid: str) -> None:
        return None

    def chunk(self, rid: str, text: str, finish: Optional[str]) -> dict:
        d = self._base(rid, "text_completion")
        d["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
        return d

    def full(self, rid: str, result, usage: dict) -> dict:
        d = self._base(rid, "text_completion")
        d["choices"] = [{"index": 0, "text": result.text, "logprobs": None,
                         "finish_reason": _FINISH.get(result.stats.stop_reason, "stop")}]
        d["usage"] = usage
        return d


def serve(model: Any, host: str = "127.0.0.1", port: int = 8080, *, n_parallel: int = 1, max_queue: int = 64,
          model_name: Optional[str] = None, cuda_graph: bool = True, shutdown_timeout: float = 10.0,
          log_level: str = "info") -> None:
    """Serve ``model`` over HTTP until SIGTERM/SIGINT (blocking); see the module docstring."""
    import uvicorn

    app = create_app(model, n_parallel=n_parallel, max_queue=max_queue, model_name=model_name,
                     cuda_graph=cuda_graph)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout)
    uvicorn.Server(config).run()
