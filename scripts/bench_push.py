"""The weight push from trainer to engine, old path vs new path, side by side in one run; and a
training step at 2 trainer ranks vs 1.

Push (for each trainer: ``torch``, the in-process ``PolicyTrainer``; ``verl xN``, a
``RankedTrainer`` of N worker processes on gloo, one torch thread each), into one ``TorchEngine``
(CPU, float32) in this process:

- **old**: ``trainer.state_dict_for_engine()`` (a full CPU copy of the weights; from ranks, sent
  over the rank's pipe) then ``await engine.load_weights(state_dict, version)``;
- **new**: ``await engine.load_weight_buckets(buckets, version)`` over the trainer's
  ``weight_buckets(bucket_bytes)``, each ``next`` in a worker thread, as
  ``appliance.training.service.TrainingService`` does it (one reusable file in /dev/shm).

Old and new alternate (new first), after one unmeasured push of each; the time is the median
over ``--repeats``. While a push runs, a thread reads ``/proc/<pid>/status`` every 5 ms (VmRSS,
RssAnon, RssShmem) of this process (the appliance's: engine, and the trainer when it is in
process) and of rank 0; "extra" is the peak minus the value just before the push (after a
``gc.collect`` and ``malloc_trim``), each field's peak on its own. Pages of the bucket file in
/dev/shm count in the RssShmem of every process that touches them, and twice in a process that
maps them twice (the in-process trainer writes the file through one mapping, the engine reads it
through another): RSS there overstates the memory used, which is the anonymous pages plus one
bucket file. So the thread also reads the machine's ``Shmem`` (``/proc/meminfo``), where a page
of the file counts once (as does any other shared memory created meanwhile on the machine).

Step: the same batch (``--rollouts`` on-policy rollouts of about ``--tokens`` tokens, scored by
the model itself) through ``RankedTrainer`` at 1 and at 2 ranks, alternating, one unmeasured
step each first; the median of ``--step-repeats`` (only when ``--ranks`` has 1 and 2).

    .venv/bin/python scripts/bench_push.py [--model tiny|smollm2-135m|<dir>] [--bucket-mb 256]
        [--repeats 3] [--ranks 1,2] [--no-torch] [--skip-step] [--lora-rank R] [--data-dir appliance-data]

With ``--lora-rank R`` a 1-rank verl LoRA trainer (alpha 2R) is measured too: **new** pushes its
adapters alone (the engine serves them on its base weights), **old** its merged weights in
buckets (how a LoRA policy was pushed before).

``smollm2-135m`` is converted once into ``<data-dir>/models`` (the cache ``make up`` uses).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import statistics
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from bench_push_memory import PeakMemory, malloc_trim, process, system_shmem

from appliance.config import ApplianceConfig
from appliance.engines.models import resolve
from appliance.engines.torch_engine import TorchEngine
from trainer.buckets import WeightBucket
from trainer.factory import make_trainer
from trainer.items import Trainer, TrainItem
from trainer.ranks import RankedTrainer
from trainer.samples import NOT_SAMPLED, Sample

MIB = 1 << 20
#: The issue's targets.
PUSH_TARGET_S = 0.5
RSS_TARGET_BUCKETS = 1.1
STEP_TARGET_RATIO = 1.3


# --- the two paths -----------------------------------------------------------------------------


@dataclass
class Pushed:
    """What a push sent in buckets (none for the old path), and the seconds the trainer side
    took (old: ``state_dict_for_engine``; new: the ``next`` calls, packing and waiting on ranks)."""

    buckets: int = 0
    bytes: int = 0
    trainer_s: float = 0.0


async def push_old(trainer: Trainer, engine: TorchEngine, version: int, bucket_bytes: int) -> Pushed:
    """The old push: a full CPU copy, then ``load_weights`` (as the appliance did, the copy is
    made on the event loop)."""
    del bucket_bytes
    started = time.perf_counter()
    state = trainer.state_dict_for_engine()
    pushed = Pushed(trainer_s=time.perf_counter() - started)
    await engine.load_weights(state, version)
    del state
    return pushed


async def push_new(trainer: Trainer, engine: TorchEngine, version: int, bucket_bytes: int) -> Pushed:
    """The new push: ``load_weight_buckets`` over the trainer's buckets."""
    pushed = Pushed()
    await engine.load_weight_buckets(stream(trainer.weight_buckets(bucket_bytes), pushed), version)
    return pushed


async def push_merged(trainer: Trainer, engine: TorchEngine, version: int, bucket_bytes: int) -> Pushed:
    """A LoRA trainer's push as whole weights (the adapters merged in, in buckets): what a LoRA
    push was before adapters went alone; the "old" path of the LoRA rows."""
    pushed = Pushed()
    ranked: Any = trainer
    await engine.load_weight_buckets(
        stream(ranked.weight_buckets(bucket_bytes, merged=True), pushed), version
    )
    return pushed


