"""PolicyTrainer (the plain-torch backend) on a real (tiny, random) Qwen2: learning direction,
normalization, loss options, collocation, weights and checkpoints."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.trainer.helpers import sample, sampled_logprob
from trainer.checkpoints import CheckpointError, CheckpointStore
from trainer.policy import PolicyTrainer, TrainItem
from trainer.samples import Sample


def grads(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in trainer.model.named_parameters()
    }


def assert_grads_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-4, msg=name)


def test_positive_advantage_rises_negative_falls(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir, lr=1e-2)
    good, bad = [10, 11, 12], [20, 21, 22]
    before = sampled_logprob(trainer.model, good), sampled_logprob(trainer.model, bad)
    for k in range(4):
        # Fresh on-policy samples each step, as the engine would produce after a weight sync.
        items = [
            TrainItem("A", 1.0, (sample(trainer.model, "A", good),)),
            TrainItem("B", -1.0, (sample(trainer.model, "B", bad),)),
        ]
        out = trainer.step(items)
        assert out.updated
        assert out.step == k + 1
        assert (out.tokens, out.samples, out.rollouts) == (6, 2, 2)
        assert all(map(torch.isfinite, map(torch.tensor, (out.loss, out.grad_norm, out.entropy))))
        # On-policy: ratio 1, nothing clipped, no KL, and the loss is mean_r(-A_r) = 0.
        assert out.ppo_kl == pytest.approx(0.0, abs=1e-5)
        assert out.pg_clipfrac == 0.0
        assert out.loss == pytest.approx(0.0, abs=1e-5)
        assert out.grad_norm > 0
    assert 0 < out.entropy < torch.log(torch.tensor(300.0)).item() + 1e-4
    after = sampled_logprob(trainer.model, good), sampled_logprob(trainer.model, bad)
    assert after[0] > before[0] + 0.5
    assert after[1] < before[1] - 0.5
    assert set(out.metrics()) == {
        "loss",
        "grad_norm",
        "pg_clipfrac",
        "ppo_kl",
        "entropy",
        "updated",
        "kl_ref",
        "is_weight_mean",
        "is_capped_frac",
        "tokens_per_s",
        "samples_per_rollout",
        "truncated_samples",
    }
    assert out.metrics()["samples_per_rollout"] == 1.0
    assert out.metrics()["tokens_per_s"] > 0


def test_loss_and_gradient_match_a_rollout_level_hand_computation(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir)
    model = trainer.model
    a_samples = (sample(model, "A", [10]), sample(model, "A", [11, 12]), sample(model, "A", [13, 14, 15, 16]))
    b_samples = (sample(model, "B", [20, 21, 22, 23, 24]),)
    adv = {"A": 1.0, "B": -0.5}
    totals = trainer.backward([TrainItem("A", adv["A"], a_samples), TrainItem("B", adv["B"], b_samples)])
    assert totals.tokens == 12
    # On-policy, so every token's loss is -A * ratio with ratio 1: mean_r(-A_r) = (-1 + 0.5) / 2.
    assert totals.loss == pytest.approx(-0.25, abs=1e-5)
    got = grads(trainer)

    # By hand: per-token loss -A * exp(logp - old), a token-mean per rollout, then a mean over
    # the two rollouts. Each sample is run alone (no padding).
    def per_rollout_losses(samples: Sequence[Sample], a: float) -> torch.Tensor:
        losses = []
        for s in samples:
            logits = model(input_ids=torch.tensor([s.tokens])).logits[0, :-1]
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.tokens[1:])[:, None])[:, 0]
            mask = torch.tensor(s.loss_mask[1:], dtype=torch.bool)
            old = torch.tensor(s.logprobs[1:])
            losses.append((-a * torch.exp(logp - old))[mask])
        return torch.cat(losses)

    per_a, per_b = per_rollout_losses(a_samples, adv["A"]), per_rollout_losses(b_samples, adv["B"])
    params = [p for _, p in model.named_parameters()]
    names = [n for n, _ in model.named_parameters()]
    rollout_level = (per_a.mean() + per_b.mean()) / 2
    expected = dict(zip(names, torch.autograd.grad(rollout_level, params, retain_graph=True), strict=True))
    assert_grads_close(got, expected)

    # The test can tell: a plain token-mean over the batch weighs the rollouts 8:5 and differs.
    token_level = torch.cat([per_a, per_b]).mean()
    wrong = dict(zip(names, torch.autograd.grad(token_level, params), strict=True))
    with pytest.raises(AssertionError):
        assert_grads_close(got, wrong)


def test_a_rollout_with_three_samples_weighs_the_same_as_with_one(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir)
    a, b = sample(trainer.model, "A", [10, 11]), sample(trainer.model, "B", [20, 21, 22])
    once = trainer.backward([TrainItem("A", 1.0, (a,)), TrainItem("B", -1.0, (b,))])
    g_once = grads(trainer)
    thrice = trainer.backward([TrainItem("A", 1.0, (a, a, a)), TrainItem("B", -1.0, (b,))])
    assert thrice.tokens == 3 * 2 + 3
    assert thrice.loss == pytest.approx(once.loss, abs=1e-6)
    assert_grads_close(grads(trainer), g_once)


def test_rollouts_without_trainable_tokens_do_not_dilute(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir)
    a = sample(trainer.model, "A", [10, 11])
    empty = Sample("C", ("c",), (5, 6), (0, 0), (0.0, 0.0), (-1, -1))
    trainer.backward([TrainItem("A", 1.0, (a,))])
    alone = grads(trainer)
    trainer.backward([TrainItem("A", 1.0, (a,)), TrainItem("C", 1.0, (empty,))])
    assert_grads_close(grads(trainer), alone)


def test_micro_batching_does_not_change_the_gradient(tiny_model_dir: Path) -> None:
    whole = PolicyTrainer(tiny_model_dir)
    split = PolicyTrainer(tiny_model_dir, max_tokens_per_microbatch=1)
    items = [
        TrainItem("A", 0.7, (sample(whole.model, "A", [10]), sample(whole.model, "A", [11, 12, 13]))),
        TrainItem("B", -1.3, (sample(whole.model, "B", [20, 21]),)),
    ]
    t_whole, t_split = whole.backward(items), split.backward(items)
    assert t_split.loss == pytest.approx(t_whole.loss, abs=1e-6)
    assert t_split.tokens == t_whole.tokens == 6
    assert_grads_close(grads(split), grads(whole))


def test_stale_logprobs_are_clipped(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir)
    # Recorded logprobs 0.5 below the policy's: ratio e^0.5 = 1.65 > 1 + 0.2, so with A > 0
    # every token is clipped: loss -A * 1.2, no gradient, and KL estimate old - new = -0.5.
    stale = sample(trainer.model, "A", [10, 11, 12], shift=0.5)
    out = trainer.step([TrainItem("A", 1.0, (stale,))])
    assert out.pg_clipfrac == 1.0
    assert out.ppo_kl == pytest.approx(-0.5, abs=1e-5)
    assert out.loss == pytest.approx(-1.2, abs=1e-5)
    assert out.grad_norm == 0.0


def test_temperature_matches_the_engine_sampling_distribution(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir, temperature=2.0)
    tempered = sample(trainer.model, "A", [10, 11, 12], temperature=2.0)
    out = trainer.step([TrainItem("A", 1.0, (tempered,))])
    assert out.ppo_kl == pytest.approx(0.0, abs=1e-5)
    assert out.pg_clipfrac == 0.0
    untempered = sample(trainer.model, "B", [10, 11, 12])
    # A near-uniform random model: the gap is small (~0.07) but far above the 1e-5 above.
    assert abs(trainer.step([TrainItem("B", 1.0, (untempered,))]).ppo_kl) > 0.01
    with pytest.raises(ValueError, match="temperature"):
        PolicyTrainer(tiny_model_dir, temperature=0.0)


def test_all_zero_advantages_run_but_do_not_update(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir, lr=1e-2)
    # A real update first, so Adam has momentum that a zero-gradient step would still apply.
    trainer.step([TrainItem("A", 1.0, (sample(trainer.model, "A", [10]),))])
    before = trainer.state_dict_for_engine()
    out = trainer.step([TrainItem("B", 0.0, (sample(trainer.model, "B", [20, 21]),))])
    assert not out.updated
    assert out.step == 2
    assert (out.loss, out.grad_norm, out.tokens) == (0.0, 0.0, 2)
    after = trainer.state_dict_for_engine()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_state_dict_for_engine_loads_strictly(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir, lr=1e-2)
    trainer.step([TrainItem("A", 1.0, (sample(trainer.model, "A", [10, 11]),))])
    state = trainer.state_dict_for_engine()
    engine_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert list(state) == list(engine_model.state_dict())
    engine_model.load_state_dict(state, strict=True)
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(engine_model.state_dict()[name], tensor), name
        assert state[name].device.type == "cpu"
        assert not state[name].requires_grad
    # Tied embeddings: both keys present, one copy.
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    # Copies, not views: training further does not change what the engine was given.
    snapshot = state["model.norm.weight"].clone()
    with torch.no_grad():
        trainer.model.model.norm.weight.add_(1.0)
    assert torch.equal(state["model.norm.weight"], snapshot)


def test_save_and_load_restore_model_optimizer_and_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    trainer = PolicyTrainer(tiny_model_dir, lr=1e-2)
    item = TrainItem("A", 1.0, (sample(trainer.model, "A", [10, 11]),))
    trainer.step([item])
    assert trainer.save(store, version=1) == store.path(1)
    saved = trainer.state_dict_for_engine()

    # A fresh trainer resumed from the checkpoint continues exactly like the original.
    resumed = PolicyTrainer(tiny_model_dir, lr=1e-2)
    assert resumed.load(store) == 1
    assert resumed.global_step == 1
    trainer.step([item])
    resumed.step([item])
    theirs, ours = trainer.state_dict_for_engine(), resumed.state_dict_for_engine()
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)

    # And loading rolls a trainer back.
    assert trainer.load(store, version=1) == 1
    assert trainer.global_step == 1
    now = trainer.state_dict_for_engine()
    assert all(torch.equal(saved[k], now[k]) for k in saved)


def test_invalid_items_are_rejected(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir)
    a = sample(trainer.model, "A", [10])
    with pytest.raises(ValueError, match="at least one rollout"):
        trainer.step([])
    with pytest.raises(ValueError, match="appears twice"):
        trainer.step([TrainItem("A", 1.0, (a,)), TrainItem("A", 1.0, (a,))])
    with pytest.raises(ValueError, match="was given as 'B'"):
        trainer.step([TrainItem("B", 1.0, (a,))])
    with pytest.raises(ValueError, match="non-finite"):
        trainer.step([TrainItem("A", float("nan"), (a,))])


def test_decoupled_mode_reweights_stale_tokens_instead_of_clipping(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir, off_policy="decoupled", is_cap=1.5)
    # Recorded logprobs 0.3 below the policy's: IS weight e^0.3 = 1.35 (< cap); the loss ratio
    # is 1 against the current weights, so nothing is clipped and the loss is -A * 1.35.
    stale = sample(trainer.model, "A", [10, 11, 12], shift=0.3)
    out = trainer.backward([TrainItem("A", 1.0, (stale,))])
    assert out.clipfrac_sum == 0.0
    assert out.loss == pytest.approx(-torch.exp(torch.tensor(0.3)).item(), abs=1e-5)
    assert out.is_weight_sum / out.tokens == pytest.approx(1.3499, abs=1e-3)
    assert out.is_capped_sum == 0.0
    # 0.5 stale: e^0.5 = 1.65 > cap 1.5: every token at the cap.
    capped = trainer.step([TrainItem("A", 1.0, (sample(trainer.model, "A", [10, 11], shift=0.5),))])
    assert capped.is_weight_mean == pytest.approx(1.5)
    assert capped.is_capped_frac == 1.0
    assert capped.loss == pytest.approx(-1.5, abs=1e-5)
    assert capped.grad_norm > 0  # unlike bypass mode, where these tokens would be clipped


@pytest.mark.parametrize("loss", ["gspo", "cispo"])
def test_other_losses_run_and_learn(tiny_model_dir: Path, loss: str) -> None:
    trainer = PolicyTrainer(tiny_model_dir, lr=1e-2, loss=loss, clip_ratio=0.2)  # type: ignore[arg-type]
    good = [10, 11, 12]
    before = sampled_logprob(trainer.model, good)
    for _ in range(3):
        out = trainer.step([TrainItem("A", 1.0, (sample(trainer.model, "A", good),))])
        assert out.updated and out.grad_norm > 0
    assert sampled_logprob(trainer.model, good) > before + 0.5


def test_offload_onload_round_trip_keeps_weights_and_optimizer_state(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir, lr=1e-2)
    trainer.step([TrainItem("A", 1.0, (sample(trainer.model, "A", [10, 11]),))])
    weights = trainer.state_dict_for_engine()
    optim = {k: v.clone() for state in trainer.optimizer.state.values() for k, v in state.items()}
    trainer.offload()
    assert all(p.device.type == "cpu" for p in trainer.model.parameters())
    trainer.onload()
    after = trainer.state_dict_for_engine()
    assert all(torch.equal(weights[k], after[k]) for k in weights)
    optim_after = {k: v for state in trainer.optimizer.state.values() for k, v in state.items()}
    assert all(torch.equal(optim[k], optim_after[k]) for k in optim)
    # A step after an offload brings everything back by itself.
    trainer.offload()
    assert trainer.step([TrainItem("A", 1.0, (sample(trainer.model, "A", [10, 11]),))]).updated


def test_long_samples_are_truncated_and_counted(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir, max_sample_tokens=5)
    long = sample(trainer.model, "A", [10, 11, 12, 13])  # 3 prompt + 4 sampled = 7 tokens
    out = trainer.step([TrainItem("A", 1.0, (long,))])
    assert (out.tokens, out.truncated_samples) == (2, 1)
    dropping = PolicyTrainer(tiny_model_dir, max_sample_tokens=5, overflow="drop")
    out = dropping.step([TrainItem("A", 1.0, (long,))])
    assert (out.tokens, out.truncated_samples, out.updated) == (0, 1, False)


def test_reward_metrics_when_rewards_are_given(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir)
    items = [
        TrainItem("A", 1.0, (sample(trainer.model, "A", [10]),), reward=1.0),
        TrainItem("B", -1.0, (sample(trainer.model, "B", [20]),), reward=0.0),
    ]
    metrics = trainer.step(items).metrics()
    assert (metrics["reward_mean"], metrics["reward_std"]) == (0.5, 0.5)


def test_export_hf_writes_a_loadable_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir, lr=1e-2)
    trainer.step([TrainItem("A", 1.0, (sample(trainer.model, "A", [10, 11]),))])
    out = trainer.export_hf(tmp_path / "final")
    exported = AutoModelForCausalLM.from_pretrained(out)
    state = trainer.state_dict_for_engine()
    assert all(torch.equal(exported.state_dict()[k], state[k]) for k in state)
    assert not list(tmp_path.glob(".*tmp"))


def test_a_checkpoint_of_the_other_backend_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    trainer = PolicyTrainer(tiny_model_dir)
    store.save(1, 1, trainer.model.state_dict(), {}, trainer_state={"backend": "verl"})
    with pytest.raises(CheckpointError, match="written by the 'verl' backend"):
        trainer.load(store, 1)
