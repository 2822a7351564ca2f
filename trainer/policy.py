"""The trainable policy: one HF causal LM, its optimizer, and the policy-gradient step.

Owns :class:`PolicyTrainer`: loading the model (float32), the AdamW optimizer, the loss over
:class:`~trainer.samples.Sample` token sequences, the optimizer step, the weights handed to the
engine and the trainer's part of a checkpoint. It does not own which rollouts are trained on or
when (the scheduler), the advantages (``trainer.advantage``), how samples are built
(``trainer.samples``), nor the checkpoint files (``trainer.checkpoints``).

The loss is verl's ``vanilla`` PPO-clip policy loss (``core_algos.get_policy_loss_fn``), with
``old_log_prob`` = the engine's sampling log-probabilities recorded by the proxy, so the ratio
``pi_theta / pi_sampler`` covers both staleness and engine/trainer numerical mismatch.

Normalization is per rollout: every rollout in a step weighs the same, however many samples and
tokens it has. With ``R`` rollouts that have trainable tokens, rollout ``r`` having ``N_r`` of them
over all its samples and ``l_t`` the PPO-clip loss of token ``t``::

    loss = (1/R) * sum_r (1/N_r) * sum_{t in r} l_t

We hand verl the per-token weight ``w_t = 1/(R * N_r)`` as ``rollout_is_weights`` (verl multiplies
each token's loss by it) and aggregate with ``token-sum``; the result is exactly the formula above
and it is additive over micro-batches, so samples can be packed into micro-batches freely and the
gradients accumulated.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from transformers import AutoModelForCausalLM
from verl.trainer.ppo import core_algos
from verl.utils import torch_functional as verl_F
from verl.workers.config.actor import ActorConfig

from trainer.checkpoints import CheckpointError, CheckpointStore
from trainer.samples import Sample


class _PolicyLossFn(Protocol):
    """verl's policy-loss signature (``core_algos.PolicyLossFn``)."""

    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = ...,
        config: Any = ...,
        rollout_is_weights: torch.Tensor | None = ...,
    ) -> tuple[torch.Tensor, dict[str, Any]]: ...


# verl ships py.typed but leaves these unannotated: give them their types once, here.
_get_policy_loss_fn: Callable[[str], _PolicyLossFn] = core_algos.get_policy_loss_fn
_logprobs_from_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = verl_F.logprobs_from_logits
_entropy_from_logits: Callable[[torch.Tensor], torch.Tensor] = verl_F.entropy_from_logits