async def stream(buckets: Iterator[WeightBucket], pushed: Pushed) -> AsyncIterator[WeightBucket]:
    """``TrainingService._buckets``: each ``next`` (the packing) in a worker thread; counts the
    buckets and their bytes in ``pushed``."""
    done = object()
    try:
        while True:
            started = time.perf_counter()
            bucket = await asyncio.to_thread(next, buckets, done)
            pushed.trainer_s += time.perf_counter() - started
            if bucket is done:
                return
            assert isinstance(bucket, WeightBucket)
            pushed.buckets += 1
            pushed.bytes += sum(entry.nbytes for entry in bucket.entries)
            yield bucket
    finally:
        close = getattr(buckets, "close", None)
        if close is not None:
            await asyncio.to_thread(close)


@dataclass
class PushResult:
    """One trainer's pushes: per path, the times and the extra RSS of each measured push."""

    trainer: str
    times: dict[str, list[float]] = field(default_factory=lambda: {"old": [], "new": []})
    #: The trainer side's share of each measured push (``Pushed.trainer_s``).
    trainer_times: dict[str, list[float]] = field(default_factory=lambda: {"old": [], "new": []})
    #: path -> label ("appliance", "rank 0") -> field -> the per-push extras.
    extra: dict[str, dict[str, dict[str, list[int]]]] = field(default_factory=dict)
    buckets: int = 0
    #: The bytes of one new push (the model's tensors, a tied LM head once; with LoRA the
    #: adapters), and of one old push that came in buckets (LoRA's merged weights), else 0.
    bytes: int = 0
    old_bytes: int = 0

    def time(self, path: str) -> float:
        return statistics.median(self.times[path])

    def peak(self, path: str, label: str, name: str) -> int:
        """The largest extra over the measured pushes (the bound that matters)."""
        return max(self.extra[path][label][name])


async def bench_pushes(
    name: str,
    trainer: Trainer,
    engine: TorchEngine,
    bucket_bytes: int,
    repeats: int,
    version: int,
    old: Callable[[Trainer, TorchEngine, int, int], Any] = push_old,
    old_engine: TorchEngine | None = None,
) -> tuple[PushResult, int]:
    """Warm-up pushes (one per path), then ``repeats`` alternating pairs, new first; the old
    path pushes into ``old_engine`` where one is given (so that each engine sees only its kind
    of push, as in a run)."""
    sources = {"appliance": process(os.getpid()), "system": system_shmem}
    if isinstance(trainer, RankedTrainer):
        sources["rank 0"] = process(trainer.group.pids()[0])
    result = PushResult(name)
    for round_ in range(repeats + 1):
        for path, push in (("new", push_new), ("old", old)):
            version += 1
            gc.collect()
            malloc_trim()
            with PeakMemory(sources) as memory:
                started = time.perf_counter()
                target = old_engine if path == "old" and old_engine is not None else engine
                pushed = await push(trainer, target, version, bucket_bytes)
                elapsed = time.perf_counter() - started
            if path == "new":
                result.buckets, result.bytes = pushed.buckets, pushed.bytes
            else:
                result.old_bytes = pushed.bytes
            if round_ == 0:
                continue  # warm-up
            result.times[path].append(elapsed)
            result.trainer_times[path].append(pushed.trainer_s)
            for label, values in memory.extra.items():
                for f, value in values.items():
                    result.extra.setdefault(path, {}).setdefault(label, {}).setdefault(f, []).append(value)
        if round_:
            print(
                f"  {name}: round {round_}: new {result.times['new'][-1]:.3f} s,"
                f" old {result.times['old'][-1]:.3f} s",
                flush=True,
            )
    return result, version


# --- the step ----------------------------------------------------------------------------------


