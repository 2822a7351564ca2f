"""The fake vLLM-shaped upstream of scripts/bench_proxy.py: its own process, one per replica.

Owns the server and nothing else (what is measured and how is ``bench_proxy``'s). It answers every
completion at once with fixed token ids: ``ANSWER``'s ids repeated up to the request's
``max_tokens``, then ``<|im_end|>`` (``answer_ids``), so one server serves every answer length a
run asks for. ``/v1/completions`` (what the appliance's vLLM engine client calls) is written as
vLLM 0.32 writes it for the request's asks: a stream sends one token per event, or with a
request's ``stream_interval`` the first token alone, then that many per event, the rest at the
end; ``return_tokens_as_token_ids`` writes the log-probs' tokens as ``token_id:N``;
``return_token_ids`` adds the sampled ids and, in a stream's first event or a whole answer, all
the prompt's ids. ``/v1/chat/completions`` (what the direct column's clients call) streams one
event per token. Each answer is built per request, as a server builds it (its cost is the
upstream's own CPU that the proxy's is compared with). ``--pace-ms X`` (default 0: at once) makes
a stream as slow as a GPU that samples one token per X ms: the server takes a decode step every X
ms (``DecodeSteps``), at which every running stream gets its next token, and an event goes out
once its tokens' steps have passed (the first included), so an event of ``stream_interval`` tokens
comes that many steps after the last, as vLLM sends it at that decode speed, and the events of all
streams go out together; a whole answer is not delayed.

    python scripts/bench_proxy_upstream.py '{"ids": [...], "end": 151645}' [--max-model-len 2048]
                                           [--pace-ms 0] [--uds PATH]

prints ``{"port": N}`` once it listens on 127.0.0.1 (and on the Unix socket ``PATH`` with
``--uds``, as vLLM does with that flag: what the appliance's engine reaches a server it launches
through), then serves until it is terminated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import orjson
from aiohttp import web

ANSWER = "The answer is 7."


def answer_ids(ids: list[int], end: int, max_tokens: int) -> list[int]:
    """An answer of at most ``max_tokens`` tokens: ``ids`` (``ANSWER``'s) repeated as often as
    they fit whole before the last place, then ``end``."""
    return [*(ids * max(1, (max_tokens - 1) // len(ids))), end][:max_tokens]


class DecodeSteps:
    """The decode steps of an engine on a GPU: one every ``pace_s`` seconds, at which every
    running stream gets its next token at once (vLLM's engine samples one token of each running
    request per step, and its server writes all their events then), not each stream on a clock
    of its own. A stream that starts between two steps gets its first token at the next."""

    def __init__(self, pace_s: float) -> None:
        self.pace_s = pace_s
        #: The streams waiting for the next step, each on a future of its own (a waiter
        #: cancelled, say by its client going away, leaves the step to the others).
        self._waiting: list[asyncio.Future[None]] = []
        self._at = 0.0

    async def after(self, count: int) -> None:
        """Return at the ``count``-th step from now."""
        loop = asyncio.get_running_loop()
        for _ in range(count):
            if not self._waiting:
                # Steps on a fixed grid while streams run; after an idle spell (or a step more
                # than a whole step late), the grid starts again a step from now.
                now = loop.time()
                self._at += self.pace_s
                if self._at < now:
                    self._at = now + self.pace_s
                loop.call_at(self._at, self._take)
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiting.append(waiter)
            await waiter

    def _take(self) -> None:
        waiting, self._waiting = self._waiting, []
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(None)


def upstream_app(ids: list[int], end: int, max_model_len: int, pace_ms: float = 0.0) -> web.Application:
    """A vLLM-shaped server that answers every completion with ``answer_ids``: at once, or a
    stream at one token per ``pace_ms``."""
    text = ANSWER
    answers: dict[int, list[int]] = {}
    whole_chats: dict[int, bytes] = {}

    def answer(body: dict[str, Any]) -> list[int]:
        n = int(body.get("max_tokens") or 16)
        if n not in answers:
            answers[n] = answer_ids(ids, end, n)
        return answers[n]

    def completion(
        ids: list[int], body: dict[str, Any], stream_chunk: bool = False, first: bool = True
    ) -> dict[str, Any]:
        """A completion (or one event of its stream) as vLLM 0.32 writes it for ``body``'s asks:
        ``return_tokens_as_token_ids`` writes the log-probs' tokens as ``token_id:N``;
        ``return_token_ids`` adds the sampled ids and, in a stream's first event or a whole
        answer, the prompt's ids (all of them: a long conversation's are a long array)."""
        tokens = [f"token_id:{t}" if body.get("return_tokens_as_token_ids") else "7" for t in ids]
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": {"token_logprobs": [-0.5] * len(ids), "tokens": tokens, "top_logprobs": None},
            "finish_reason": None if stream_chunk else "stop",
        }
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
            if first:
                choice["prompt_token_ids"] = body["prompt"]
        return {"id": "cmpl-1", "object": "text_completion", "model": "policy", "choices": [choice]}

    def chat(ids: list[int]) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "token_ids": ids, "logprobs": None, "finish_reason": "stop"}
        usage = {"prompt_tokens": 20, "completion_tokens": len(ids), "total_tokens": 20 + len(ids)}
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "policy",
            "choices": [choice],
            "usage": usage,
        }

    headers = {"Content-Type": "application/json"}

    steps = DecodeSteps(pace_ms / 1e3) if pace_ms else None

    async def stream(
        request: web.Request, chunks: list[dict[str, Any]], sizes: list[int] | None = None
    ) -> web.StreamResponse:
        """``chunks`` as server-sent events; paced, each after as many decode steps as it holds
        tokens (``sizes``: the tokens of each; one each if not given)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, chunk in enumerate(chunks):
            if steps is not None:
                await steps.after(sizes[i] if sizes else 1)
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def completions(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        ids = answer(body)
        if not body.get("stream"):
            return web.Response(body=orjson.dumps(completion(ids, body)), headers=headers)
        every = int(body.get("stream_interval") or 1)
        groups = [ids[:1], *(ids[i : i + every] for i in range(1, len(ids), every))]
        chunks = [completion(group, body, stream_chunk=True, first=i == 0) for i, group in enumerate(groups)]
        chunks[-1]["choices"][0]["finish_reason"] = "stop"
        return await stream(request, chunks, [len(group) for group in groups])

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        ids = answer(body)
        if not body.get("stream"):
            if len(ids) not in whole_chats:
                whole_chats[len(ids)] = json.dumps(chat(ids)).encode()
            return web.Response(body=whole_chats[len(ids)], headers=headers)
        chunks = [
            {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "choices": [
                    {"index": 0, "delta": {"content": text if i == 0 else ""}, "finish_reason": None}
                ],
            }
            for i in range(len(ids))
        ]
        chunks[-1]["choices"] = [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}]
        return await stream(request, chunks)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "policy", "max_model_len": max_model_len}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    return app


async def serve(
    ids: list[int], end: int, max_model_len: int, pace_ms: float = 0.0, uds: str | None = None
) -> None:
    runner = web.AppRunner(upstream_app(ids, end, max_model_len, pace_ms), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    port = runner.addresses[0][1]
    if uds is not None:
        await web.UnixSite(runner, uds, backlog=4096).start()
    print(json.dumps({"port": port}), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("answer", help='JSON {"ids": ANSWER\'s token ids, "end": the end token id}')
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--pace-ms", type=float, default=0.0, help="a stream's milliseconds per token")
    parser.add_argument("--uds", help="also listen on this Unix socket")
    args = parser.parse_args()
    spec = json.loads(args.answer)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(spec["ids"], spec["end"], args.max_model_len, args.pace_ms, args.uds))
