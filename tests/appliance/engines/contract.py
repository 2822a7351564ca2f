"""The contract every ``Engine`` keeps, as a test class to subclass once per implementation.

A subclass provides an ``engine`` fixture: a started engine serving the tiny model
(``tiny_model_dir``) at policy version 0 with its original weights, closed afterwards. Tests
may change its weights or close it. Everything here goes through the ``Engine`` protocol alone,
so the same tests hold the torch engine and the vLLM engine to one behaviour.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from appliance.engines.base import Engine, GenerateRequest, GenerateResult, SamplingParams, TokenCallback
from contracts.errors import BadRequest, ContextTooLong, EngineUnavailable

#: Eight prompts of different lengths (1 to 15 tokens), so batching has to pad.
PROMPTS: list[list[int]] = [[1, *range(100 + 37 * i, 100 + 37 * i + 2 * i)] for i in range(8)]


def greedy(max_tokens: int, stop: Sequence[int] = ()) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=tuple(stop))


def first_token(event: asyncio.Event) -> TokenCallback:
    """A streaming callback that sets ``event`` once a token is sampled: the request is running."""
    return lambda token, logprob: event.set()


async def generate(engine: Engine, prompt: Sequence[int], params: SamplingParams) -> GenerateResult:
    return await engine.generate(GenerateRequest(prompt_ids=list(prompt), params=params))


async def unsampled_id(engine: Engine, prompt: Sequence[int], max_tokens: int) -> int:
    """A token id that greedy decoding of ``prompt`` does not produce within ``max_tokens``.

    Used as the stop id when a test needs a run to go to its length: with no stop ids the
    engine stops at the model's end-of-sequence token, which a random model may well pick.
    """
    candidate = 3
    while True:
        result = await generate(engine, prompt, greedy(max_tokens, [candidate]))
        if result.finish_reason == "length":
            return candidate
        candidate += 1


def teacher_forced(
    model: Any, prompt: Sequence[int], completion: Sequence[int], temperature: float
) -> list[float]:
    """log p(completion[t] | prompt, completion[:t]) from one forward pass over the whole sequence."""
    ids = torch.tensor([[*prompt, *completion]])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    # Row i of the logits predicts token i + 1: the completion is predicted by rows
    # len(prompt) - 1 .. len(ids) - 2.
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1] / (temperature or 1.0), dim=-1)
    return logp.gather(1, torch.tensor(completion)[:, None]).squeeze(1).tolist()


class EngineContract:
    """Subclass as ``class TestXEngine(EngineContract)`` and override the ``engine`` fixture."""

    #: How close reported log-probs must be to a teacher-forced float32 forward pass.
    logprob_atol: float = 1e-4
    #: A stop id no sampled token can equal, for runs that must go on to their length whatever
    #: the model samples (an empty stop list would stop at the model's end-of-sequence token).
    unreachable_stop_id: int = -1

    @pytest.fixture
    async def engine(self) -> AsyncIterator[Engine]:
        raise NotImplementedError("subclasses provide a started engine serving tiny_model_dir")
        yield

    @pytest.fixture(scope="class")
    def reference_model(self, tiny_model_dir: Path) -> Any:
        model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        return model.eval()

    async def test_result_shape(self, engine: Engine) -> None:
        assert isinstance(engine, Engine)
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=0)
        result = await generate(engine, PROMPTS[3], params)
        assert 1 <= len(result.token_ids) <= 12
        assert len(result.logprobs) == len(result.token_ids)
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in result.logprobs)
        assert result.finish_reason in ("stop", "length")
        assert result.policy_version == engine.policy_version == 0
        assert result.queue_s >= 0.0 and result.gen_s >= 0.0

    async def test_max_tokens_gives_length(self, engine: Engine) -> None:
        stop = await unsampled_id(engine, PROMPTS[2], 6)
        result = await generate(engine, PROMPTS[2], greedy(6, [stop]))
        assert result.finish_reason == "length"
        assert len(result.token_ids) == len(result.logprobs) == 6

    async def test_stop_token_ends_generation_and_is_returned(self, engine: Engine) -> None:
        stop = await unsampled_id(engine, PROMPTS[5], 10)
        full = await generate(engine, PROMPTS[5], greedy(10, [stop]))
        target = full.token_ids[4]
        cut = full.token_ids.index(target) + 1
        result = await generate(engine, PROMPTS[5], greedy(10, [stop, target]))
        assert result.finish_reason == "stop"
        assert result.token_ids == full.token_ids[:cut]
        assert result.token_ids[-1] == target
        assert result.logprobs == pytest.approx(full.logprobs[:cut], abs=self.logprob_atol)

    async def test_greedy_is_deterministic_and_batch_invariant(self, engine: Engine) -> None:
        params = greedy(12, [await unsampled_id(engine, PROMPTS[0], 12)])
        one_at_a_time = [await generate(engine, prompt, params) for prompt in PROMPTS]
        batched = await asyncio.gather(*(generate(engine, prompt, params) for prompt in PROMPTS))
        again = await asyncio.gather(*(generate(engine, prompt, params) for prompt in PROMPTS))
        for alone, together, repeat in zip(one_at_a_time, batched, again, strict=True):
            assert together.token_ids == alone.token_ids == repeat.token_ids
            assert together.logprobs == pytest.approx(alone.logprobs, abs=self.logprob_atol)
        assert len({r.token_ids for r in one_at_a_time}) > 1  # the prompts matter

    async def test_tokens_handed_over_in_batches_are_every_token_in_order(self, engine: Engine) -> None:
        """``token_batch`` lets an engine hand streamed tokens over several at a time: the
        callback still sees every token, in order, and the result is the one-by-one result."""
        stop = await unsampled_id(engine, PROMPTS[6], 20)
        results: list[GenerateResult] = []
        for batch in (1, 8):
            seen: list[tuple[int, float]] = []

            def on_token(token: int, logprob: float, seen: list[tuple[int, float]] = seen) -> None:
                seen.append((token, logprob))

            request = GenerateRequest(
                prompt_ids=PROMPTS[6], params=greedy(20, [stop]), on_token=on_token, token_batch=batch
            )
            result = await engine.generate(request)
            assert [t for t, _ in seen] == list(result.token_ids)
            assert [lp for _, lp in seen] == list(result.logprobs)
            results.append(result)
        one_by_one, batched = results
        assert batched.token_ids == one_by_one.token_ids and len(batched.token_ids) == 20
        assert batched.logprobs == pytest.approx(one_by_one.logprobs, abs=self.logprob_atol)

    async def test_tokens_go_once_each_to_one_of_the_two_callbacks(self, engine: Engine) -> None:
        """An engine may hand groups of tokens to ``on_tokens`` instead of each to ``on_token``
        (bounded in time or not): between the two, every token comes once, in order."""
        stop = await unsampled_id(engine, PROMPTS[6], 20)
        for batch, wait_s in ((1, 0.0), (8, 0.0), (8, 0.02)):
            seen: list[tuple[int, float]] = []

            def on_tokens(ids: Sequence[int], logprobs: Sequence[float], seen: list[Any] = seen) -> None:
                assert len(ids) == len(logprobs) > 0
                seen.extend(zip(ids, logprobs, strict=True))

            def on_token(token: int, logprob: float, seen: list[Any] = seen) -> None:
                seen.append((token, logprob))

            request = GenerateRequest(
                prompt_ids=PROMPTS[6],
                params=greedy(20, [stop]),
                on_token=on_token,
                on_tokens=on_tokens,
                token_batch=batch,
                batch_wait_s=wait_s,
            )
            result = await engine.generate(request)
            assert [t for t, _ in seen] == list(result.token_ids) and len(seen) == 20
            assert [lp for _, lp in seen] == list(result.logprobs)

    async def test_seeded_sampling_is_reproducible(self, engine: Engine) -> None:
        params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
        alone = await generate(engine, PROMPTS[4], params)
        others = [SamplingParams(max_tokens=16, temperature=0.8, seed=i) for i in range(3)]
        in_batch, *_ = await asyncio.gather(
            generate(engine, PROMPTS[4], params),
            *(generate(engine, PROMPTS[i], p) for i, p in enumerate(others)),
        )
        assert in_batch.token_ids == alone.token_ids
        assert in_batch.logprobs == pytest.approx(alone.logprobs, abs=self.logprob_atol)
        reseeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=4321)
        assert (await generate(engine, PROMPTS[4], reseeded)).token_ids != alone.token_ids

    @pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.8), (0.0, 1.0)])
    async def test_logprobs_match_teacher_forcing(
        self, engine: Engine, reference_model: Any, temperature: float, top_p: float
    ) -> None:
        """What the trainer relies on: the logprobs are the tempered policy's, unfiltered by top_p."""
        params = [
            SamplingParams(max_tokens=16, temperature=temperature, top_p=top_p, seed=i) for i in range(4)
        ]
        prompts = [PROMPTS[1], PROMPTS[7], PROMPTS[0], PROMPTS[6]]
        results = await asyncio.gather(
            *(generate(engine, q, p) for q, p in zip(prompts, params, strict=True))
        )
        for prompt, result in zip(prompts, results, strict=True):
            expected = teacher_forced(reference_model, prompt, result.token_ids, temperature)
            assert result.logprobs == pytest.approx(expected, abs=self.logprob_atol)

    @pytest.mark.parametrize("k", [0, 3])
    async def test_prompt_logprobs_match_teacher_forcing(
        self, engine: Engine, reference_model: Any, k: int
    ) -> None:
        """Scoring prompts (``echo`` with ``logprobs``): the raw model's log p(prompt[j] |
        prompt[:j]) and its k most likely tokens, for prompts of different lengths batched
        together, whatever the sampling of the completion."""
        prompts = [PROMPTS[7], PROMPTS[0], PROMPTS[3]]
        params = SamplingParams(max_tokens=2, temperature=0.5, top_p=0.5, seed=0)
        requests = [GenerateRequest(prompt_ids=q, params=params, prompt_logprobs=k) for q in prompts]
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
        for prompt, result in zip(prompts, results, strict=True):
            with torch.no_grad():
                logp = torch.log_softmax(
                    reference_model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1
                )
            expected = logp.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1).tolist()
            assert len(result.prompt_logprobs) == len(result.prompt_top_logprobs) == len(prompt)
            assert result.prompt_logprobs[0] is None and result.prompt_top_logprobs[0] == ()
            assert result.prompt_logprobs[1:] == pytest.approx(expected, abs=self.logprob_atol)
            values, ids = logp.topk(k, dim=-1)
            for top, want_ids, want_values in zip(
                result.prompt_top_logprobs[1:], ids.tolist(), values.tolist(), strict=True
            ):
                assert [t for t, _ in top] == want_ids
                assert [v for _, v in top] == pytest.approx(want_values, abs=self.logprob_atol)
        plain = await generate(engine, PROMPTS[3], params)
        assert plain.prompt_logprobs == () and plain.prompt_top_logprobs == ()
        streamed: list[int] = []
        request = GenerateRequest(
            prompt_ids=PROMPTS[3], params=params, prompt_logprobs=k, on_token=lambda t, lp: streamed.append(t)
        )
        result = await engine.generate(request)
        assert streamed == list(result.token_ids)
        assert result.prompt_logprobs == pytest.approx(results[2].prompt_logprobs, abs=self.logprob_atol)

    async def test_tiny_top_p_is_greedy(self, engine: Engine) -> None:
        stop = await unsampled_id(engine, PROMPTS[6], 8)
        nucleus = SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6, seed=5, stop_token_ids=(stop,))
        sampled = await generate(engine, PROMPTS[6], nucleus)
        argmax = await generate(engine, PROMPTS[6], greedy(8, [stop]))
        assert sampled.token_ids == argmax.token_ids
        # Both report the temperature-1 log-probs of the full distribution, not of the nucleus.
        assert sampled.logprobs == pytest.approx(argmax.logprobs, abs=self.logprob_atol)
        assert all(lp < -1e-3 for lp in sampled.logprobs)

    async def test_top_k_one_is_greedy(self, engine: Engine) -> None:
        """Top-k 1 keeps the most likely token alone, whatever the temperature and top-p, in a
        batch with rows that sample freely; the log-probs reported are the uncut policy's."""
        stop = await unsampled_id(engine, PROMPTS[6], 8)
        cut = [
            SamplingParams(max_tokens=8, temperature=1.0, top_k=1, seed=5, stop_token_ids=(stop,)),
            SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, top_k=1, stop_token_ids=(stop,)),
        ]
        free = SamplingParams(max_tokens=8, temperature=1.0, seed=5, stop_token_ids=(stop,))
        *sampled, unfiltered = await asyncio.gather(
            *(generate(engine, PROMPTS[6], params) for params in cut), generate(engine, PROMPTS[6], free)
        )
        argmax = await generate(engine, PROMPTS[6], greedy(8, [stop]))
        for result in sampled:
            assert result.token_ids == argmax.token_ids
            assert result.logprobs == pytest.approx(argmax.logprobs, abs=self.logprob_atol)
        assert all(lp < -1e-3 for lp in argmax.logprobs)
        assert unfiltered.token_ids != argmax.token_ids  # the same seed without the cut: not greedy

    async def test_top_k_samples_among_the_k_most_likely(self, engine: Engine, reference_model: Any) -> None:
        """Every token sampled with top_k 3 is among the reference model's three most likely
        there, and its log-prob is the temperature-1 policy's before the cut."""
        k = 3
        params = [
            SamplingParams(
                max_tokens=16, temperature=1.0, top_k=k, seed=i, stop_token_ids=(self.unreachable_stop_id,)
            )
            for i in range(6)
        ]
        prompts = [PROMPTS[i] for i in (1, 7, 0, 6, 3, 5)]
        results = await asyncio.gather(
            *(generate(engine, q, p) for q, p in zip(prompts, params, strict=True))
        )
        ranks: list[int] = []
        for prompt, result in zip(prompts, results, strict=True):
            ids = torch.tensor([[*prompt, *result.token_ids]])
            with torch.no_grad():
                logits = reference_model(ids).logits[0, len(prompt) - 1 : -1].float()
            logp = torch.log_softmax(logits, dim=-1)
            chosen = logp.gather(1, torch.tensor(result.token_ids)[:, None]).squeeze(1)
            # Within the engines' float tolerance of the k-th most likely: among the top k.
            assert bool((chosen >= logp.topk(k).values[:, -1] - self.logprob_atol).all())
            assert result.logprobs == pytest.approx(chosen.tolist(), abs=self.logprob_atol)
            ranks += (logp > chosen[:, None]).sum(dim=-1).tolist()
        assert set(ranks) == {0, 1, 2}  # it does sample, not just take the argmax

    async def test_cancel_stops_generation(self, engine: Engine) -> None:
        short = greedy(8, [await unsampled_id(engine, PROMPTS[3], 8)])
        expected = await generate(engine, PROMPTS[3], short)
        long = greedy(engine.max_context - len(PROMPTS[0]), [self.unreachable_stop_id])
        # vLLM samples the tiny model's context in a fraction of a second and may stream all of it
        # before this test wakes to its first token: a request that ended by then is tried again
        # (one that failed raises here).
        for _attempt in range(5):
            sampling = asyncio.Event()
            task = asyncio.create_task(
                engine.generate(
                    GenerateRequest(prompt_ids=list(PROMPTS[0]), params=long, on_token=first_token(sampling))
                )
            )
            await asyncio.wait_for(sampling.wait(), 60)
            if not task.done():
                break
            await task
        assert not task.done(), "the long generation ended before it could be cancelled, 5 times"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        started = time.monotonic()
        after = await asyncio.wait_for(generate(engine, PROMPTS[3], short), timeout=10)
        # Had the cancelled row kept decoding, this would wait for ~2000 more tokens.
        assert time.monotonic() - started < 1.5
        assert after.token_ids == expected.token_ids  # its own result, nothing of the cancelled one

    async def test_load_weights_changes_output_and_version(
        self, engine: Engine, reference_model: Any
    ) -> None:
        original = {k: v.detach().clone() for k, v in reference_model.state_dict().items()}
        noise = torch.Generator().manual_seed(0)
        perturbed = {k: v + 0.1 * torch.randn(v.shape, generator=noise) for k, v in original.items()}
        params = greedy(40, [await unsampled_id(engine, PROMPTS[2], 40)])
        before = await generate(engine, PROMPTS[2], params)

        # A swap requested mid-generation waits for the batch: no row mixes two policies.
        running = asyncio.create_task(generate(engine, PROMPTS[2], params))
        await asyncio.sleep(0.01)
        await engine.load_weights(perturbed, 1)
        during = await running
        assert during.token_ids == before.token_ids and during.policy_version == 0

        assert engine.policy_version == 1
        after = await generate(engine, PROMPTS[2], params)
        assert after.policy_version == 1
        assert after.token_ids != before.token_ids

        await engine.load_weights(original, 2)
        restored = await generate(engine, PROMPTS[2], params)
        assert (restored.token_ids, restored.policy_version) == (before.token_ids, 2)

    async def test_closed_engine_fails_pending_and_new_requests(self, engine: Engine) -> None:
        long = greedy(1000, [self.unreachable_stop_id])
        # Closed once each has sampled its first token: a tiny model on a quiet machine can
        # sample 1000 tokens before a fixed pause ends, and a finished request fails nothing.
        started = [asyncio.Event() for _ in range(3)]

        pending = [
            asyncio.create_task(
                engine.generate(
                    GenerateRequest(prompt_ids=list(PROMPTS[i]), params=long, on_token=first_token(event))
                )
            )
            for i, event in enumerate(started)
        ]
        async with asyncio.timeout(60):
            for event in started:
                await event.wait()
        await engine.close()
        for task in pending:
            with pytest.raises(EngineUnavailable):
                await task
        with pytest.raises(EngineUnavailable):
            await generate(engine, PROMPTS[0], greedy(4))
        with pytest.raises(EngineUnavailable):
            await engine.load_weights({}, 1)
        await engine.close()  # idempotent

    async def test_context_limits(self, engine: Engine) -> None:
        limit = engine.max_context
        assert limit > 0
        with pytest.raises(ContextTooLong):
            await generate(engine, [5] * limit, greedy(1))
        with pytest.raises(ContextTooLong):
            await generate(engine, [5] * (limit - 4), greedy(5))
        with pytest.raises(BadRequest):
            await generate(engine, [], greedy(1))
        fits = await generate(engine, [5] * (limit - 1), greedy(1))
        assert len(fits.token_ids) == 1
