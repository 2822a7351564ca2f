"""The torch engine: the engine contract, plus what only this implementation promises."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import pytest_asyncio
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from appliance.engines.base import GenerateRequest, GenerateResult, SamplingParams, validate_request
from appliance.engines.sampling import NUCLEUS_CANDIDATES, draw_rows
from appliance.engines.torch_engine import TorchEngine
from contracts.errors import ApplianceError, BadRequest, EngineUnavailable
from tests.appliance.engines.contract import PROMPTS, EngineContract, generate, greedy, unsampled_id
from trainer.buckets import WeightBucket, pack_buckets, stream_buckets
from trainer.policy import PolicyTrainer

#: A stop id no sampled token equals: runs go on to their length.
NEVER = -1


class TestTorchEngine(EngineContract):
    @pytest_asyncio.fixture(loop_scope="function")
    async def engine(self, tiny_model_dir: Path) -> AsyncIterator[TorchEngine]:
        engine = TorchEngine(tiny_model_dir, max_batch_size=8)
        await engine.start()
        yield engine
        await engine.close()

    async def test_default_stop_is_the_models_eos(self, engine: TorchEngine) -> None:
        stop = await unsampled_id(engine, PROMPTS[1], 10)
        full = await generate(engine, PROMPTS[1], greedy(10, [stop]))
        assert engine._eos_ids == {2}  # <|im_end|>, from config and generation_config
        engine._eos_ids = frozenset({full.token_ids[3]})
        result = await generate(engine, PROMPTS[1], greedy(10))
        assert result.finish_reason == "stop"
        assert result.token_ids == full.token_ids[: full.token_ids.index(full.token_ids[3]) + 1]

    @pytest.mark.parametrize(
        "params",
        [
            SamplingParams(max_tokens=0),
            SamplingParams(temperature=-0.5),
            SamplingParams(temperature=float("nan")),
            SamplingParams(top_p=0.0),
            SamplingParams(top_p=1.5),
            SamplingParams(top_p=float("nan")),
            SamplingParams(top_k=-1),
            SamplingParams(top_k=2.5),  # type: ignore[arg-type]
            SamplingParams(temperature=float("inf")),
            SamplingParams(temperature=1e-7),  # overflows float32 logits; 0 is greedy
            SamplingParams(seed=2**63),
            SamplingParams(seed=-(2**63) - 1),
            SamplingParams(top_logprobs=21),
            SamplingParams(top_logprobs=-1),
            SamplingParams(max_tokens=2**70),
            SamplingParams(stop_token_ids=(1.5,)),  # type: ignore[arg-type]
        ],
    )
    async def test_rejects_bad_params(self, engine: TorchEngine, params: SamplingParams) -> None:
        with pytest.raises(BadRequest):
            await generate(engine, PROMPTS[1], params)

    async def test_rejects_ids_outside_the_vocabulary(self, engine: TorchEngine) -> None:
        for bad in ([1, -1], [1, 10**6]):
            with pytest.raises(BadRequest, match="token ids"):
                await generate(engine, bad, greedy(2))

    async def test_load_weights_checks_keys_and_shapes(
        self, engine: TorchEngine, reference_model: Any
    ) -> None:
        weights = dict(reference_model.state_dict())
        with pytest.raises(BadRequest, match="missing"):
            await engine.load_weights({k: v for k, v in weights.items() if "layers.1." not in k}, 1)
        with pytest.raises(BadRequest, match="wrong shapes"):
            await engine.load_weights({**weights, "model.norm.weight": torch.ones(3)}, 1)
        assert engine.policy_version == 0
        # A tied lm_head may be left out, as safetensors checkpoints do.
        await engine.load_weights({k: v for k, v in weights.items() if k != "lm_head.weight"}, 7)
        assert engine.policy_version == 7

    async def test_cancelled_rows_leave_the_batch(self, engine: TorchEngine) -> None:
        long = greedy(1500, [self.unreachable_stop_id])
        tasks = [asyncio.create_task(generate(engine, PROMPTS[i], long)) for i in range(3)]
        await asyncio.sleep(0.2)
        assert len(engine._running) == 3
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(50):  # the decode thread notices within one step
            if not engine._running:
                break
            await asyncio.sleep(0.01)
        assert not engine._running
        assert all(task.cancelled() for task in tasks)

    async def test_not_started(self, tiny_model_dir: Path) -> None:
        engine = TorchEngine(tiny_model_dir)
        with pytest.raises(EngineUnavailable, match="not been started"):
            await generate(engine, PROMPTS[0], greedy(2))
        await engine.close()
        with pytest.raises(EngineUnavailable):
            await engine.start()


@pytest.mark.gpu
class TestTorchEngineCuda(EngineContract):
    @pytest_asyncio.fixture(loop_scope="function")
    async def engine(self, tiny_model_dir: Path) -> AsyncIterator[TorchEngine]:
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        engine = TorchEngine(tiny_model_dir, device="cuda", max_batch_size=8)
        await engine.start()
        yield engine
        await engine.close()


async def test_sleep_refuses_generation_until_woken(tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir)
    await engine.start()
    try:
        request = GenerateRequest(prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=3, temperature=0))
        before = await engine.generate(request)
        await engine.sleep(1)
        assert engine.is_sleeping
        with pytest.raises(EngineUnavailable):
            await engine.generate(request)
        await engine.wake(["weights"])
        assert engine.is_sleeping
        await engine.wake(["kv_cache"])
        assert not engine.is_sleeping
        assert (await engine.generate(request)).token_ids == before.token_ids
    finally:
        await engine.close()


# --- continuous batching: requests join and leave a running batch between steps -------------

#: A prompt far wider than the running batch's cache when it joins (which pads the running rows).
WIDE_PROMPT: list[int] = [1, *((7 * i) % 900 + 50 for i in range(299))]


@pytest_asyncio.fixture(loop_scope="function")
async def joining(tiny_model_dir: Path) -> AsyncIterator[TorchEngine]:
    engine = TorchEngine(tiny_model_dir, max_batch_size=8)
    await engine.start()
    yield engine
    await engine.close()


class StepRecorder:
    """Records (rows, cache width) before every decode step of ``engine``, for white-box checks."""

    def __init__(self, engine: TorchEngine) -> None:
        self.seen: list[tuple[int, int]] = []
        self._loop = asyncio.get_running_loop()
        self._waiters: list[tuple[int, asyncio.Event]] = []
        step = engine._step

        def recording(batch: Any) -> Any:
            self.seen.append((len(batch.rows), int(batch.mask.shape[1])))
            self._loop.call_soon_threadsafe(self._notify)
            return step(batch)

        engine._step = recording  # type: ignore[method-assign]

    def _notify(self) -> None:
        for count, event in self._waiters:
            if len(self.seen) >= count:
                event.set()

    async def steps(self, count: int) -> None:
        """Return once ``count`` steps have started."""
        event = asyncio.Event()
        self._waiters.append((count, event))
        self._notify()
        await event.wait()


async def alone(engine: TorchEngine, prompt: list[int], params: SamplingParams) -> GenerateResult:
    return await generate(engine, prompt, params)


def assert_same(got: GenerateResult, expected: GenerateResult) -> None:
    assert got.token_ids == expected.token_ids
    assert got.finish_reason == expected.finish_reason
    assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-5)


async def test_a_request_joins_a_running_generation_and_finishes_first(joining: TorchEngine) -> None:
    long, short = greedy(400, [NEVER]), greedy(12, [NEVER])
    expected_long = await alone(joining, PROMPTS[0], long)
    expected = [await alone(joining, p, short) for p in (PROMPTS[5], WIDE_PROMPT, PROMPTS[1])]
    recorder = StepRecorder(joining)
    widths = recorder.seen

    first = asyncio.create_task(generate(joining, PROMPTS[0], long))
    await recorder.steps(20)  # the long row is decoding
    late = await asyncio.gather(*(generate(joining, p, short) for p in (PROMPTS[5], WIDE_PROMPT, PROMPTS[1])))
    assert not first.done(), "the joiners finished while the long generation still ran"
    for got, want in zip(late, expected, strict=True):
        assert_same(got, want)
        assert got.queue_s < 0.5  # started at the next step, not after 400 tokens
    assert_same(await first, expected_long)
    assert max(rows for rows, _ in widths) == 4
    # The wide joiner padded the running row to its width; once it left, the width shrank back.
    assert max(w for _, w in widths) >= len(WIDE_PROMPT)
    assert widths[-1] == (1, len(PROMPTS[0]) + 398)


async def test_joined_rows_keep_seeds_top_logprobs_and_streams(joining: TorchEngine) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.8, seed=11, top_logprobs=3)
    expected = await alone(joining, PROMPTS[3], params)
    streamed: list[tuple[int, float]] = []
    request = GenerateRequest(
        prompt_ids=PROMPTS[3], params=params, on_token=lambda t, lp: streamed.append((t, lp))
    )
    recorder = StepRecorder(joining)
    first = asyncio.create_task(generate(joining, PROMPTS[2], greedy(300, [NEVER])))
    await recorder.steps(10)
    got = await joining.generate(request)
    assert not first.done()
    assert_same(got, expected)
    assert [t for t, _ in streamed] == list(got.token_ids)
    for top, want in zip(got.top_logprobs, expected.top_logprobs, strict=True):
        assert [t for t, _ in top] == [t for t, _ in want]
        assert [lp for _, lp in top] == pytest.approx([lp for _, lp in want], abs=1e-5)
    assert len(got.top_logprobs) == len(got.token_ids) and all(len(t) == 3 for t in got.top_logprobs)
    await first


async def test_rows_leaving_trim_the_cache_and_stay_exact(joining: TorchEngine) -> None:
    wide, narrow = greedy(3, [NEVER]), greedy(40, [NEVER])
    expected = [await alone(joining, WIDE_PROMPT, wide), await alone(joining, PROMPTS[4], narrow)]
    widths = StepRecorder(joining).seen
    results = await asyncio.gather(
        generate(joining, WIDE_PROMPT, wide), generate(joining, PROMPTS[4], narrow)
    )
    for got, want in zip(results, expected, strict=True):
        assert_same(got, want)
    assert widths[0] == (2, len(WIDE_PROMPT))
    # After the wide row left, only the narrow row's own columns remain.
    assert widths[-1] == (1, len(PROMPTS[4]) + 38)


async def test_the_batch_never_exceeds_max_batch_size(tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir, max_batch_size=2)
    await engine.start()
    try:
        params = greedy(15, [NEVER])
        expected = [await alone(engine, p, params) for p in PROMPTS[:5]]
        widths = StepRecorder(engine).seen
        results = await asyncio.gather(*(generate(engine, p, params) for p in PROMPTS[:5]))
        for got, want in zip(results, expected, strict=True):
            assert_same(got, want)
        assert max(rows for rows, _ in widths) == 2
        # The first two waited for nothing; the fifth waited for two rows to finish.
        assert results[4].queue_s > results[0].queue_s
    finally:
        await engine.close()


async def test_without_joining_newcomers_wait_for_the_batch(joining: TorchEngine) -> None:
    joining._joinable = False  # as for sliding-window or linear-attention caches
    first = asyncio.create_task(generate(joining, PROMPTS[0], greedy(200, [NEVER])))
    await asyncio.sleep(0.05)
    late = await generate(joining, PROMPTS[1], greedy(2))
    assert first.done() and late.queue_s > 0.02


async def test_a_cancelled_row_leaves_while_others_continue_exactly(joining: TorchEngine) -> None:
    params = greedy(60, [NEVER])
    expected = await alone(joining, PROMPTS[6], params)
    doomed = asyncio.create_task(generate(joining, PROMPTS[0], greedy(1500, [NEVER])))
    kept = asyncio.create_task(generate(joining, PROMPTS[6], params))
    await asyncio.sleep(0.02)
    doomed.cancel()
    assert_same(await kept, expected)
    assert doomed.cancelled()


async def test_requests_queued_during_a_swap_get_the_new_weights(
    joining: TorchEngine, tiny_model_dir: Path
) -> None:
    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    perturbed = {k: v + 0.1 for k, v in model.state_dict().items()}
    running = asyncio.create_task(generate(joining, PROMPTS[0], greedy(200, [NEVER])))
    await asyncio.sleep(0.02)
    swap = asyncio.create_task(joining.load_weights(perturbed, 3))
    await asyncio.sleep(0)
    queued = asyncio.create_task(generate(joining, PROMPTS[1], greedy(4)))
    assert (await running).policy_version == 0
    await swap
    assert (await queued).policy_version == 3


async def test_sleep_level_2_discards_weights_until_load(joining: TorchEngine, tiny_model_dir: Path) -> None:
    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    params = greedy(10, [NEVER])
    before = await generate(joining, PROMPTS[2], params)

    await joining.sleep(2)
    assert sum(p.numel() for p in joining._model.parameters()) == 0  # the memory is gone
    await joining.wake()
    assert not joining.is_sleeping
    with pytest.raises(EngineUnavailable, match="load_weights"):
        await generate(joining, PROMPTS[2], params)
    await joining.load_weights(original, 1)
    assert (await generate(joining, PROMPTS[2], params)).token_ids == before.token_ids

    # The peers' order: sleep, push the new weights, then wake.
    await joining.sleep(2)
    await joining.load_weights(original, 2)
    await joining.wake(["weights"])
    await joining.wake(["kv_cache"])
    after = await generate(joining, PROMPTS[2], params)
    assert (after.token_ids, after.policy_version) == (before.token_ids, 2)
    assert joining._model.lm_head.weight is joining._model.model.embed_tokens.weight  # still tied


async def test_requests_queued_when_the_engine_falls_asleep_fail(joining: TorchEngine) -> None:
    running = asyncio.create_task(generate(joining, PROMPTS[0], greedy(100, [NEVER])))
    await asyncio.sleep(0.02)
    sleeping = asyncio.create_task(joining.sleep(1))
    await asyncio.sleep(0)
    queued = asyncio.create_task(generate(joining, PROMPTS[1], greedy(4)))
    assert (await running).finish_reason == "length"  # sleep waits for running rows
    await sleeping
    with pytest.raises(EngineUnavailable, match="sleep"):
        await queued
    await joining.wake()
    assert len((await generate(joining, PROMPTS[1], greedy(4))).token_ids) >= 1


# --- bucketed weight loads: the trainer's tensors straight into the parameters --------------


def exists(path: str) -> bool:
    return Path(path).exists()


def perturbed(model: Any, seed: int) -> None:
    """Add noise to every parameter of ``model`` in place (a tied head moves with its embedding)."""
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=noise))


async def test_trainer_weights_in_buckets_are_served_bit_for_bit(
    joining: TorchEngine, tiny_model_dir: Path
) -> None:
    trainer = PolicyTrainer(tiny_model_dir)
    perturbed(trainer.model, 3)
    paths: list[str] = []

    async def watched() -> AsyncIterator[WeightBucket]:
        async for bucket in stream_buckets(trainer.weight_buckets(4096)):
            paths.append(bucket.path)
            yield bucket

    params = greedy(12, [NEVER])
    before = await generate(joining, PROMPTS[3], params)
    await joining.load_weight_buckets(watched(), 4)
    assert joining.policy_version == 4
    assert len(paths) > 3 and len(set(paths)) == 1 and not exists(paths[0])
    source, served = trainer.model.state_dict(), joining._model.state_dict()
    assert source.keys() == served.keys()
    for name, tensor in source.items():
        assert torch.equal(served[name], tensor), name
    assert joining._model.lm_head.weight is joining._model.model.embed_tokens.weight  # still tied
    after = await generate(joining, PROMPTS[3], params)
    assert after.policy_version == 4 and after.token_ids != before.token_ids

    # Cast on the way (a bfloat16 push into a float32 engine), after a level-2 sleep.
    await joining.sleep(2)
    await joining.wake()
    await joining.load_weight_buckets(stream_buckets(trainer.weight_buckets(1 << 20, torch.bfloat16)), 5)
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(joining._model.state_dict()[name], tensor.to(torch.bfloat16).float()), name
    assert (await generate(joining, PROMPTS[3], params)).policy_version == 5


async def test_buckets_that_do_not_fit_are_refused_and_a_mix_is_never_served(
    joining: TorchEngine, tiny_model_dir: Path
) -> None:
    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    perturbed(model, 4)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    params = greedy(10, [NEVER])
    before = await generate(joining, PROMPTS[2], params)

    def push(items: dict[str, torch.Tensor], bucket_bytes: int = 2048) -> AsyncIterator[WeightBucket]:
        return stream_buckets(pack_buckets(items.items(), bucket_bytes=bucket_bytes))

    # A bad first bucket: nothing is copied, the old weights serve on.
    with pytest.raises(BadRequest, match="unexpected"):
        await joining.load_weight_buckets(push({"model.nope": torch.ones(3), **state}), 1)
    with pytest.raises(BadRequest, match="wrong shapes"):
        bad = {"model.norm.weight": torch.ones(3)} | {k: v for k, v in state.items() if "norm" not in k}
        await joining.load_weight_buckets(push(bad), 1)
    again = await generate(joining, PROMPTS[2], params)
    assert (again.token_ids, again.logprobs, joining.policy_version) == (before.token_ids, before.logprobs, 0)

    # A parameter missing at the end, a name sent twice, a stream that stops before its last
    # bucket: some weights were copied, so the engine refuses to serve until a load completes.
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    twice = [*state.items(), ("model.norm.weight", state["model.norm.weight"])]

    async def cut_short() -> AsyncIterator[WeightBucket]:
        async for bucket in push(state):
            if bucket.last:
                return
            yield bucket

    failures = [
        (push(missing), "missing"),
        (stream_buckets(pack_buckets(twice, bucket_bytes=2048)), "repeated"),
        (cut_short(), "before their last bucket"),
    ]
    for stream, message in failures:
        with pytest.raises(BadRequest, match=message):
            await joining.load_weight_buckets(stream, 1)
        assert joining.policy_version == 0
        with pytest.raises(EngineUnavailable, match="no complete weights"):
            await generate(joining, PROMPTS[2], params)

    await joining.load_weight_buckets(push(state), 2)
    assert joining.policy_version == 2
    assert (await generate(joining, PROMPTS[2], params)).token_ids != before.token_ids
    for name, tensor in state.items():
        assert torch.equal(joining._model.state_dict()[name], tensor), name


# --- the batched sampler the engine uses, at vocabulary sizes the hand-made tests miss --------


@pytest.mark.parametrize(
    ("vocab", "spread", "in_window"),
    [(600, 2.5, None), (2000, 5.0, True), (2000, 0.5, False)],
)
def test_batched_draws_follow_the_distribution(vocab: int, spread: float, in_window: bool | None) -> None:
    """Inverse-CDF draws match the probabilities, never leave the nucleus and never pick a
    zero-probability token: with block padding (600), and for a nucleus found in the candidate
    window (peaked) or only by the full sort (flat)."""
    torch.manual_seed(0)
    logits = torch.randn(vocab) * spread
    logits[7] = -float("inf")  # probability 0
    logp = torch.log_softmax(logits, dim=-1)
    if in_window is not None:
        assert bool(logp.exp().topk(NUCLEUS_CANDIDATES).values.sum() >= 0.9) == in_window
    n = 10000
    for top_p in (1.0, 0.9):
        draws = draw_rows(logp.expand(n, vocab), [top_p] * n, [None] * n)
        counts = torch.bincount(draws, minlength=vocab).double()
        probs = logp.exp().double()
        if top_p < 1.0:
            ordered, order = probs.sort(descending=True)
            kept = order[(ordered.cumsum(0) - ordered) < top_p]
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[kept] = True
            assert counts[~mask].sum() == 0
            probs = torch.where(mask, probs, 0.0)
            probs = probs / probs.sum()
        assert counts[7] == 0
        # Chi-square goodness of fit, tokens expected fewer than 20 times pooled into one bin;
        # the bound is the statistic's mean plus 6 of its standard deviations.
        expected = probs * n
        big = expected >= 20
        observed, wanted = counts[big], expected[big]
        if expected[~big].sum() > 0:
            observed = torch.cat([observed, counts[~big].sum()[None]])
            wanted = torch.cat([wanted, expected[~big].sum()[None]])
        chi2 = float(((observed - wanted) ** 2 / wanted).sum())
        df = len(wanted) - 1
        assert chi2 < df + 6 * (2 * df) ** 0.5, (top_p, chi2, df)


# --- failures: a request that cannot be served fails alone, and nothing admitted waits for ever


async def settled(*requests: Awaitable[GenerateResult]) -> list[GenerateResult | BaseException]:
    """Each request's result or error; a request left without either fails the test (timeout)."""
    async with asyncio.timeout(60):
        return await asyncio.gather(*requests, return_exceptions=True)


