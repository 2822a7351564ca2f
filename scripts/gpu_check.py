"""GPU check: the collocation switches of one machine, timed on a ~0.5B-parameter model.

One straight-line run of what the appliance does around a training step when generation and
training share an accelerator, printing how long each switch takes:

    build a random Qwen2 (~0.5B, Qwen2.5-0.5B's shape; random weights are fine for timing)
    torch engine: load -> generate -> sleep(1)
    verl FSDP trainer (bf16 mixed precision on CUDA, fp32 on CPU): init -> step (on the
        engine's own samples) -> offload -> GPU memory left (trainer offloaded, engine asleep)
    torch engine: wake weights -> bucketed weight push (trainer -> engine through one reusable
        /dev/shm file, checked exact) -> full weight push (the whole state dict) -> wake kv
        cache -> generate
    again: sleep -> trainer onload -> step -> offload -> wake -> pushes -> generate
    LoRA: a second verl trainer (rank 8, alpha 16): init -> step -> bucketed push of its merged
        weights (checked exact) -> generate
    ranks (--ranks N): the verl trainer in N worker processes (trainer.ranks): init -> step ->
        bucketed push (checked exact) -> generate. One process per GPU on CUDA (skipped when
        N exceeds the GPUs here); N processes on gloo on CPU.

    python scripts/gpu_check.py                      # CUDA, ~0.5B
    python scripts/gpu_check.py --ranks 1            # ... and the trainer in a worker process
    python scripts/gpu_check.py --device cpu --tiny  # the same code path on CPU in seconds
    python scripts/gpu_check.py --device cpu --tiny --ranks 2 --bucket-mb 0.1

Without verl (or when it cannot be imported) the trainer, LoRA and ranks parts are skipped with a
message and the weights pushed are the model's own, perturbed: the engine's sleep/wake/pushes
are still timed. A part that fails (the bucketed push, LoRA, ranks) prints why and the rest of
the check still runs; the exit status is then 1 and ``failed_parts`` names it.
``scripts/gpu_check.sh`` sets verl up on a machine that lacks it and runs this. The last line of
output is a JSON object with every timing (seconds) and these results:

    param_dtype            the verl trainer's compute dtype ("bf16" or "fp32")
    bf16_step_s            the second (warm) verl step when param_dtype is bf16, else null
    bucketed_push_s        the last bucketed push (buckets of --bucket-mb MiB); ``buckets``: how
                           many; ``push_exact``: the engine's weights equal the trainer's
                           state_dict_for_engine() cast to the engine's dtype after every
                           bucketed push; ``push_changed``: tensors the last one changed
    weight_push            the last full push (trainer_state_dict: building its state dict)
    memory_after_offload   {"allocated_mib", "reserved_mib"} on CUDA after the trainer's offload
                           with the engine asleep (second round); null on CPU
    lora_step_s, lora_push_s, lora_push_exact     the LoRA trainer's first step, its push
    ranked_step_s, ranked_push_s, ranked_push_exact   the ranks part's first step, its push
    failed_parts           the parts that failed (empty when all ran or were skipped)

Keys of a part that was skipped or failed are null.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from appliance.engines.base import GenerateRequest, GenerateResult, SamplingParams
from appliance.engines.buckets import WeightBucket, bucket_tensors, pack_buckets, stream_buckets
from appliance.engines.lora import served_adapter
from appliance.engines.torch_engine import TorchEngine

T = TypeVar("T")
TIMINGS: dict[str, Any] = {}
#: Whether the check runs on CUDA (timings then synchronize the device first).
ON_CUDA = False
#: The parts that failed (each printed its error; the rest of the check ran on).
FAILED: list[str] = []
#: Keys every run's JSON has (null when their part was skipped or failed).
RESULT_KEYS = (
    "param_dtype",
    "bf16_step_s",
    "bucketed_push_s",
    "buckets",
    "push_exact",
    "push_changed",
    "memory_after_offload",
    "lora_step_s",
    "lora_push_s",
    "lora_push_exact",
    "ranked_step_s",
    "ranked_push_s",
    "ranked_push_exact",
)

Batch = tuple[list[list[int]], list[GenerateResult]]


def report(name: str, seconds: float, extra: str = "") -> None:
    TIMINGS[name] = round(seconds, 4)
    print(f"  {name:<28} {seconds:9.3f} s  {extra}", flush=True)


def note(text: str) -> None:
    """A result line under the timings (no time of its own)."""
    print(f"  {'':<28} {'':>9}    {text}", flush=True)


def timed(name: str, fn: Callable[[], T], extra: Callable[[T], str] = lambda _: "") -> T:
    sync()
    start = time.perf_counter()
    value = fn()
    sync()
    report(name, time.perf_counter() - start, extra(value))
    return value


async def atimed(name: str, aw: Awaitable[T]) -> T:
    sync()
    start = time.perf_counter()
    value = await aw
    sync()
    report(name, time.perf_counter() - start)
    return value


async def guarded(part: str, aw: Awaitable[None]) -> bool:
    """Run one part of the check; a failure prints why and is recorded, and the check goes on."""
    try:
        await aw
        return True
    except Exception as exc:
        traceback.print_exc()
        print(f"\n{part.upper()} FAILED: {type(exc).__name__}: {exc}", flush=True)
        print("  the rest of the check still runs\n", flush=True)
        FAILED.append(part)
        TIMINGS[f"{part}_error"] = f"{type(exc).__name__}: {exc}"
        return False


def sync() -> None:
    if ON_CUDA:
        torch.cuda.synchronize()


def gpu_memory() -> str:
    if not ON_CUDA:
        return ""
    return f"(GPU allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB)"


def memory_mib() -> dict[str, float] | None:
    """What this process holds on the GPU (allocated by tensors, reserved by the caching
    allocator), MiB; None on CPU."""
    if not ON_CUDA:
        return None
    return {
        "allocated_mib": round(torch.cuda.memory_allocated() / 2**20, 1),
        "reserved_mib": round(torch.cuda.memory_reserved() / 2**20, 1),
    }


def build_model(directory: Path, *, tiny: bool, device: str) -> Path:
    """A random Qwen2 saved as an HF model dir: Qwen2.5-0.5B's shape (494M parameters) or tiny."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if tiny:
        config = Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        )
    else:
        config = Qwen2Config(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        )
    torch.manual_seed(0)
    model_class: Any = Qwen2ForCausalLM
    # Initialised on the device (much faster than a CPU init for 0.5B), saved in bf16.
    with torch.device(device):
        model = model_class(config)
    n_params = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(directory)
    del model
    TIMINGS["parameters"] = n_params
    return directory


