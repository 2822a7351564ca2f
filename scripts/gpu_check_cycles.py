"""The GPU check's phases once the engine and the trainer run: generate_0, the two collocation
cycles in the scheduler's order, the two sleep levels, and the memory figures against the memory
model's allowances; the engine's log-probs compared with the trainer's (``Reference``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from gpu_check_report import CYCLE, PHASES, SLEEP_1, SLEEP_2, TIMEOUTS, Check, PhaseFailed

#: The largest engine-vs-trainer log-prob gap on CUDA by default: the engine in bf16 against the
#: trainer's weights through an fp32 forward. The first H200 run (2026-12-04, torch engine, the
#: random ~0.36B model, 126 tokens) measured 0.033 and 0.026 (``moved`` by a step: 1.9 and 2.4).
CUDA_TOLERANCE = 0.1


class Reference:
    """The trainer's log-probs on fixed tokens: its weights through transformers' forward in
    fp32 on the CPU (built once, weights loaded for each reading)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        auto: Any = AutoModelForCausalLM
        self.model: Any = auto.from_config(config, dtype=torch.float32).eval()

    def logprobs(self, state: dict[str, torch.Tensor], prompts: list[list[int]]) -> list[list[float]]:
        self.model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        out = []
        with torch.no_grad():
            for prompt in prompts:
                ids = torch.tensor([prompt])
                logits = self.model(ids).logits[0, :-1].float()
                scores = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
                out.append(scores.tolist())
        return out


def cuda_graph_gib(log: Path) -> float | None:
    """The CUDA graph memory vLLM's last start reported in its log, GiB (None: not there)."""
    import re

    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    found = re.findall(r"Graph capturing finished in\s+\d+\s+secs?,\s*took\s+(-?[\d.]+)\s*GiB", text)
    return float(found[-1]) if found else None