async def idle(engine: TorchEngine) -> bool:
    """Whether the step loop drops every row and queues nothing (it ends a moment after the
    last result is delivered)."""
    for _ in range(500):
        if not engine._running and not engine._inbox:
            return True
        await asyncio.sleep(0.01)
    return False


class AdmitRecorder:
    """Records how many requests were queued at each admission of ``engine``."""

    def __init__(self, engine: TorchEngine) -> None:
        self.queued: list[int] = []
        admit = engine._admit

        def recording(room: int) -> Any:
            self.queued.append(len(engine._inbox))
            return admit(room)

        engine._admit = recording  # type: ignore[method-assign]


async def test_a_request_that_cannot_be_admitted_fails_alone(
    joining: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bug report: a seed torch's generator refuses (``-9223372036854775809``) raised in the
    step loop after the request had left the inbox, so nothing failed it, nor the requests
    admitted in the same step; their callers waited for ever, and so did the next switch."""
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=3, stop_token_ids=(NEVER,))
    expected = [await alone(joining, p, params) for p in (PROMPTS[0], PROMPTS[1])]
    monkeypatch.setattr(joining, "_validate", lambda request: None)  # as if validation missed it
    admitted = AdmitRecorder(joining)
    refused = SamplingParams(max_tokens=6, seed=-(2**63) - 1)
    first, bad, last = await settled(
        generate(joining, PROMPTS[0], params),
        generate(joining, PROMPTS[2], refused),
        generate(joining, PROMPTS[1], params),
    )
    assert admitted.queued[0] == 3  # all three in the same admission
    assert isinstance(bad, BadRequest) and bad.param == "seed", bad
    assert isinstance(first, GenerateResult) and isinstance(last, GenerateResult), (first, last)
    assert_same(first, expected[0])
    assert_same(last, expected[1])
    assert await idle(joining)
    assert len((await generate(joining, PROMPTS[3], greedy(2))).token_ids) >= 1


async def test_a_prefill_that_fails_fails_only_its_request(
    joining: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Newcomers are prefilled together; when that raises they are prefilled again one by one,
    so only the request that fails alone fails, and the running batch never notices."""
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=7, stop_token_ids=(NEVER,))
    long = greedy(120, [NEVER])
    expected_long = await alone(joining, PROMPTS[4], long)
    expected = [await alone(joining, p, params) for p in (PROMPTS[0], PROMPTS[2])]
    poison = PROMPTS[5]
    prefill = joining._prefill
    sizes: list[int] = []

    def failing(rows: list[Any]) -> Any:
        sizes.append(len(rows))
        if any(list(row.pending.request.prompt_ids) == poison for row in rows):
            raise RuntimeError("this prompt breaks the forward pass")
        return prefill(rows)

    monkeypatch.setattr(joining, "_prefill", failing)
    recorder = StepRecorder(joining)
    running = asyncio.create_task(generate(joining, PROMPTS[4], long))
    await recorder.steps(5)
    first, bad, last = await settled(
        generate(joining, PROMPTS[0], params),
        generate(joining, poison, params),
        generate(joining, PROMPTS[2], params),
    )
    assert sizes == [1, 3, 1, 1, 1]  # the long row, the three together, then each alone
    assert isinstance(bad, EngineUnavailable) and "breaks the forward pass" in bad.message, bad
    assert isinstance(first, GenerateResult) and isinstance(last, GenerateResult), (first, last)
    assert_same(first, expected[0])  # seeded: the retry draws what the row would draw alone
    assert_same(last, expected[1])
    assert_same(await running, expected_long)