@dataclass(frozen=True, slots=True)
class TrainItem:
    """One rollout to train on: its advantage applies to every token it sampled."""

    rollout: str
    advantage: float
    samples: tuple[Sample, ...]


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one :meth:`PolicyTrainer.step` did. Metrics are token-means over sampled tokens."""

    #: The trainer's step count after this step.
    step: int
    #: False when the optimizer was not stepped: every advantage was 0, or the gradient was not
    #: finite. The weights are then unchanged.
    updated: bool
    #: The rollout-normalized PPO-clip loss (see the module docstring).
    loss: float
    #: Total gradient norm before clipping.
    grad_norm: float
    #: Fraction of tokens whose ratio was clipped.
    pg_clipfrac: float
    #: Mean of ``log pi_sampler - log pi_theta`` (an estimate of KL(sampler || policy)).
    ppo_kl: float
    #: Mean entropy of the policy's next-token distribution at the sampled positions.
    entropy: float
    tokens: int
    samples: int
    rollouts: int
    duration_s: float

    def metrics(self) -> dict[str, float]:
        """The float metrics, as ``TrainStepCompleted.metrics`` records them."""
        return {
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "pg_clipfrac": self.pg_clipfrac,
            "ppo_kl": self.ppo_kl,
            "entropy": self.entropy,
            "updated": float(self.updated),
        }


@dataclass(slots=True)
class LossTotals:
    """Sums over the micro-batches of one :meth:`PolicyTrainer.backward` (token sums, not means)."""

    loss: float = 0.0
    tokens: int = 0
    clipfrac_sum: float = 0.0
    kl_sum: float = 0.0
    entropy_sum: float = 0.0


def _trainable_tokens(sample: Sample) -> int:
    # Position 0 has no prefix, so nothing predicts it: only positions 1.. can be trained.
    return sum(sample.loss_mask[1:])


def _actor_config(clip_ratio: float) -> Any:
    """The verl ``ActorConfig`` its policy loss reads (``clip_ratio*``, ``global_batch_info``).

    ``strategy``, ``rollout_n`` and the micro-batch size are required by its validation but not
    read by the loss; an empty ``global_batch_info`` means one data-parallel rank.
    """
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=clip_ratio,
        clip_ratio_low=clip_ratio,
        clip_ratio_high=clip_ratio,
        loss_agg_mode="token-sum",
        use_torch_compile=False,
    )


class PolicyTrainer:
    """The trainable model and its optimizer; :meth:`step` takes one policy-gradient step."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | torch.device = "cpu",
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        grad_clip: float | None = 1.0,
        clip_ratio: float = 0.2,
        temperature: float = 1.0,
        max_tokens_per_microbatch: int = 4096,
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if max_tokens_per_microbatch < 1:
            raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {max_tokens_per_microbatch}")
        self.device = torch.device(device)
        # Any: transformers' annotations of nn.Module methods (``to``, ``eval``) do not type-check.
        self.model = cast(Any, AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32))
        self.model.to(self.device)
        # No dropout: on-policy data must give a PPO ratio of exactly 1.
        self.model.eval()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        self.grad_clip = grad_clip
        #: The sampling temperature the engine used; logits are divided by it so that the
        #: trainer's log-probs are of the same distribution as the recorded ones.
        self.temperature = temperature
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.global_step = 0
        self._config = _actor_config(clip_ratio)
        self._policy_loss = _get_policy_loss_fn("vanilla")

    # --- the step ------------------------------------------------------------------------------

    def step(self, items: Sequence[TrainItem]) -> StepOutput:
        """Compute the loss over ``items``, backpropagate, clip and take one optimizer step."""
        start = time.perf_counter()
        totals = self.backward(items)
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        # An all-zero-advantage batch has a zero gradient; stepping Adam on it would still move
        # the weights along stale momentum, so it is not stepped. Neither is a non-finite one.
        has_signal = any(
            it.advantage != 0.0 and any(_trainable_tokens(s) > 0 for s in it.samples) for it in items
        )
        updated = has_signal and math.isfinite(grad_norm)
        if updated:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        n = max(totals.tokens, 1)
        return StepOutput(
            step=self.global_step,
            updated=updated,
            loss=totals.loss,
            grad_norm=grad_norm,
            pg_clipfrac=totals.clipfrac_sum / n,
            ppo_kl=totals.kl_sum / n,
            entropy=totals.entropy_sum / n,
            tokens=totals.tokens,
            samples=sum(len(it.samples) for it in items),
            rollouts=len(items),
            duration_s=time.perf_counter() - start,
        )

    def backward(self, items: Sequence[TrainItem]) -> LossTotals:
        """Zero the gradients, then accumulate the rollout-normalized loss's gradient into them.

        Leaves the gradients in ``.grad`` and does not step (``step`` does); useful on its own to
        inspect gradients.
        """
        _check_items(items)
        self.optimizer.zero_grad(set_to_none=True)
        counts = [sum(_trainable_tokens(s) for s in it.samples) for it in items]
        active = sum(1 for c in counts if c > 0)
        totals = LossTotals()
        if active == 0:
            return totals
        # (advantage, weight) of each sample that has something to train; weight = 1/(R * N_r).
        rows = [
            (sample, it.advantage, 1.0 / (active * count))
            for it, count in zip(items, counts, strict=True)
            for sample in it.samples
            if _trainable_tokens(sample) > 0
        ]
        for batch in self._microbatches(rows):
            self._accumulate(batch, totals)
        return totals

    def _microbatches(
        self, rows: list[tuple[Sample, float, float]]
    ) -> list[list[tuple[Sample, float, float]]]:
        """Pack rows into right-padded micro-batches of at most ``max_tokens_per_microbatch``
        padded tokens (a longer sample gets a batch of its own). Longest first, so each batch's
        rows have similar lengths and little padding."""
        ordered = sorted(rows, key=lambda row: len(row[0].tokens), reverse=True)
        batches: list[list[tuple[Sample, float, float]]] = []
        for row in ordered:
            # Within a batch the first row is the longest, so the padded size is rows * its length.
            if batches and (len(batches[-1]) + 1) * len(batches[-1][0][0].tokens) <= (
                self.max_tokens_per_microbatch
            ):
                batches[-1].append(row)
            else:
                batches.append([row])
        return batches

    def _accumulate(self, batch: list[tuple[Sample, float, float]], totals: LossTotals) -> None:
        """Forward one micro-batch, backpropagate its share of the loss, add up its metrics."""
        b, length = len(batch), max(len(s.tokens) for s, _, _ in batch)
        # Right padding: pad positions come after every real token, so causal attention keeps
        # real positions from seeing them and the default position ids (0, 1, ...) are right.
        input_ids = torch.zeros(b, length, dtype=torch.long)
        attention = torch.zeros(b, length, dtype=torch.long)
        loss_mask = torch.zeros(b, length, dtype=torch.bool)
        old = torch.zeros(b, length, dtype=torch.float32)
        for i, (sample, _, _) in enumerate(batch):
            n = len(sample.tokens)
            input_ids[i, :n] = torch.tensor(sample.tokens, dtype=torch.long)
            attention[i, :n] = 1
            loss_mask[i, :n] = torch.tensor(sample.loss_mask, dtype=torch.bool)
            old[i, :n] = torch.tensor(sample.logprobs, dtype=torch.float32)
        advantage = torch.tensor([a for _, a, _ in batch], dtype=torch.float32)
        weight = torch.tensor([w for _, _, w in batch], dtype=torch.float32)
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)

        logits = self.model(input_ids=input_ids, attention_mask=attention).logits
        # The shift: the logits at position t are the distribution of token t+1. So position t
        # of the predictions is trained iff token t+1 was sampled (loss_mask[t+1] == 1).
        target_mask = loss_mask[:, 1:].to(self.device)
        # Keep only the trained positions, flattened row by row: (n_tokens, vocab). The loss
        # is elementwise and masked sums are plain sums, so verl takes these 1-D rows as is.
        picked = logits[:, :-1, :][target_mask].float() / self.temperature
        labels = input_ids[:, 1:][target_mask]
        old_log_prob = old[:, 1:].to(self.device)[target_mask]
        per_token_adv = advantage.to(self.device)[:, None].expand(b, length - 1)[target_mask]
        per_token_w = weight.to(self.device)[:, None].expand(b, length - 1)[target_mask]
        # (1, n, vocab): verl's CPU path loops over the first dim, so one row means one logsumexp.
        log_prob = _logprobs_from_logits(picked.unsqueeze(0), labels.unsqueeze(0)).squeeze(0)

        loss, metrics = self._policy_loss(
            old_log_prob=old_log_prob,
            log_prob=log_prob,
            advantages=per_token_adv,
            response_mask=torch.ones_like(log_prob),
            loss_agg_mode="token-sum",
            config=self._config,
            rollout_is_weights=per_token_w,
        )
        torch.autograd.backward(loss)  # (typed, unlike Tensor.backward)

        n_tokens = int(labels.numel())
        with torch.no_grad():
            entropy = float(_entropy_from_logits(picked.detach()).sum())
        totals.loss += float(loss.detach())
        totals.tokens += n_tokens
        totals.clipfrac_sum += float(metrics["actor/pg_clipfrac"]) * n_tokens
        totals.kl_sum += float(metrics["actor/ppo_kl"]) * n_tokens
        totals.entropy_sum += entropy

    # --- weights and checkpoints ---------------------------------------------------------------

    def state_dict_for_engine(self) -> dict[str, torch.Tensor]:
        """Detached CPU copies of ``model.state_dict()``, same keys (tied weights keep both keys
        and share one copy), ready for the engine's ``load_state_dict(strict=True)``."""
        copies: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        state: dict[str, torch.Tensor] = self.model.state_dict()
        for name, tensor in state.items():
            key = (
                tensor.untyped_storage().data_ptr(),
                int(tensor.storage_offset()),
                tuple(tensor.shape),
                tuple(tensor.stride()),
            )
            if key not in copies:
                copies[key] = tensor.detach().to("cpu", copy=True)
            out[name] = copies[key]
        return out

    def save(self, store: CheckpointStore, version: int) -> Path:
        """Write model, optimizer and step as ``version`` into ``store``; returns the path."""
        return store.save(version, self.global_step, self.model.state_dict(), self.optimizer.state_dict())

    def load(self, store: CheckpointStore, version: int | None = None) -> int:
        """Restore model, optimizer and step from ``version`` (default: the latest); returns it."""
        if version is None:
            version = store.latest()
            if version is None:
                raise CheckpointError(f"no checkpoint in {store.directory}")
        payload = store.load(version)
        self.model.load_state_dict(payload["model"], strict=True)
        self.optimizer.load_state_dict(payload["optimizer"])
        self.global_step = int(payload["step"])
        return version


def _check_items(items: Sequence[TrainItem]) -> None:
    if not items:
        raise ValueError("a training step needs at least one rollout")
    seen: set[str] = set()
    for item in items:
        if item.rollout in seen:
            raise ValueError(f"rollout {item.rollout!r} appears twice in one step")
        seen.add(item.rollout)
        if not math.isfinite(item.advantage):
            raise ValueError(f"rollout {item.rollout!r} has a non-finite advantage {item.advantage}")
        for sample in item.samples:
            if sample.rollout != item.rollout:
                raise ValueError(f"a sample of rollout {sample.rollout!r} was given as {item.rollout!r}")