async def generate(engine: TorchEngine, prompts: list[list[int]], max_tokens: int) -> list[GenerateResult]:
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0)
    requests = [GenerateRequest(prompt_ids=p, params=params) for p in prompts]
    return await asyncio.gather(*(engine.generate(r) for r in requests))


def train_items(prompts: list[list[int]], results: list[GenerateResult]) -> list[Any]:
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


def make_trainer(model_dir: Path, device: str, param_dtype: str) -> Any:
    """The verl FSDP trainer, or None (with the reason printed) if verl cannot run here."""
    try:
        from trainer.verl_backend import VerlFSDPTrainer

        build = lambda: VerlFSDPTrainer(model_dir, device=device, lr=1e-6, param_dtype=param_dtype)  # noqa: E731
        return timed("trainer_init", build, lambda _: f"{param_dtype} {gpu_memory()}")
    except Exception as exc:
        traceback.print_exc()
        print(f"\nVERL TRAINER UNAVAILABLE: {type(exc).__name__}: {exc}", flush=True)
        print("  the verl part is skipped; the engine's sleep/wake/weight push are still timed\n", flush=True)
        TIMINGS["verl"] = f"unavailable: {type(exc).__name__}: {exc}"
        return None


def perturbed_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Stand-in for the trainer's weights: the checkpoint's own, nudged (so the push changes them)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(file))
    return {k: v.float().add_(1e-3) for k, v in state.items()}


