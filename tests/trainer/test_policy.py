"""PolicyTrainer on a real (tiny, random) Qwen2: learning direction, normalization, weights."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from trainer.checkpoints import CheckpointStore
from trainer.policy import PolicyTrainer, TrainItem
from trainer.samples import NOT_SAMPLED, Sample

PROMPT = [5, 6, 7]


def teacher_forced(model: Any, tokens: Sequence[int], temperature: float = 1.0) -> list[float]:
    """log p(tokens[t] | tokens[:t]) for t >= 1 (0.0 at t = 0), one unpadded forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(tokens)])).logits[0] / temperature
    logp = torch.log_softmax(logits[:-1], dim=-1)
    picked = logp.gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return [0.0, *picked.tolist()]


def sample(
    model: Any, rollout: str, response: Sequence[int], *, shift: float = 0.0, temperature: float = 1.0
) -> Sample:
    """An on-policy sample: its recorded logprobs are the model's own (minus ``shift``)."""
    tokens = [*PROMPT, *response]
    mask = [0] * len(PROMPT) + [1] * len(response)
    lps = teacher_forced(model, tokens, temperature)
    return Sample(
        rollout=rollout,
        call_ids=(f"{rollout}-call",),
        tokens=tuple(tokens),
        loss_mask=tuple(mask),
        logprobs=tuple(lp - shift if m else 0.0 for lp, m in zip(lps, mask, strict=True)),
        versions=tuple(0 if m else NOT_SAMPLED for m in mask),
    )


def sampled_logprob(model: Any, response: Sequence[int]) -> float:
    return sum(teacher_forced(model, [*PROMPT, *response])[len(PROMPT) :])


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
    assert set(out.metrics()) == {"loss", "grad_norm", "pg_clipfrac", "ppo_kl", "entropy", "updated"}


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
