"""VerlFSDPTrainer: real steps of verl's FSDP engine on CPU (gloo, world size 1, tiny Qwen2).

Learning direction, agreement with the plain-torch backend, offload/onload, the reference KL,
LoRA, the other losses, checkpoints and the weights handed to the engine.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from transformers import AutoModelForCausalLM

from tests.trainer.helpers import sample, sampled_logprob
from trainer.checkpoints import CheckpointError, CheckpointStore
from trainer.items import StepOutput, TrainItem
from trainer.normalization import NORMALIZATIONS, check_normalization
from trainer.policy import PolicyTrainer
from trainer.verl_backend import VerlFSDPTrainer

GOOD, BAD = [10, 11, 12], [20, 21, 22]


@pytest.fixture
def hf_model(tiny_model_dir: Path) -> Iterator[Any]:
    """An HF copy of the policy (what the engine would serve), to score samples on-policy."""
    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    yield model.eval()


def sync(trainer: VerlFSDPTrainer, model: Any) -> Any:
    """Push the trainer's weights into ``model`` as the appliance pushes them into the engine."""
    model.load_state_dict(trainer.state_dict_for_engine(), strict=True)
    return model


def finite(out: StepOutput) -> bool:
    return all(math.isfinite(x) for x in (out.loss, out.grad_norm, out.entropy, out.ppo_kl))


def test_a_real_step_raises_positively_rewarded_tokens(tiny_model_dir: Path, hf_model: Any) -> None:
    trainer = VerlFSDPTrainer(tiny_model_dir, lr=1e-2)
    before = sampled_logprob(hf_model, GOOD), sampled_logprob(hf_model, BAD)
    for k in range(4):
        model = sync(trainer, hf_model)
        items = [
            TrainItem("A", 1.0, (sample(model, "A", GOOD),), reward=1.0),
            TrainItem("B", -1.0, (sample(model, "B", BAD),), reward=0.0),
        ]
        out = trainer.step(items)
        assert out.updated and finite(out)
        assert (out.step, out.tokens, out.samples, out.rollouts) == (k + 1, 6, 2, 2)
        # On-policy: importance weights 1, nothing clipped, loss mean_r(-A_r) = 0.
        assert out.loss == pytest.approx(0.0, abs=1e-5)
        assert out.is_weight_mean == pytest.approx(1.0, abs=1e-5)
        assert out.pg_clipfrac == 0.0
        assert out.grad_norm > 0
        assert 0 < out.entropy < math.log(300) + 1e-4
    after = sampled_logprob(sync(trainer, hf_model), GOOD), sampled_logprob(hf_model, BAD)
    assert after[0] > before[0] + 0.5
    assert after[1] < before[1] - 0.5
    assert out.metrics()["reward_mean"] == 0.5


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("remove_padding", [True, False], ids=["packed", "padded"])
def test_same_loss_and_gradient_norm_as_the_torch_backend(
    tiny_model_dir: Path, normalization: str, remove_padding: bool
) -> None:
    """Packed micro-batches (the default: several sequences in one row, separated by their
    position ids) and padded ones compute what the torch backend computes sample by sample."""
    mode = check_normalization(normalization)
    torch_trainer = PolicyTrainer(tiny_model_dir, normalization=mode)
    verl_trainer = VerlFSDPTrainer(
        tiny_model_dir, off_policy="bypass", normalization=mode, remove_padding=remove_padding
    )
    model = torch_trainer.model
    # Several samples per rollout, some stale (so some ratios are clipped), uneven lengths.
    items = [
        TrainItem("A", 1.0, (sample(model, "A", [10]), sample(model, "A", [11, 12, 13], shift=0.3))),
        TrainItem("B", -0.5, (sample(model, "B", [20, 21, 22, 23, 24], shift=-0.25),)),
        TrainItem("C", 0.7, (sample(model, "C", [30, 31]),)),
    ]
    ours, theirs = verl_trainer.step(items), torch_trainer.step(items)
    assert ours.tokens == theirs.tokens == 11
    assert ours.loss == pytest.approx(theirs.loss, abs=1e-5)
    assert ours.grad_norm == pytest.approx(theirs.grad_norm, rel=1e-4)
    assert ours.pg_clipfrac == pytest.approx(theirs.pg_clipfrac, abs=1e-6)
    assert ours.ppo_kl == pytest.approx(theirs.ppo_kl, abs=1e-5)
    assert ours.entropy == pytest.approx(theirs.entropy, abs=1e-4)
    assert theirs.pg_clipfrac > 0  # the comparison covered clipped tokens