def differing(engine: TorchEngine, expected: dict[str, torch.Tensor]) -> tuple[list[str], int]:
    """The engine's tensors that differ from ``expected`` cast to the engine's dtype (a tied LM
    head, when ``expected`` leaves it out, is compared with the embedding), and how many the
    engine has."""
    model: Any = engine._model
    own: dict[str, torch.Tensor] = model.state_dict()
    expected = dict(expected)
    tied = "lm_head.weight", "model.embed_tokens.weight"
    if model.config.tie_word_embeddings and tied[0] not in expected and tied[1] in expected:
        expected[tied[0]] = expected[tied[1]]
    names = sorted(own.keys() | expected.keys())
    bad = [
        name
        for name in names
        if name not in own
        or name not in expected
        or own[name].shape != expected[name].shape
        or not torch.equal(own[name].detach().cpu(), expected[name].to(own[name].dtype))
    ]
    return bad, len(own)


async def bucketed_push(engine: TorchEngine, buckets: Iterator[WeightBucket], version: int, name: str) -> int:
    """``engine.load_weight_buckets`` over ``buckets`` (each next() in a worker thread), timed as
    ``name``; returns how many buckets came."""
    count = 0

    def counted() -> Iterator[WeightBucket]:
        nonlocal count
        try:
            for bucket in buckets:
                count += 1
                yield bucket
        finally:
            close = getattr(buckets, "close", None)  # unlinks the file; ends a ranks push
            if close is not None:
                close()

    await atimed(name, engine.load_weight_buckets(stream_buckets(counted()), version))
    return count


async def checked_push(
    engine: TorchEngine,
    buckets: Iterator[WeightBucket],
    expected: dict[str, torch.Tensor],
    version: int,
    name: str,
) -> tuple[bool, int, int]:
    """A bucketed push of ``expected``'s weights, then whether the engine holds exactly them.
    Returns (exact, how many tensors the push changed, how many buckets came)."""
    before, total = differing(engine, expected)
    count = await bucketed_push(engine, buckets, version, name)
    after, _ = differing(engine, expected)
    exact = not after
    verdict = "exact" if exact else f"NOT EXACT: {len(after)} tensors differ, e.g. {after[:3]}"
    note(f"{count} bucket(s); changed {len(before)} of {total} tensors; {verdict}")
    return exact, len(before), count


async def train_and_push(
    engine: TorchEngine,
    trainer: Any,
    model_dir: Path,
    round_: int,
    batch: Batch,
    bucket_bytes: int,
) -> None:
    """One collocation round: [sleep, onload,] step, offload, wake weights, bucketed push, full
    push, wake cache."""
    if round_ > 1:
        await atimed("engine_sleep", engine.sleep(1))
    if trainer is not None:
        if round_ > 1:
            timed("trainer_onload", trainer.onload, lambda _: gpu_memory())
        items = train_items(*batch)
        out = timed(f"train_step_{round_}", lambda: trainer.step(items))
        note(f"loss {out.loss:+.4f} grad_norm {out.grad_norm:.4f}")
        TIMINGS[f"train_step_{round_}_metrics"] = out.metrics()
        timed("trainer_offload", trainer.offload, lambda _: gpu_memory())
        weights = timed("trainer_state_dict", trainer.state_dict_for_engine)
    else:
        weights = timed("load_stand_in_weights", lambda: perturbed_weights(model_dir))
    memory = memory_mib()
    TIMINGS["memory_after_offload"] = memory
    where = "trainer offloaded, engine asleep" if trainer is not None else "engine asleep"
    if memory is None:
        note(f"memory after offload ({where}): not measured on CPU")
    else:
        note(
            f"memory after offload ({where}): {memory['allocated_mib']:.0f} MiB allocated, "
            f"{memory['reserved_mib']:.0f} MiB reserved"
        )
    await atimed("engine_wake_weights", engine.wake(["weights"]))

    async def push_buckets() -> None:
        if trainer is not None:
            buckets = trainer.weight_buckets(bucket_bytes)
        else:
            tied = bool(engine._model.config.tie_word_embeddings)
            tensors = [(k, v) for k, v in weights.items() if not (tied and k == "lm_head.weight")]
            buckets = pack_buckets(tensors, bucket_bytes=bucket_bytes)
        exact, changed, count = await checked_push(engine, buckets, weights, round_, "bucketed_push_s")
        # Exact only if every round's push was.
        TIMINGS["push_exact"] = exact and TIMINGS.get("push_exact", True) is not False
        TIMINGS["push_changed"], TIMINGS["buckets"] = changed, count

    if not await guarded("bucketed_push", push_buckets()):
        TIMINGS["push_exact"] = False  # not shown exact; failed_parts says why
    await atimed("weight_push", engine.load_weights(weights, round_))
    await atimed("engine_wake_kv_cache", engine.wake(["kv_cache"]))