async def test_a_failed_decode_step_fails_every_row_and_the_engine_serves_on(
    joining: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = joining._step

    def failing(batch: Any) -> Any:
        raise RuntimeError("the decode step failed")

    monkeypatch.setattr(joining, "_step", failing)
    results = await settled(*(generate(joining, p, greedy(5, [NEVER])) for p in PROMPTS[:3]))
    assert all(isinstance(r, EngineUnavailable) and "decode step" in r.message for r in results), results
    assert await idle(joining)
    monkeypatch.setattr(joining, "_step", step)
    assert len((await generate(joining, PROMPTS[0], greedy(3, [NEVER]))).token_ids) == 3


async def test_a_top_p_below_float32s_range_keeps_the_most_likely_token(joining: TorchEngine) -> None:
    """Found by the engine fuzzer: float32 rounds 1e-300 to 0, which cut every token, and the
    draw then took the least likely one."""
    expected = await generate(joining, PROMPTS[3], greedy(8, [NEVER]))
    tiny = SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-300, seed=1, stop_token_ids=(NEVER,))
    assert (await generate(joining, PROMPTS[3], tiny)).token_ids == expected.token_ids


# --- the engine's boundary at every field's extremes (hypothesis, fixed budget) --------------

INF, NAN = float("inf"), float("nan")