def on_policy_batch(model_dir: Path, rollouts: int, tokens: int, seed: int = 0) -> list[TrainItem]:
    """``rollouts`` one-sample rollouts of ``tokens`` +-4 tokens (8 prompt tokens, the rest
    sampled), random ids, logprobs the model's own (teacher forced), advantages +-1."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    vocab = int(model.config.vocab_size)
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(8)]
    items = []
    for i in range(rollouts):
        ids = [*prompt, *(rng.randrange(vocab) for _ in range(tokens - 8 + rng.randint(-4, 4)))]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0]
        picked = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        logprobs = [0.0, *picked.tolist()]
        mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
        sample = Sample(
            rollout=f"r{i}",
            call_ids=(f"r{i}-call",),
            tokens=tuple(ids),
            loss_mask=tuple(mask),
            logprobs=tuple(lp if m else 0.0 for lp, m in zip(logprobs, mask, strict=True)),
            versions=tuple(0 if m else NOT_SAMPLED for m in mask),
        )
        items.append(TrainItem(f"r{i}", 1.0 if i % 2 else -1.0, (sample,), reward=float(i % 2)))
    return items


def bench_steps(
    trainers: dict[int, RankedTrainer], items: Sequence[TrainItem], repeats: int
) -> dict[int, list[float]]:
    """Seconds per step at each rank count, alternating, after one unmeasured step each."""
    times: dict[int, list[float]] = {ranks: [] for ranks in trainers}
    for round_ in range(repeats + 1):
        for ranks, trainer in trainers.items():
            started = time.perf_counter()
            out = trainer.step(items)
            elapsed = time.perf_counter() - started
            if not out.updated:
                raise RuntimeError(f"the step at {ranks} rank(s) did not update the weights")
            if round_:
                times[ranks].append(elapsed)
        if round_:
            cells = ", ".join(f"{ranks} rank(s) {t[-1]:.2f} s" for ranks, t in times.items())
            print(f"  step round {round_}: {cells}", flush=True)
    return times


# --- report ------------------------------------------------------------------------------------


def mib(value: int) -> str:
    return f"{value / MIB:,.1f}"


def print_pushes(results: list[PushResult], bucket_bytes: int) -> list[str]:
    """The table (markdown) and the ratios; returns the verdict lines."""
    bucket = bucket_bytes / MIB
    print(
        f"\n### push: median of the measured pushes; extra RSS: largest over them, MiB"
        f" (in buckets of {bucket:g} MiB); model {results[0].bytes / MIB:,.0f} MiB\n"
    )
    print(
        "| trainer | path | push s | of which trainer s | new / old | buckets | appliance VmRSS"
        " | appliance anon / shmem | rank 0 VmRSS | rank 0 anon / shmem | machine's Shmem |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    verdicts = []
    for r in results:
        for path in ("old", "new"):
            cells = [
                r.trainer,
                path,
                f"{r.time(path):.3f}",
                f"{statistics.median(r.trainer_times[path]):.3f}",
            ]
            cells.append(f"**{r.time('new') / r.time('old'):.2f}x**" if path == "new" else "")
            cells.append(str(r.buckets) if path == "new" else "-")
            for label in ("appliance", "rank 0"):
                if label not in r.extra[path]:
                    cells += ["-", "-"]
                    continue
                vm = r.peak(path, label, "VmRSS")
                cells.append(f"{mib(vm)} ({vm / bucket_bytes:.2f})")
                cells.append(
                    f"{mib(r.peak(path, label, 'RssAnon'))} / {mib(r.peak(path, label, 'RssShmem'))}"
                )
            shm = r.peak(path, "system", "Shmem")
            cells.append(f"{mib(shm)} ({shm / bucket_bytes:.2f})")
            print("| " + " | ".join(cells) + " |")
        new_s = r.time("new")
        verdicts.append(
            f"{r.trainer}: new push {new_s:.3f} s"
            f" {'<=' if new_s <= PUSH_TARGET_S else '>'} {PUSH_TARGET_S} s"
            f" ({'met' if new_s <= PUSH_TARGET_S else 'NOT met'})"
        )
        for label in ("appliance", "rank 0"):
            if label not in r.extra["new"]:
                continue
            vm = r.peak("new", label, "VmRSS")
            met = vm <= RSS_TARGET_BUCKETS * bucket_bytes
            verdicts.append(
                f"{r.trainer}: {label} peak extra RSS during a new push {vm / bucket_bytes:.2f} buckets"
                f" {'<=' if met else '>'} {RSS_TARGET_BUCKETS} ({'met' if met else 'NOT met'})"
            )
    return verdicts


def print_steps(times: dict[int, list[float]], items: Sequence[TrainItem]) -> list[str]:
    samples = sum(len(item.samples) for item in items)
    tokens = sum(len(s.tokens) for item in items for s in item.samples)
    print(f"\n### one training step: {samples} samples, {tokens} tokens, median of {len(times[1])}\n")
    print("| ranks (1 thread each) | s / step | ms / sample |")
    print("|---:|---:|---:|")
    for ranks, t in times.items():
        median = statistics.median(t)
        print(f"| {ranks} | {median:.3f} | {median / samples * 1000:.1f} |")
    if 1 not in times or 2 not in times:
        return []
    ratio = statistics.median(times[2]) / statistics.median(times[1])
    met = ratio <= STEP_TARGET_RATIO
    line = (
        f"2 ranks / 1 rank per sample: {ratio:.2f}x {'<=' if met else '>'} {STEP_TARGET_RATIO}x"
        f" ({'met' if met else 'NOT met'})"
    )
    print(f"\n{line}")
    return [line]


# --- main --------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> int:
    resolved = resolve(args.model, ApplianceConfig(data_dir=args.data_dir).models_dir)
    ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    bucket_bytes = int(args.bucket_mb * MIB)
    print(
        f"model {resolved.name} ({resolved.path}), bucket {args.bucket_mb:g} MiB, repeats {args.repeats},"
        f" ranks {ranks or 'none'}, torch threads here {args.threads}, load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    items: list[TrainItem] = []
    if not args.skip_step and 1 in ranks and 2 in ranks:
        items = on_policy_batch(resolved.path, args.rollouts, args.tokens)
        gc.collect()
    elif not args.skip_step:
        print("no step benchmark: it needs --ranks with both 1 and 2")
    engine = TorchEngine(resolved.path, device="cpu", dtype=torch.float32, num_threads=args.threads)
    await engine.start()
    ranked: dict[int, RankedTrainer] = {}
    results: list[PushResult] = []
    version = 0
    try:
        configurations: list[tuple[str, int | None]] = [] if args.no_torch else [("torch", None)]
        configurations += [(f"verl x{n}", n) for n in ranks]
        if args.lora_rank:
            configurations.append((f"verl x1 LoRA r{args.lora_rank}", -1))
        lora_lines: list[str] = []
        for name, n in configurations:
            started = time.perf_counter()
            old: Callable[[Trainer, TorchEngine, int, int], Any] = push_old
            lora_trainer: RankedTrainer | None = None
            old_engine: TorchEngine | None = None
            if n is None:
                trainer: Trainer = make_trainer("torch", resolved.path)
            elif n < 0:  # LoRA: adapters alone (new) against the merged weights in buckets (old)
                r = args.lora_rank
                made = make_trainer("verl", resolved.path, ranks=1, threads=1, lora_rank=r, lora_alpha=2 * r)
                assert isinstance(made, RankedTrainer)
                trainer = lora_trainer = made
                old = push_merged
                # Merged weights go to an engine of their own: the adapters' engine keeps its base.
                old_engine = TorchEngine(resolved.path, device="cpu", dtype=torch.float32)
                await old_engine.start()
            else:
                made = make_trainer("verl", resolved.path, ranks=n, threads=1)
                assert isinstance(made, RankedTrainer)
                trainer = ranked[n] = made
            print(f"{name}: trainer ready in {time.perf_counter() - started:.1f} s", flush=True)
            try:
                result, version = await bench_pushes(
                    name, trainer, engine, bucket_bytes, args.repeats, version, old, old_engine
                )
            finally:
                if old_engine is not None:
                    await old_engine.close()
            results.append(result)
            if lora_trainer is not None:
                lora_lines.append(
                    f"{name}: a push carries {mib(result.bytes)} MiB of adapters against"
                    f" {mib(result.old_bytes)} MiB of merged weights"
                    f" ({result.bytes / result.old_bytes:.3f}x);"
                    f" {result.time('new') / result.time('old'):.2f}x the time"
                )
                lora_trainer.close()
            del trainer
            gc.collect()
        verdicts = print_pushes(results, bucket_bytes) if results else []
        verdicts += lora_lines
        if items:
            print("\nsteps ...", flush=True)
            times = bench_steps({n: ranked[n] for n in (1, 2)}, items, args.step_repeats)
            verdicts += print_steps(times, items)
        print(f"\ntargets (load {os.getloadavg()[0]:.1f}):")
        for line in verdicts:
            print(f"- {line}")
    finally:
        for trainer_ in ranked.values():
            trainer_.close()
        await engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny", help="tiny, smollm2-135m or a local model directory")
    parser.add_argument(
        "--data-dir", type=Path, default=Path("appliance-data"), help="converted models go to <dir>/models"
    )
    parser.add_argument("--bucket-mb", type=float, default=256, help="bucket size of the new path, MiB")
    parser.add_argument("--repeats", type=int, default=3, help="measured pushes per path (median)")
    parser.add_argument(
        "--ranks", default="1,2", help="comma-separated rank counts of verl trainers ('' none)"
    )
    parser.add_argument("--no-torch", action="store_true", help="leave out the in-process torch trainer")
    parser.add_argument("--skip-step", action="store_true", help="leave out the 1-rank vs 2-rank step")
    parser.add_argument("--step-repeats", type=int, default=3, help="measured steps per rank count")
    parser.add_argument("--rollouts", type=int, default=16, help="rollouts in the step's batch")
    parser.add_argument("--tokens", type=int, default=40, help="tokens per rollout, about")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="also a 1-rank verl LoRA trainer of this rank: adapters alone (new) vs merged weights (old)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.step_repeats < 1:
        parser.error("--repeats and --step-repeats must be at least 1")
    return asyncio.run(run(args))


if __name__ == "__main__":
    raise SystemExit(main())