async def lora_part(
    engine: TorchEngine,
    model_dir: Path,
    device: str,
    param_dtype: str,
    batch: Batch,
    bucket_bytes: int,
    version: int,
) -> None:
    """A LoRA trainer (rank 8, alpha 16): one step on the same samples, then a bucketed push of
    its adapters alone, then the engine serves them on its base weights."""
    from trainer.verl_backend import VerlFSDPTrainer

    print("LoRA (rank 8, alpha 16):", flush=True)
    await engine.sleep(1)
    build = lambda: VerlFSDPTrainer(  # noqa: E731
        model_dir, device=device, lr=1e-5, param_dtype=param_dtype, lora_rank=8, lora_alpha=16
    )
    lora = timed("lora_init_s", build, lambda _: gpu_memory())
    out = timed("lora_step_s", lambda: lora.step(train_items(*batch)))
    note(f"loss {out.loss:+.4f} grad_norm {out.grad_norm:.4f}")
    lora.offload()
    await engine.wake(["weights"])
    pushed: dict[str, torch.Tensor] = {}

    def capturing() -> Iterator[WeightBucket]:
        for bucket in lora.weight_buckets(bucket_bytes):
            pushed.update((name, tensor.clone()) for name, tensor in bucket_tensors(bucket))
            yield bucket

    count = await bucketed_push(engine, capturing(), version, "lora_push_s")
    # Adapters alone travel; the engine serves exactly them (in its dtype) on its base weights.
    served = served_adapter(engine._model)
    exact = served.keys() == pushed.keys() and all(
        torch.equal(served[name], tensor.to(served[name].dtype)) for name, tensor in pushed.items()
    )
    TIMINGS["lora_push_bytes"] = sum(t.numel() * t.element_size() for t in pushed.values())
    note(f"{count} bucket(s), {len(pushed)} adapter tensors; {'exact' if exact else 'NOT EXACT'}")
    TIMINGS["lora_push_exact"] = exact
    await engine.wake(["kv_cache"])
    await serves(engine, batch, version)


async def ranked_part(
    engine: TorchEngine,
    model_dir: Path,
    args: argparse.Namespace,
    param_dtype: str,
    batch: Batch,
    bucket_bytes: int,
    version: int,
) -> None:
    """The verl trainer in ``args.ranks`` worker processes: one step, a bucketed push (rank 0
    packs; at 2+ ranks each rank writes its own shards into the file), the engine serves it."""
    from trainer.ranks import RankedTrainer

    print(f"ranks ({args.ranks} worker process(es), {args.device}):", flush=True)
    await engine.sleep(1)
    threads = args.threads if args.device == "cpu" else None
    build = lambda: RankedTrainer(  # noqa: E731
        model_dir, ranks=args.ranks, threads=threads, device=args.device, lr=1e-6, param_dtype=param_dtype
    )
    ranked = timed("ranked_init_s", build)
    try:
        out = timed("ranked_step_s", lambda: ranked.step(train_items(*batch)))
        note(f"loss {out.loss:+.4f} grad_norm {out.grad_norm:.4f}")
        ranked.offload()
        weights = ranked.state_dict_for_engine()
        await engine.wake(["weights"])
        buckets = ranked.weight_buckets(bucket_bytes)
        exact, _, _ = await checked_push(engine, buckets, weights, version, "ranked_push_s")
        TIMINGS["ranked_push_exact"] = exact
        await engine.wake(["kv_cache"])
        await serves(engine, batch, version)
    finally:
        ranked.close()


async def serves(engine: TorchEngine, batch: Batch, version: int) -> None:
    """The engine generates again (a few tokens), with the weights of ``version``."""
    again = await generate(engine, batch[0], 4)
    if not all(r.policy_version == version for r in again):
        raise AssertionError(f"the engine does not serve the pushed version {version}")