@dataclass(frozen=True)
class Case:
    request: GenerateRequest
    #: The fields set to a value outside the contract (empty: the request is valid).
    broken: frozenset[str]


def extreme_cases(vocab: int, context: int, *, validated: bool) -> st.SearchStrategy[Case]:
    """A request with every field at an edge of its valid range, and up to two fields past it
    (or of the wrong type). Without validation (the step loop's own robustness) max_tokens and
    the prompt's length stay valid: a huge max_tokens would only run for a very long time."""
    valid: dict[str, list[Any]] = {
        "prompt_ids": [[0], [vocab - 1], PROMPTS[3], [1] * (context - 3)],
        "max_tokens": [1, 3],
        "temperature": [0.0, -0.0, 1e-5, 0.7, 2.0, 1e308],
        "top_p": [5e-324, 1e-300, 1e-45, 0.3, 1.0],
        # 0 and values of at least the vocabulary's size are off.
        "top_k": [0, 1, 2, vocab - 1, vocab, 2**63],
        # Ids outside the vocabulary are the contract's "never stop".
        "stop_token_ids": [(), (NEVER,), (0,), (vocab - 1,), (vocab,), (2**63,)],
        "seed": [None, -(2**63), -1, 0, 2**63 - 1],
        "top_logprobs": [0, 1, 20],
    }
    invalid: dict[str, list[Any]] = {
        "prompt_ids": [[], [vocab], [-1], [2**63], [True], [1.5]],
        "max_tokens": [-(2**63) - 1, -1, 0, True, 2.5, context, 2**63, 10**30],
        "temperature": [5e-324, 1e-7, INF, -INF, NAN, -1.0, True, None],
        "top_p": [0.0, -0.0, 1.0000001, INF, NAN, True, None],
        "top_k": [-1, -(2**63), 1.5, True, None, NAN],
        "stop_token_ids": [(True,), (1.5,), (None,)],
        "seed": [-(2**63) - 1, 2**63, 2**64, True, 1.5, NAN],
        "top_logprobs": [21, -1, vocab + 1, 2**63, True, NAN],
    }
    if validated:
        invalid["prompt_ids"] += [[1] * context, [1] * (context + 1)]
    else:
        del invalid["max_tokens"]

    @st.composite
    def cases(draw: st.DrawFn) -> Case:
        fields = {name: draw(st.sampled_from(values)) for name, values in valid.items()}
        broken = draw(st.sets(st.sampled_from(sorted(invalid)), max_size=2))
        fields.update({name: draw(st.sampled_from(invalid[name])) for name in sorted(broken)})
        prompt = fields.pop("prompt_ids")
        return Case(GenerateRequest(prompt_ids=prompt, params=SamplingParams(**fields)), frozenset(broken))

    return cases()