def test_decoupled_mode_matches_the_torch_backend_too(tiny_model_dir: Path) -> None:
    torch_trainer = PolicyTrainer(tiny_model_dir, off_policy="decoupled", is_cap=1.3)
    verl_trainer = VerlFSDPTrainer(tiny_model_dir, off_policy="decoupled", is_cap=1.3)
    model = torch_trainer.model
    items = [
        TrainItem("A", 1.0, (sample(model, "A", [10, 11], shift=0.5), sample(model, "A", [12]))),
        TrainItem("B", -1.0, (sample(model, "B", [20, 21, 22], shift=0.1),)),
    ]
    ours, theirs = verl_trainer.step(items), torch_trainer.step(items)
    assert ours.loss == pytest.approx(theirs.loss, abs=1e-5)
    assert ours.grad_norm == pytest.approx(theirs.grad_norm, rel=1e-4)
    assert ours.is_weight_mean == pytest.approx(theirs.is_weight_mean, abs=1e-5)
    assert ours.is_capped_frac == theirs.is_capped_frac == pytest.approx(2 / 6)


def test_offload_onload_round_trip_keeps_weights_and_optimizer_state(
    tiny_model_dir: Path, hf_model: Any
) -> None:
    trainer = VerlFSDPTrainer(tiny_model_dir, lr=1e-2)
    trainer.step([TrainItem("A", 1.0, (sample(hf_model, "A", GOOD),))])
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def optimizer_state() -> dict[str, torch.Tensor]:
        state: Any = get_optimizer_state_dict(
            trainer.engine.module, trainer.engine.optimizer, options=options
        )
        return {f"{p}.{k}": v.clone() for p, s in state["state"].items() for k, v in s.items()}

    weights, optim = trainer.state_dict_for_engine(), optimizer_state()
    assert optim  # Adam moments exist after a step
    trainer.offload()
    trainer.onload()
    after_weights, after_optim = trainer.state_dict_for_engine(), optimizer_state()
    assert weights.keys() == after_weights.keys() and optim.keys() == after_optim.keys()
    assert all(torch.equal(weights[k], after_weights[k]) for k in weights)
    assert all(torch.equal(optim[k], after_optim[k]) for k in optim)
    trainer.offload()  # a step after an offload onloads by itself
    assert trainer.step([TrainItem("A", 1.0, (sample(sync(trainer, hf_model), "A", GOOD),))]).updated


def test_all_zero_advantages_run_forward_only(tiny_model_dir: Path, hf_model: Any) -> None:
    trainer = VerlFSDPTrainer(tiny_model_dir, lr=1e-2)
    trainer.step([TrainItem("A", 1.0, (sample(hf_model, "A", GOOD),))])
    before = trainer.state_dict_for_engine()
    out = trainer.step([TrainItem("B", 0.0, (sample(sync(trainer, hf_model), "B", BAD),))])
    assert (out.updated, out.step, out.tokens, out.grad_norm) == (False, 2, 3, 0.0)
    assert out.loss == 0.0 and out.entropy > 0
    after = trainer.state_dict_for_engine()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_kl_to_a_reference_model(tiny_model_dir: Path, hf_model: Any) -> None:
    trainer = VerlFSDPTrainer(tiny_model_dir, lr=1e-2, kl_coef=0.5)
    first = trainer.step([TrainItem("A", 1.0, (sample(hf_model, "A", GOOD),))])
    assert first.kl_ref == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    second = trainer.step([TrainItem("A", 1.0, (sample(sync(trainer, hf_model), "A", GOOD),))])
    # k3 = exp(ref - logp) - (ref - logp) - 1 >= 0, and > 0 once the policy moved; the loss
    # is the on-policy -A = -1 plus the weighted KL term.
    assert second.kl_ref > 1e-4
    assert second.loss == pytest.approx(-1.0 + 0.5 * second.kl_ref, abs=1e-5)