class Cycles:
    """generate_0, the two collocation cycles, the two sleep levels."""

    def __init__(self, check: Check, config: Any, model_dir: Path) -> None:
        import random

        self.check = check
        self.config = config
        self.model_dir = model_dir
        self.version = 0
        rng = random.Random(0)
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        on_cuda = config.device == "cuda"
        length, count = (64, 8) if on_cuda else (12, 4)
        self.max_tokens = 32 if on_cuda else 8
        self.prompts = [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]
        self.fixed = [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(2)]
        self.samples: list[Any] = []
        self.previous: list[list[float]] | None = None
        self.reference: Reference | None = None
        tolerance = check.args.logprob_tolerance
        self.tolerance = tolerance if tolerance is not None else (CUDA_TOLERANCE if on_cuda else 1e-3)
        # As ``up``: the trainer's compute dtype, the one the engine serves in (fp32: as it is).
        dtype = getattr(torch, config.engine_dtype())
        self.push_dtype = dtype if dtype != torch.float32 else None
        from trainer.sharded import ShardedStore

        self.store = ShardedStore(config.checkpoint_dir, keep=config.trainer.keep_checkpoints)

    async def run(self) -> None:
        check = self.check
        if await check.phase("generate_0", self.first) is None:
            self.not_run([p for p in PHASES if p.startswith(("cycle_", "sleep_"))], "generate_0 failed")
        else:
            for n in (1, 2):
                if not await self.cycle(n):
                    break
            if await self.sleep_1():
                await self.sleep_2()
        await self.check.phase("figures", self.figures, memory=False)

    async def figures(self) -> dict[str, Any]:
        """What the memory model allows a process to keep on a collocated GPU
        (``memory_model.GPU_CHECK_FIGURES``) against what the phases measured: an offloaded
        trainer rank (``cycle_N/offload``), vLLM asleep (every sleep), vLLM's CUDA graphs (its
        log's "Graph capturing finished ..., took X GiB"). Measured on CUDA only (on CPU memory
        is RSS); vLLM's two with vLLM only (null with the torch engine)."""
        from appliance.placement.memory_model import GPU_CHECK_FIGURES

        allowances = {name: round(value / 2**20) for name, value in GPU_CHECK_FIGURES.items()}
        if self.config.device != "cuda":
            return {"allowance_mib": allowances, "measured_mib": None, "reason": "measured on CUDA"}
        ranks = max(1, self.check.trainer_ranks)
        offloaded = self.largest(("cycle_1/offload", "cycle_2/offload"), "trainer_ranks")
        measured: dict[str, int | float | None] = {
            "TRAINER_OFFLOADED": None if offloaded is None else round(offloaded / ranks),
            "VLLM_ASLEEP": None,
            "VLLM_CUDA_GRAPHS": None,
        }
        if self.config.engine.kind == "vllm":
            asleep = ("cycle_1/sleep", "cycle_2/sleep", "sleep_1/sleep", "sleep_2/sleep")
            graphs = cuda_graph_gib(self.config.data_dir / "logs" / "vllm.log")
            measured["VLLM_ASLEEP"] = self.largest(asleep, "vllm")
            measured["VLLM_CUDA_GRAPHS"] = None if graphs is None else round(graphs * 1024)
        fields: dict[str, Any] = {"allowance_mib": allowances, "measured_mib": measured}
        over = [
            f"{name}: {value} MiB measured, appliance/placement/memory_model.py allows {allowances[name]} MiB"
            for name, value in measured.items()
            if name in allowances and value is not None and value > allowances[name]
        ]
        if over:
            fields.update(check_ok=False, problems=over)
        return fields

    def largest(self, phases: Sequence[str], who: str) -> float | None:
        values = [
            float(memory[who])
            for phase in phases
            if isinstance(memory := self.check.memories.get(phase), dict)
            and isinstance(memory.get(who), float)
        ]
        return max(values) if values else None

    def not_run(self, phases: Sequence[str], reason: str) -> None:
        for phase in phases:
            if phase not in self.check.report.done:
                self.check.report.skip(phase, reason)

    async def generate(self, version: int) -> dict[str, Any]:
        from appliance.engines.base import GenerateRequest, SamplingParams

        engine = self.check.engine
        requests = [
            GenerateRequest(
                prompt_ids=p, params=SamplingParams(max_tokens=self.max_tokens, temperature=1.0, seed=i)
            )
            for i, p in enumerate(self.prompts)
        ]
        started = time.monotonic()
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
        seconds = time.monotonic() - started
        versions = sorted({r.policy_version for r in results})
        if versions != [version]:
            raise PhaseFailed(f"the engine served versions {versions}, not {version}")
        self.samples = train_items(self.prompts, results)
        tokens = sum(len(r.token_ids) for r in results)
        return {"version": version, "tokens": tokens, "tokens_per_s": round(tokens / max(seconds, 1e-9), 1)}

    async def engine_logprobs(self) -> list[list[float]]:
        from appliance.engines.base import GenerateRequest, SamplingParams

        engine = self.check.engine
        out = []
        for prompt in self.fixed:
            request = GenerateRequest(
                prompt_ids=prompt,
                params=SamplingParams(max_tokens=1, temperature=1.0, seed=0),
                prompt_logprobs=0,
            )
            result = await engine.generate(request)
            scores = list(result.prompt_logprobs)[1:]
            if any(s is None for s in scores) or len(scores) != len(prompt) - 1:
                raise PhaseFailed("the engine did not score every prompt token")
            out.append([float(s) for s in scores])
        return out

    async def first(self) -> dict[str, Any]:
        fields = await self.generate(0)
        self.previous = await self.engine_logprobs()
        return fields

    async def compare(self, *, pushed_a_step: bool) -> dict[str, Any]:
        served = await self.engine_logprobs()
        state = await asyncio.to_thread(self.check.trainer.state_dict_for_engine)
        if self.reference is None:
            self.reference = await asyncio.to_thread(Reference, self.model_dir)
        trainer = await asyncio.to_thread(self.reference.logprobs, state, self.fixed)
        del state
        diff = max_abs(served, trainer)
        moved = max_abs(served, self.previous) if self.previous is not None else None
        self.previous = served
        fields: dict[str, Any] = {
            "max_abs_diff": diff,
            "mean_abs_diff": mean_abs(served, trainer),
            "moved": moved,
            "tolerance": self.tolerance,
            "tokens": sum(len(s) for s in served),
        }
        problems = []
        if not diff <= self.tolerance:
            problems.append(f"max_abs_diff {diff:.3g} is above the tolerance {self.tolerance:g}")
        if pushed_a_step and moved is not None and not moved > diff:
            problems.append(
                f"the push moved the engine's log-probs by {moved:.3g}, not beyond their diff {diff:.3g}"
            )
        if problems:
            fields.update(check_ok=False, problems=problems)
        return fields

    async def push(self, version: int) -> dict[str, Any]:
        from trainer.buckets import stream_buckets

        count = nbytes = 0
        adapter = None
        trainer = self.check.trainer
        bucket_bytes = int(self.config.trainer.push_bucket_mb) << 20

        def counted() -> Iterator[Any]:
            nonlocal count, nbytes, adapter
            for bucket in trainer.weight_buckets(bucket_bytes, self.push_dtype):
                count += 1
                nbytes += sum(entry.nbytes for entry in bucket.entries)
                adapter = bucket.adapter
                yield bucket

        await self.check.engine.load_weight_buckets(stream_buckets(counted()), version)
        return {
            "version": version,
            "buckets": count,
            "mib": round(nbytes / 2**20, 1),
            "dtype": str(self.push_dtype or "trainer's").removeprefix("torch."),
            # A LoRA run pushes its adapters alone (their rank), else the whole weights (null).
            "adapter_rank": None if adapter is None else adapter.rank,
        }

    async def cycle(self, n: int) -> bool:
        check, engine, trainer = self.check, self.check.engine, self.check.trainer
        version = self.version + 1

        async def step() -> dict[str, Any]:
            out = await asyncio.to_thread(trainer.step, self.samples)
            metrics = out.metrics()
            return {
                "loss": out.loss,
                "grad_norm": out.grad_norm,
                "updated": out.updated,
                "is_weight_mean": metrics["is_weight_mean"],
                "tokens": out.tokens,
                **({} if out.updated else {"check_ok": False, "problems": ["the step did not update"]}),
            }

        async def checkpoint() -> dict[str, Any]:
            trainer.global_step = n
            path = await asyncio.to_thread(trainer.save, self.store, version)
            return {"path": str(path)}

        async def generate() -> dict[str, Any]:
            return await self.generate(version)

        steps: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
            "sleep": lambda: timed_none(engine.sleep(1)),
            "onload": lambda: timed_none(asyncio.to_thread(trainer.onload)),
            "step": step,
            "checkpoint": checkpoint,
            "offload": lambda: timed_none(asyncio.to_thread(trainer.offload)),
            "wake_weights": lambda: timed_none(engine.wake(["weights"])),
            "push": lambda: self.push(version),
            "wake_kv_cache": lambda: timed_none(engine.wake(["kv_cache"])),
            "generate": generate,
            "logprobs": lambda: self.compare(pushed_a_step=True),
        }
        for name in CYCLE:
            kind = name if name in TIMEOUTS else None
            if await check.phase(f"cycle_{n}/{name}", steps[name], kind=kind) is None:
                self.not_run(
                    [p for p in PHASES if p.startswith(("cycle_", "sleep_"))], f"cycle_{n}/{name} failed"
                )
                return False
            if name == "push":
                self.version = version
        return True

    async def sleep_1(self) -> bool:
        engine = self.check.engine
        steps: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
            "sleep": lambda: timed_none(engine.sleep(1)),
            "wake": lambda: timed_none(engine.wake(["weights", "kv_cache"])),
            "generate": lambda: self.generate(self.version),
        }
        for name in SLEEP_1:
            if await self.check.phase(f"sleep_1/{name}", steps[name]) is None:
                self.not_run([p for p in PHASES if p.startswith("sleep_")], f"sleep_1/{name} failed")
                return False
        return True

    async def sleep_2(self) -> None:
        engine = self.check.engine
        steps: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
            "sleep": lambda: timed_none(engine.sleep(2)),
            "wake_weights": lambda: timed_none(engine.wake(["weights"])),
            # Level 2 discarded the weights: the current version is pushed again (the scheduler's way).
            "push": lambda: self.push(self.version),
            "wake_kv_cache": lambda: timed_none(engine.wake(["kv_cache"])),
            "generate": lambda: self.generate(self.version),
            "logprobs": lambda: self.compare(pushed_a_step=False),
        }
        for name in SLEEP_2:
            if await self.check.phase(f"sleep_2/{name}", steps[name]) is None:
                self.not_run([p for p in PHASES if p.startswith("sleep_2/")], f"sleep_2/{name} failed")
                return


async def timed_none(awaitable: Awaitable[Any]) -> dict[str, Any]:
    await awaitable
    return {}


def max_abs(a: list[list[float]], b: list[list[float]]) -> float:
    return max(
        (abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)), default=0.0
    )


def mean_abs(a: list[list[float]], b: list[list[float]]) -> float:
    values = [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(values) / len(values) if values else 0.0


def train_items(prompts: list[list[int]], results: Sequence[Any]) -> list[Any]:
    """The engine's generations as training items, every other one rewarded (advantage +-1)."""
    from trainer.items import TrainItem
    from trainer.samples import NOT_SAMPLED, Sample

    items = []
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        n = len(result.token_ids)
        sample = Sample(
            rollout=f"r{i}",
            call_ids=(f"c{i}",),
            tokens=(*prompt, *result.token_ids),
            loss_mask=(0,) * len(prompt) + (1,) * n,
            logprobs=(0.0,) * len(prompt) + tuple(result.logprobs),
            versions=(NOT_SAMPLED,) * len(prompt) + (result.policy_version,) * n,
        )
        items.append(TrainItem(f"r{i}", 1.0 if i % 2 == 0 else -1.0, (sample,), reward=float(i % 2 == 0)))
    return items