def check_result(request: GenerateRequest, result: GenerateResult) -> None:
    params = request.params
    assert result.finish_reason in ("stop", "length")
    assert 1 <= len(result.token_ids) == len(result.logprobs) <= params.max_tokens
    assert all(0 <= t < 10**6 for t in result.token_ids)
    assert all(math.isfinite(lp) and lp <= 1e-6 for lp in result.logprobs), result.logprobs
    assert len(result.top_logprobs) == (len(result.token_ids) if params.top_logprobs else 0)


@pytest.mark.parametrize(
    "examples", [pytest.param(300, id="default"), pytest.param(2000, id="slow", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("validated", [True, False], ids=["validated", "unvalidated"])
def test_generate_at_the_extremes_answers_or_refuses_and_never_hangs(
    tiny_model_dir: Path, examples: int, validated: bool
) -> None:
    """One to three requests at once, each field at its edges: a valid one is answered with a
    well-formed result (finite log-probs), one with a field past its range is refused with
    ``BadRequest`` (``ContextTooLong`` included). With validation bypassed (the step loop's own
    robustness), each still ends, answered or failed with an ``ApplianceError``, and the engine
    serves on."""
    loop = asyncio.new_event_loop()
    engine = TorchEngine(tiny_model_dir, max_batch_size=4)
    loop.run_until_complete(engine.start())
    if not validated:
        engine._validate = lambda request: None  # type: ignore[method-assign]

    async def serve(requests: list[GenerateRequest]) -> list[GenerateResult | BaseException]:
        async with asyncio.timeout(60):
            return await asyncio.gather(*(engine.generate(r) for r in requests), return_exceptions=True)

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        cases=st.lists(
            extreme_cases(engine._vocab_size, engine.max_context, validated=validated), min_size=1, max_size=3
        )
    )
    def fuzz(cases: list[Case]) -> None:
        outcomes = loop.run_until_complete(serve([case.request for case in cases]))
        hypothesis.event(f"{sum(not case.broken for case in cases)} of {len(cases)} valid")
        for case, outcome in zip(cases, outcomes, strict=True):
            if not validated:  # garbage may break the batch it joins, but never hangs it
                assert isinstance(outcome, GenerateResult | ApplianceError), (case, outcome)
            elif case.broken:
                assert isinstance(outcome, BadRequest), (case, outcome)
            else:
                assert isinstance(outcome, GenerateResult), (case, outcome)
                check_result(case.request, outcome)

    try:
        fuzz()
        result = loop.run_until_complete(
            serve([GenerateRequest(prompt_ids=PROMPTS[2], params=greedy(4, [NEVER]))])
        )
        assert isinstance(result[0], GenerateResult) and len(result[0].token_ids) == 4
        assert loop.run_until_complete(idle(engine))
    finally:
        loop.run_until_complete(engine.close())
        loop.close()


@pytest.mark.parametrize("wanted", [-1, 21, 1.5, True])
def test_prompt_logprobs_out_of_range_are_refused(wanted: Any) -> None:
    request = GenerateRequest(prompt_ids=[1, 2], params=greedy(2), prompt_logprobs=wanted)
    with pytest.raises(BadRequest) as caught:
        validate_request(request, max_context=64, vocab_size=1002)
    assert caught.value.param == "logprobs"
    validate_request(dataclasses.replace(request, prompt_logprobs=20), max_context=64, vocab_size=1002)
