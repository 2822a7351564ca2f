"""GPU check: the collocation switches of one machine, timed on a ~0.5B-parameter model.

One straight-line run of what the appliance does around a training step when generation and
training share an accelerator, printing how long each switch takes:

    build a random Qwen2 (~0.5B, Qwen2.5-0.5B's shape; random weights are fine for timing)
    torch engine: load -> generate -> sleep(1)
    verl FSDP trainer: init -> step (on the engine's own samples) -> offload
    torch engine: wake weights -> weight push (trainer -> engine) -> wake kv cache -> generate
    again: sleep -> trainer onload -> step -> offload -> wake -> push -> generate

    python scripts/gpu_check.py                      # CUDA, ~0.5B
    python scripts/gpu_check.py --device cpu --tiny  # the same code path on CPU in seconds

Without verl (or when it cannot be imported) the trainer part is skipped with a message and the
weights pushed are the model's own, perturbed: the engine's sleep/wake/push are still timed.
``scripts/gpu_check.sh`` sets verl up on a machine that lacks it and runs this. The last line of
output is a JSON object with every timing.
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
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from appliance.engines.base import GenerateRequest, GenerateResult, SamplingParams
from appliance.engines.torch_engine import TorchEngine

T = TypeVar("T")
TIMINGS: dict[str, Any] = {}
#: Whether the check runs on CUDA (timings then synchronize the device first).
ON_CUDA = False


def report(name: str, seconds: float, extra: str = "") -> None:
    TIMINGS[name] = round(seconds, 4)
    print(f"  {name:<28} {seconds:9.3f} s  {extra}", flush=True)


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


def sync() -> None:
    if ON_CUDA:
        torch.cuda.synchronize()


def gpu_memory() -> str:
    if not ON_CUDA:
        return ""
    return f"(GPU allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB)"


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


def make_trainer(model_dir: Path, device: str) -> Any:
    """The verl FSDP trainer, or None (with the reason printed) if verl cannot run here."""
    try:
        from trainer.verl_backend import VerlFSDPTrainer

        build = lambda: VerlFSDPTrainer(model_dir, device=device, lr=1e-6)  # noqa: E731
        return timed("trainer_init", build, lambda _: gpu_memory())
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


async def train_and_push(
    engine: TorchEngine,
    trainer: Any,
    model_dir: Path,
    round_: int,
    batch: tuple[list[list[int]], list[GenerateResult]],
) -> None:
    """One collocation round: [sleep, onload,] step, offload, wake weights, push, wake cache."""
    if round_ > 1:
        await atimed("engine_sleep", engine.sleep(1))
    if trainer is not None:
        if round_ > 1:
            timed("trainer_onload", trainer.onload, lambda _: gpu_memory())
        items = train_items(*batch)
        out = timed(f"train_step_{round_}", lambda: trainer.step(items))
        print(f"  {'':<28} {'':>9}    loss {out.loss:+.4f} grad_norm {out.grad_norm:.4f}", flush=True)
        TIMINGS[f"train_step_{round_}_metrics"] = out.metrics()
        timed("trainer_offload", trainer.offload, lambda _: gpu_memory())
        weights = timed("trainer_state_dict", trainer.state_dict_for_engine)
    else:
        weights = timed("load_stand_in_weights", lambda: perturbed_weights(model_dir))
    await atimed("engine_wake_weights", engine.wake(["weights"]))
    await atimed("weight_push", engine.load_weights(weights, round_))
    await atimed("engine_wake_kv_cache", engine.wake(["kv_cache"]))


async def run(args: argparse.Namespace) -> int:
    global ON_CUDA
    device = args.device
    ON_CUDA = device == "cuda"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
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
        await atimed("engine_sleep", engine.sleep(1))
        trainer = None if args.skip_verl else make_trainer(model_dir, device)
        for round_ in (1, 2):
            await train_and_push(engine, trainer, model_dir, round_, (prompts, results))
            results = await atimed(f"generate_after_push_{round_}", generate(engine, prompts, max_tokens))
            assert all(r.policy_version == round_ for r in results), "the engine serves the pushed version"
        await engine.close()
    TIMINGS["device"] = device
    TIMINGS["verl_ran"] = trainer is not None
    print(json.dumps(TIMINGS), flush=True)
    return 1 if (args.require_verl and trainer is None) else 0


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
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; use --device cpu (with --tiny for a quick smoke run)")
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
