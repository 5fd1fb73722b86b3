"""The HTTP side of ``tensorpar serve``: the OpenAI wire format (as vLLM serves it) on FastAPI.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` gives Server-Sent
Events ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` (503 once the model ranks failed or the server is stopping),
``GET /metrics`` (Prometheus text). Errors use OpenAI's shape ``{"error": {"message", "type", "param",
"code"}}``; a field this server does not implement is refused with a 400 naming it, never ignored.
Extension (as in vLLM): ``return_token_ids: true`` adds ``prompt_token_ids`` and ``token_ids`` to each choice.
"""
import asyncio
import json
import math
import time
import uuid

from tensorpar.serve.params import BadRequest, _num, error_body  # noqa: F401  (BadRequest re-exported)
from tensorpar.serve.scheduler import QueueFull, Request

COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
          "stream_options", "return_token_ids", "user"}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs"}
CHAT_FIELDS = COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
MAX_LOGPROBS = 20


class Api:
    """Parses requests, tokenizes, submits to the scheduler and formats responses.

    Args:
        scheduler: rank 0's :class:`~tensorpar.serve.scheduler.Scheduler`.
        tokenizer: the model's tokenizer (chat template for ``/v1/chat/completions``).
        model_name: the id reported by ``/v1/models`` and accepted in ``model``.
        max_model_len: prompt + ``max_tokens`` limit (the KV cache length per slot).
        metrics: :class:`~tensorpar.serve.metrics.ServeMetrics`.
    """

    def __init__(self, scheduler, tokenizer, model_name: str, max_model_len: int, metrics):
        self.sched, self.tok, self.model_name = scheduler, tokenizer, model_name
        self.max_model_len, self.metrics = max_model_len, metrics

    # ------------------------------------------------------------------ parsing
    def parse(self, body, chat: bool) -> tuple[Request, dict]:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
        extra = sorted(set(body) - allowed)
        if extra:
            raise BadRequest(f"unsupported field(s): {', '.join(extra)}; this server accepts "
                             f"{', '.join(sorted(allowed))}", extra[0])
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest(f"model {json.dumps(model)} is not served here; use {json.dumps(self.model_name)}",
                             "model", status=404, kind="not_found_error")
        if _num(body, "n", 1, int) != 1:
            raise BadRequest("'n' must be 1 (one choice per request)", "n")
        if chat:
            ids = self._chat_prompt(body.get("messages"))
        else:
            ids = self._prompt(body.get("prompt"))
        if len(ids) >= self.max_model_len:
            raise BadRequest(f"the prompt has {len(ids)} tokens; --max-model-len is {self.max_model_len}, which must "
                             f"leave room for at least one generated token", "prompt" if not chat else "messages")
        room = self.max_model_len - len(ids)
        mt_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        if mt_name == "max_completion_tokens":
            _num(body, "max_tokens", None, int, lo=1)           # checked too when both are given
        max_tokens = _num(body, mt_name, None, int, lo=1)
        if max_tokens is None:
            max_tokens = room if chat else min(16, room)
        if max_tokens > room:
            raise BadRequest(f"'{mt_name}' is {max_tokens} but the prompt has {len(ids)} tokens and --max-model-len is "
                             f"{self.max_model_len}: at most {room} tokens can be generated", mt_name)
        temperature = float(_num(body, "temperature", 1.0, lo=0, hi=2))           # OpenAI's default: 1
        top_p = float(_num(body, "top_p", 1.0, lo=0, hi=1, lo_open=True))
        top_k = _num(body, "top_k", 0, int, lo=-1)
        top_k = 0 if top_k == -1 else top_k
        seed = _num(body, "seed", None, int, lo=-2 ** 63, hi=2 ** 64 - 1)     # torch.Generator's seed range
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise BadRequest("'stop' must be a non-empty string or a list of up to 4 non-empty strings", "stop")
        if chat:
            lp = body.get("logprobs", False)
            if not isinstance(lp, bool):
                raise BadRequest(f"'logprobs' must be true or false, got {json.dumps(lp)}", "logprobs")
            top = _num(body, "top_logprobs", 0, int, lo=0, hi=MAX_LOGPROBS)
            if top and not lp:
                raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            logprobs = top if lp else -1
        else:
            logprobs = _num(body, "logprobs", None, int, lo=0, hi=MAX_LOGPROBS)
            logprobs = -1 if logprobs is None else logprobs
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest(f"'stream' must be true or false, got {json.dumps(stream)}", "stream")
        so = body.get("stream_options")
        if so is not None and (not isinstance(so, dict) or set(so) - {"include_usage"}
                               or not isinstance(so.get("include_usage", False), bool)):
            raise BadRequest("'stream_options' accepts only {\"include_usage\": true|false}", "stream_options")
        if so is not None and not stream:
            raise BadRequest("'stream_options' is only allowed with 'stream': true", "stream_options")
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise BadRequest(f"'user' must be a string, got {json.dumps(user)}", "user")
        rti = body.get("return_token_ids", False)
        if not isinstance(rti, bool):
            raise BadRequest("'return_token_ids' must be true or false", "return_token_ids")
        req = Request(prompt=ids, max_tokens=max_tokens, emit=lambda ev: None, temperature=temperature,
                      top_k=top_k, top_p=top_p, seed=seed, logprobs=logprobs)
        opts = dict(stream=stream, stop=stop, include_usage=bool(so and so.get("include_usage")),
                    token_ids=rti, chat=chat)
        return req, opts

    def _prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequest("'prompt' must not be empty", "prompt")
            return list(self.tok(prompt)["input_ids"])
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            n = len(self.tok)
            bad = [t for t in prompt if not 0 <= t < n]
            if bad:
                raise BadRequest(f"'prompt' token id {bad[0]} is outside the vocabulary [0, {n})", "prompt")
            return list(prompt)
        if prompt is None:
            raise BadRequest("missing required field 'prompt'", "prompt")
        raise BadRequest("'prompt' must be a string, a list of token ids, or a list holding one of those "
                         "(batches of prompts: send one request each)", "prompt")

    def _chat_prompt(self, messages) -> list[int]:
        if messages is None:
            raise BadRequest("missing required field 'messages'", "messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or set(m) - {"role", "content", "name"} or \
                    m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
                raise BadRequest(f"messages[{i}] must be {{role: system|user|assistant, content: string}}",
                                 "messages")
        msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
        from tensorpar.streaming import chat_prompt_ids
        try:
            return chat_prompt_ids(self.tok, msgs)
        except Exception as e:  # tokenizers without a chat template raise their own errors
            raise BadRequest(f"this model's tokenizer cannot apply a chat template: {e}", "messages") from e

    # ------------------------------------------------------------------ running one request
    def run(self, req: Request, opts: dict):
        """Submit ``req``; return an async iterator of ``(kind, payload)`` events on the caller's loop."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        req.emit = lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev)
        stops = opts["stop"]
        if stops:
            def finish(out):
                text = self.tok.decode(out, skip_special_tokens=True)
                return "stop" if any(s in text for s in stops) else None
            req.finish = finish
        try:
            self.sched.submit(req)
        except QueueFull as e:
            raise BadRequest(str(e), None, status=429, kind="rate_limit_error") from e
        except ValueError as e:             # larger than the KV pool: it could never run
            raise BadRequest(str(e), "max_tokens") from e
        except RuntimeError as e:
            raise BadRequest(str(e), None, status=503, kind="server_error") from e
        return q

    def texts(self, out: list[int], stops: list[str], final: bool) -> str:
        """Text of the generated tokens, cut at the first stop string; unless ``final``, hold back what could
        still become a stop string or an incomplete character."""
        text = self.tok.decode(out, skip_special_tokens=True)
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        if cut >= 0:
            return text[:cut]
        if not final:
            hold = max((len(s) - 1 for s in stops), default=0)
            text = text[:len(text) - hold] if hold else text
            while text.endswith("\ufffd"):
                text = text[:-1]
        return text

    def _token_str(self, t: int) -> str:
        return self.tok.convert_ids_to_tokens(int(t))

    def logprob_entry(self, chat: bool, tok: int, lp: float, top):
        if chat:
            s = self.tok.decode([tok])
            return {"token": s, "logprob": lp, "bytes": list(s.encode()),
                    "top_logprobs": [{"token": self.tok.decode([i]), "logprob": v,
                                      "bytes": list(self.tok.decode([i]).encode())} for i, v in (top or [])]}
        return tok, lp, {self.tok.decode([i]): v for i, v in (top or [])}


def build_app(api: Api):
    """The FastAPI application serving ``api``."""
    from fastapi import FastAPI, Request as HttpRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI(title="tensorpar serve")

    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):      # unknown route, wrong method: OpenAI's error shape
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = (f"{request.method} {request.url.path}: {exc.detail}; this server serves POST /v1/completions, "
                   f"POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics")
        return JSONResponse(error_body(message, kind, None, exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    def err(e: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(e.message, e.kind, e.param, e.status), status_code=e.status)

    @app.get("/health")
    def health():
        if api.sched.failed:
            return JSONResponse({"status": "error", "message": api.sched.failed}, status_code=503)
        if not api.sched.healthy:
            return JSONResponse({"status": "stopping", "message": "the server is shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    def metrics():
        return Response(api.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": api.model_name, "object": "model", "created": 0,
                                            "owned_by": "tensorpar", "max_model_len": api.max_model_len}]}

    async def handle(http: HttpRequest, chat: bool):
        raw = await http.body()
        try:
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BadRequest(f"the request body is not valid JSON: {e}") from e
            req, opts = api.parse(body, chat)
            q = api.run(req, opts)
        except BadRequest as e:
            return err(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        head = dict(id=rid, created=created, model=api.model_name)
        stops = opts["stop"]

        def usage():
            n = len([t for t in req.out if t not in api.sched.eos])
            return {"prompt_tokens": len(req.prompt), "completion_tokens": n, "total_tokens": len(req.prompt) + n}

        offset = [0]            # text_offset: characters of the completion before each token (as vLLM, no echo)

        def lp_block(entries):
            if req.logprobs < 0:
                return None
            if chat:
                return {"content": entries}
            toks, lps, tops = zip(*entries) if entries else ((), (), ())
            strs = [api.tok.decode([t]) for t in toks]
            offsets = []
            for piece in strs:
                offsets.append(offset[0])
                offset[0] += len(piece)
            return {"tokens": strs, "token_logprobs": list(lps), "text_offset": offsets,
                    "top_logprobs": list(tops) if req.logprobs > 0 else None}

        if opts["stream"]:
            async def events():
                sent, n_sent = "", 0
                try:
                    if chat:
                        yield _sse({**head, "object": "chat.completion.chunk", "choices": [
                            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]})
                    entries = []
                    while True:
                        try:
                            ev = await asyncio.wait_for(q.get(), timeout=0.5)
                        except asyncio.TimeoutError:
                            ev = None
                        if await http.is_disconnected():      # the client went away: free the slot
                            return
                        if ev is None:
                            continue
                        if ev[0] == "error":
                            yield _sse(error_body(ev[1], "server_error", None, ev[2] if len(ev) > 2 else 500))
                            break
                        reason = None
                        if ev[0] == "token":
                            _, tok, lp, top, is_eos = ev
                            if lp is not None and not is_eos:
                                entries.append(api.logprob_entry(chat, tok, lp, top))
                            text = api.texts(req.out, stops, final=False)
                        else:
                            reason = ev[1]
                            text = api.texts(req.out, stops, final=True)
                        delta = text[len(sent):] if text.startswith(sent) else ""
                        if delta or reason or (entries[n_sent:] and not stops):
                            new_entries = entries[n_sent:]
                            n_sent = len(entries)
                            sent = text if delta else sent
                            choice = {"index": 0, "finish_reason": reason, "logprobs": lp_block(new_entries)}
                            if chat:
                                choice["delta"] = {"content": delta} if delta or not reason else {}
                            else:
                                choice["text"] = delta
                            if reason and opts["token_ids"]:
                                choice["token_ids"] = [t for t in req.out if t not in api.sched.eos]
                            yield _sse({**head, "object": kind + ("" if not chat else ".chunk"), "choices": [choice]})
                        if reason:
                            if opts["include_usage"]:
                                yield _sse({**head, "object": kind + ("" if not chat else ".chunk"), "choices": [],
                                            "usage": usage()})
                            break
                    yield "data: [DONE]\n\n"
                finally:
                    req.cancel()        # a no-op once done; frees the slot of a client that went away
            return StreamingResponse(events(), media_type="text/event-stream")

        entries, reason = [], None
        gone = asyncio.Event()

        async def watch():      # a client that goes away: the request ends at the next step (tokens or not)
            while not await http.is_disconnected():
                await asyncio.sleep(0.05)
            gone.set()
            req.cancel()

        watcher = asyncio.create_task(watch())
        try:
            while reason is None:
                try:
                    ev = await asyncio.wait_for(q.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    ev = None
                if gone.is_set():
                    return Response(status_code=499)
                if ev is None:
                    continue
                if ev[0] == "error":
                    code = ev[2] if len(ev) > 2 else 500
                    return JSONResponse(error_body(ev[1], "server_error", None, code), status_code=code)
                if ev[0] == "token":
                    _, tok, lp, top, is_eos = ev
                    if lp is not None and not is_eos:
                        entries.append(api.logprob_entry(chat, tok, lp, top))
                else:
                    reason = ev[1]
        finally:
            watcher.cancel()
            req.cancel()
        text = api.texts(req.out, stops, final=True)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=lp_block(entries), finish_reason=reason)
        if opts["token_ids"]:
            choice["token_ids"] = [t for t in req.out if t not in api.sched.eos]
            choice["prompt_token_ids"] = list(req.prompt)
        return {**head, "object": kind, "choices": [choice], "usage": usage()}

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await handle(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await handle(http, chat=True)

    return app


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"