def test_lora_trains_adapters_and_hands_over_merged_weights(tiny_model_dir: Path, hf_model: Any) -> None:
    trainer = VerlFSDPTrainer(tiny_model_dir, lr=1e-2, lora_rank=4, kl_coef=0.1)
    base = {k: v.clone() for k, v in hf_model.state_dict().items()}
    before = sampled_logprob(hf_model, GOOD)
    for _ in range(3):
        out = trainer.step([TrainItem("A", 1.0, (sample(sync(trainer, hf_model), "A", GOOD),))])
        assert out.updated and finite(out)
    state = trainer.state_dict_for_engine()
    assert state.keys() == base.keys()
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    # Adapters on the linear layers only: embeddings and norms are the base's.
    assert torch.equal(state["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert torch.equal(state["model.norm.weight"], base["model.norm.weight"])
    assert not torch.equal(
        state["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"]
    )
    assert sampled_logprob(sync(trainer, hf_model), GOOD) > before + 0.1
    assert out.kl_ref > 0


@pytest.mark.parametrize(("loss", "mini_batches"), [("gspo", 1), ("cispo", 1), ("ppo", 2), ("gspo", 2)])
def test_other_losses_and_mini_batches_run(
    tiny_model_dir: Path, hf_model: Any, loss: str, mini_batches: int
) -> None:
    trainer = VerlFSDPTrainer(tiny_model_dir, lr=1e-2, loss=loss, mini_batches=mini_batches)  # type: ignore[arg-type]
    model = sync(trainer, hf_model)
    items = [
        TrainItem("A", 1.0, (sample(model, "A", GOOD), sample(model, "A", [13, 14]))),
        TrainItem("B", -1.0, (sample(model, "B", BAD),)),
    ]
    out = trainer.step(items)
    assert out.updated and finite(out) and out.grad_norm > 0
    assert (out.tokens, out.samples, out.rollouts) == (8, 3, 2)


def test_checkpoint_resume_continues_identically(tiny_model_dir: Path, hf_model: Any, tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    trainer = VerlFSDPTrainer(tiny_model_dir, lr=1e-2)
    item = TrainItem("A", 1.0, (sample(hf_model, "A", GOOD),))
    trainer.step([item])
    assert trainer.save(store, 1) == store.path(1)
    resumed = VerlFSDPTrainer(tiny_model_dir, lr=1e-2)
    assert resumed.load(store) == 1
    assert resumed.global_step == 1
    trainer.step([item])
    resumed.step([item])
    theirs, ours = trainer.state_dict_for_engine(), resumed.state_dict_for_engine()
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)
    # The model part uses the HF names, as the torch backend's does; the rest does not mix.
    with pytest.raises(CheckpointError, match="written by the 'verl' backend"):
        PolicyTrainer(tiny_model_dir).load(store, 1)
    with pytest.raises(CheckpointError, match="lora_rank 0; this trainer is 'verl' with lora_rank 2"):
        VerlFSDPTrainer(tiny_model_dir, lora_rank=2).load(store, 1)


def test_weights_for_the_engine_and_the_hf_export(
    tiny_model_dir: Path, hf_model: Any, tmp_path: Path
) -> None:
    trainer = VerlFSDPTrainer(tiny_model_dir, lr=1e-2)
    trainer.step([TrainItem("A", 1.0, (sample(hf_model, "A", GOOD),))])
    state = trainer.state_dict_for_engine()
    assert list(state) == list(hf_model.state_dict())
    assert all(t.device.type == "cpu" and not t.requires_grad for t in state.values())
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    exported = AutoModelForCausalLM.from_pretrained(trainer.export_hf(tmp_path / "final"))
    assert all(torch.equal(exported.state_dict()[k], state[k]) for k in state)


def test_invalid_items_and_options_are_rejected(tiny_model_dir: Path, hf_model: Any) -> None:
    trainer = VerlFSDPTrainer(tiny_model_dir)
    a = sample(hf_model, "A", [10])
    with pytest.raises(ValueError, match="at least one rollout"):
        trainer.step([])
    with pytest.raises(ValueError, match="appears twice"):
        trainer.step([TrainItem("A", 1.0, (a,)), TrainItem("A", 1.0, (a,))])
    with pytest.raises(ValueError, match="unknown off_policy 'sometimes'"):
        VerlFSDPTrainer(tiny_model_dir, off_policy="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown loss 'dpo'"):
        VerlFSDPTrainer(tiny_model_dir, loss="dpo")  # type: ignore[arg-type]


def test_gradient_checkpointing_and_truncation(tiny_model_dir: Path, hf_model: Any) -> None:
    plain = VerlFSDPTrainer(tiny_model_dir, max_sample_tokens=5)
    checkpointed = VerlFSDPTrainer(tiny_model_dir, max_sample_tokens=5, gradient_checkpointing=True)
    long = sample(hf_model, "A", [10, 11, 12, 13])  # 7 tokens: cut to 5, 2 of them trained
    items = [TrainItem("A", 1.0, (long,)), TrainItem("B", -1.0, (sample(hf_model, "B", [20]),))]
    ours, theirs = checkpointed.step(items), plain.step(items)
    assert (ours.tokens, ours.truncated_samples) == (3, 1)
    # Recomputing activations in the backward changes nothing numerically.
    assert ours.grad_norm == pytest.approx(theirs.grad_norm, rel=1e-5)


async def test_driven_from_worker_threads_as_the_training_service_does(
    tiny_model_dir: Path, hf_model: Any, tmp_path: Path
) -> None:
    # appliance.training.service runs construction, steps and saves through asyncio.to_thread: each call
    # may land on a different pool thread; the one process group serves them all.
    trainer = await asyncio.to_thread(VerlFSDPTrainer, tiny_model_dir, lr=1e-2)
    items = [TrainItem("A", 1.0, (sample(hf_model, "A", GOOD),))]
    outs = [await asyncio.to_thread(trainer.step, items) for _ in range(2)]
    assert all(out.updated and finite(out) for out in outs)
    path = await asyncio.to_thread(trainer.save, CheckpointStore(tmp_path / "checkpoints"), 1)
    assert path.is_file()
    assert await asyncio.to_thread(trainer.state_dict_for_engine)