async def run(args: argparse.Namespace) -> int:
    global ON_CUDA
    device = args.device
    ON_CUDA = device == "cuda"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    param_dtype = args.param_dtype or ("bf16" if ON_CUDA else "fp32")
    bucket_bytes = max(1, int(args.bucket_mb * 2**20))
    if device == "cpu":
        torch.set_num_threads(max(1, args.threads))
    prompt_len, max_tokens, batch = (8, 8, 4) if args.tiny else (64, 64, 8)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        import transformers

        python = sys.version.split()[0]
        versions = f"python {python}, torch {torch.__version__}, transformers {transformers.__version__}"
        print(f"gpu check: device={device} tiny={args.tiny} ({versions})", flush=True)
        model_dir = Path(args.model_dir) if args.model_dir else Path(tmp) / "model"
        if not args.model_dir:
            timed("build_random_model", lambda: build_model(model_dir, tiny=args.tiny, device=device))
            print(f"  parameters: {TIMINGS['parameters'] / 1e6:.1f} M", flush=True)
        engine = TorchEngine(model_dir, device=device, dtype=dtype, max_batch_size=batch)
        await atimed("engine_load", engine.start())
        vocab = min(engine_vocab(model_dir), 50000)
        prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]
        results = await atimed("generate_first", generate(engine, prompts, max_tokens))
        samples: Batch = (prompts, results)
        await atimed("engine_sleep", engine.sleep(1))
        trainer = None if args.skip_verl else make_trainer(model_dir, device, param_dtype)
        if trainer is not None:
            TIMINGS["param_dtype"] = param_dtype
        TIMINGS["bucket_mb"] = args.bucket_mb
        for round_ in (1, 2):
            await train_and_push(engine, trainer, model_dir, round_, samples, bucket_bytes)
            results = await atimed(f"generate_after_push_{round_}", generate(engine, prompts, max_tokens))
            assert all(r.policy_version == round_ for r in results), "the engine serves the pushed version"
        if trainer is not None and param_dtype == "bf16":
            TIMINGS["bf16_step_s"] = TIMINGS["train_step_2"]
        version = 2
        if trainer is None:
            print("LoRA and ranks parts skipped: they need the verl trainer", flush=True)
        else:
            version += 1
            await guarded(
                "lora", lora_part(engine, model_dir, device, param_dtype, samples, bucket_bytes, version)
            )
            gpus = torch.cuda.device_count() if ON_CUDA else 0
            if args.ranks < 1:
                print("ranks part skipped (--ranks 0)", flush=True)
            elif ON_CUDA and args.ranks > gpus:
                print(
                    f"ranks part skipped: --ranks {args.ranks} needs a GPU per rank, {gpus} here", flush=True
                )
                TIMINGS["ranked"] = f"skipped: {gpus} GPU(s) for {args.ranks} ranks"
            else:
                version += 1
                part = ranked_part(engine, model_dir, args, param_dtype, samples, bucket_bytes, version)
                await guarded("ranked", part)
        await engine.close()
    TIMINGS["device"] = device
    TIMINGS["verl_ran"] = trainer is not None
    TIMINGS["ranks"] = args.ranks
    for key in RESULT_KEYS:
        TIMINGS.setdefault(key, None)
    TIMINGS["failed_parts"] = FAILED
    print(json.dumps(TIMINGS), flush=True)
    return 1 if FAILED or (args.require_verl and trainer is None) else 0


def engine_vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model instead of ~0.5B")
    parser.add_argument("--model-dir", help="an existing HF model directory instead of a random model")
    parser.add_argument("--skip-verl", action="store_true", help="time the engine switches only")
    parser.add_argument("--require-verl", action="store_true", help="exit 1 if the verl trainer cannot run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default 1)")
    parser.add_argument(
        "--param-dtype",
        choices=["bf16", "fp32"],
        help="the verl trainers' compute dtype (default: bf16 on CUDA, fp32 on CPU)",
    )
    parser.add_argument(
        "--bucket-mb", type=float, default=256.0, help="bucket size of the bucketed pushes, MiB (default 256)"
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=0,
        help="also run the trainer in N worker processes (trainer.ranks; one GPU each on CUDA); 0: skip",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; use --device cpu (with --tiny for a quick smoke run)")
    if args.bucket_mb <= 0 or args.ranks < 0:
        parser.error("--bucket-mb must be > 0 and --ranks >= 0")
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
