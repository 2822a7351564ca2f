"""The plain-torch backend: one HF causal LM, its optimizer, and the policy-gradient step.

Owns :class:`PolicyTrainer`: loading the model (float32), the AdamW optimizer, the forward pass
over :class:`~trainer.samples.Sample` token sequences, the optimizer step, the weights handed to
the engine (whole, or streamed in buckets through ``trainer.buckets``), offload/onload
and the trainer's part of a checkpoint. It does not own which rollouts are trained on or when
(the scheduler), the advantages (``trainer.advantage``), how samples are built
(``trainer.samples``), its options (``trainer.options``) and the losses they name
(``trainer.losses``), the token weights (``trainer.normalization``), the step's plan
(``trainer.step_plan``) nor the checkpoint files (``trainer.checkpoints``). The verl FSDP
backend (``trainer.verl_backend``) implements the same :class:`~trainer.items.Trainer` API.

The loss is one of verl's policy losses (``core_algos``; PPO clip by default), with
``old_log_prob`` = the engine's sampling log-probabilities recorded by the proxy (``"bypass"``),
so the ratio ``pi_theta / pi_sampler`` covers both staleness and engine/trainer numerical
mismatch; or, with ``off_policy="decoupled"``, ratio 1 against the current weights and truncated
importance weights ``min(pi_theta / pi_sampler, cap)`` (see ``trainer.losses``). Within one
forward the current log-probs *are* the proximal policy's, so decoupled mode needs no extra pass.

Each token's loss is multiplied by its normalization weight ``w_t`` (``trainer.normalization``;
per rollout by default: ``loss = (1/R) * sum_r (1/N_r) * sum_{t in r} l_t``), passed to verl as
``rollout_is_weights`` with ``token-sum`` aggregation. The result is additive over micro-batches,
so samples can be packed into micro-batches freely and the gradients accumulated.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM

from trainer.buckets import WeightBucket, pack_buckets
from trainer.checkpoints import CheckpointError, CheckpointStore, export_hf_model
from trainer.device_memory import release_cached
from trainer.items import StepOutput, TrainItem, check_items
from trainer.losses import (
    actor_config,
    entropy_from_logits,
    get_policy_loss_fn,
    importance_weights,
    logprobs_from_logits,
)
from trainer.normalization import Normalization, check_normalization
from trainer.options import OffPolicy, TrainerOptions, keyword_options
from trainer.sharded import ShardedStore
from trainer.step_plan import LossTotals, RankResult, Row, finish, plan_step, weighted_rows

__all__ = ["LossTotals", "PolicyTrainer", "StepOutput", "TrainItem"]


class PolicyTrainer:
    """The trainable model and its optimizer; :meth:`step` takes one policy-gradient step."""

    @keyword_options(TrainerOptions)
    def __init__(self, model_dir: str | Path, options: TrainerOptions) -> None:
        """``PolicyTrainer(model_dir, **options)``: the keywords of :class:`TrainerOptions`."""
        self.options = options
        self.model_dir = Path(model_dir)
        self.device = torch.device(options.device)
        # Any: transformers' annotations of nn.Module methods (``to``, ``eval``) do not type-check.
        self.model = cast(Any, AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32))
        self.model.to(self.device)
        # No dropout: on-policy data must give a PPO ratio of exactly 1.
        self.model.eval()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=options.lr, weight_decay=options.weight_decay
        )
        #: Tokens per micro-batch: ``options``' until changed (it may be, between steps).
        self.max_tokens_per_microbatch = options.max_tokens_per_microbatch
        self.global_step = 0
        self._offloaded = False
        low, high = options.clip_ratios
        self._config = actor_config(options.loss, clip_ratio_low=low, clip_ratio_high=high)
        self._policy_loss = get_policy_loss_fn(self._config.policy_loss.loss_mode)

    @property
    def off_policy(self) -> OffPolicy:
        """The off-policy correction the loss applies (``options.off_policy``)."""
        return self.options.off_policy

    # --- the step ------------------------------------------------------------------------------

    def step(self, items: Sequence[TrainItem]) -> StepOutput:
        """Compute the loss over ``items``, backpropagate, clip and take one optimizer step."""
        start = time.perf_counter()
        self.onload()
        # The verl backend's plan (``trainer.step_plan``) with one mini-batch: checked and
        # truncated items, their weighted rows, whether any has a gradient, the item counts.
        plan = plan_step(items, self.options)
        totals = self._backward_rows(plan.minibatches[0])
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.options.grad_clip if self.options.grad_clip is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        # An all-zero-advantage batch has a zero gradient; stepping Adam on it would still move
        # the weights along stale momentum, so it is not stepped. Neither is a non-finite one.
        updated = plan.trains[0] and math.isfinite(grad_norm)
        if updated:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        result = RankResult(stats=totals, grad_norms=(grad_norm,), updated=updated, step=self.global_step)
        return finish(plan, [result], time.perf_counter() - start)

    def backward(
        self, items: Sequence[TrainItem], *, normalization: Normalization | None = None
    ) -> LossTotals:
        """Zero the gradients, then accumulate the normalized loss's gradient into them.

        Leaves the gradients in ``.grad`` and does not step (``step`` does); useful on its own to
        inspect gradients. ``normalization`` overrides the trainer's mode for this call.
        """
        check_items(items)
        return self._backward_rows(
            weighted_rows(items, check_normalization(normalization or self.options.normalization))
        )

    def _backward_rows(self, rows: Sequence[Row]) -> LossTotals:
        self.optimizer.zero_grad(set_to_none=True)
        totals = LossTotals()
        for batch in self._microbatches(rows):
            self._accumulate(batch, totals)
        return totals

    def _microbatches(self, rows: Sequence[Row]) -> list[list[Row]]:
        """Pack rows into right-padded micro-batches of at most ``max_tokens_per_microbatch``
        padded tokens (a longer sample gets a batch of its own). Longest first, so each batch's
        rows have similar lengths and little padding."""
        ordered = sorted(rows, key=lambda row: len(row[0].tokens), reverse=True)
        batches: list[list[Row]] = []
        for row in ordered:
            # Within a batch the first row is the longest, so the padded size is rows * its length.
            if batches and (len(batches[-1]) + 1) * len(batches[-1][0][0].tokens) <= (
                self.max_tokens_per_microbatch
            ):
                batches[-1].append(row)
            else:
                batches.append([row])
        return batches

    def _accumulate(self, batch: list[Row], totals: LossTotals) -> None:
        """Forward one micro-batch, backpropagate its share of the loss, add up its metrics."""
        b, length = len(batch), max(len(s.tokens) for s, _, _ in batch)
        # Right padding: pad positions come after every real token, so causal attention keeps
        # real positions from seeing them and the default position ids (0, 1, ...) are right.
        input_ids = torch.zeros(b, length, dtype=torch.long)
        attention = torch.zeros(b, length, dtype=torch.long)
        loss_mask = torch.zeros(b, length, dtype=torch.bool)
        sampler = torch.zeros(b, length, dtype=torch.float32)
        for i, (sample, _, _) in enumerate(batch):
            n = len(sample.tokens)
            input_ids[i, :n] = torch.tensor(sample.tokens, dtype=torch.long)
            attention[i, :n] = 1
            loss_mask[i, :n] = torch.tensor(sample.loss_mask, dtype=torch.bool)
            sampler[i, :n] = torch.tensor(sample.logprobs, dtype=torch.float32)
        dev = self.device
        advantage = torch.tensor([a for _, a, _ in batch], dtype=torch.float32, device=dev)
        weight = torch.tensor([w for _, _, w in batch], dtype=torch.float32, device=dev)
        input_ids, attention = input_ids.to(dev), attention.to(dev)

        logits = self.model(input_ids=input_ids, attention_mask=attention).logits
        # The shift: the logits at position t are the distribution of token t+1. So position t
        # of the predictions is trained iff token t+1 was sampled (loss_mask[t+1] == 1).
        mask = loss_mask[:, 1:].to(dev)
        # Only the trained positions go through the vocabulary-wide log-softmax: (n_tokens, vocab).
        picked = logits[:, :-1, :][mask].float() / self.options.temperature
        labels = input_ids[:, 1:][mask]
        # (1, n, vocab): verl's CPU path loops over the first dim, so one row means one logsumexp.
        flat = logprobs_from_logits(picked.unsqueeze(0), labels.unsqueeze(0)).squeeze(0)
        # Back to (rows, positions) so sequence-level losses (GSPO) see each sample as a row;
        # masked_scatter fills the True positions in the same row-major order as ``[mask]``.
        log_prob = torch.zeros(b, length - 1, device=dev).masked_scatter(mask, flat)
        sampler_lp = sampler[:, 1:].to(dev)
        if self.options.off_policy == "decoupled":
            old_log_prob = log_prob.detach()
            is_weight, capped = importance_weights(old_log_prob, sampler_lp, self.options.is_cap)
        else:
            old_log_prob, is_weight, capped = sampler_lp, torch.ones_like(sampler_lp), torch.zeros_like(mask)
        per_token_w = weight[:, None] * is_weight * mask

        loss, metrics = self._policy_loss(
            old_log_prob=old_log_prob,
            log_prob=log_prob,
            advantages=advantage[:, None].expand(b, length - 1),
            response_mask=mask,
            loss_agg_mode="token-sum",
            config=self._config,
            rollout_is_weights=per_token_w,
        )
        torch.autograd.backward(loss)  # (typed, unlike Tensor.backward)

        n_tokens = int(labels.numel())
        with torch.no_grad():
            entropy = float(entropy_from_logits(picked.detach()).sum())
        totals.loss += float(loss.detach())
        totals.tokens += n_tokens
        totals.clipfrac_sum += float(metrics["actor/pg_clipfrac"]) * n_tokens
        totals.ppo_kl_sum += float(metrics["actor/ppo_kl"]) * n_tokens
        totals.entropy_sum += entropy
        totals.is_weight_sum += float(is_weight[mask].sum())
        totals.is_capped_sum += float(capped[mask].sum())

    # --- collocation -----------------------------------------------------------------------------

    def offload(self) -> None:
        """Move the parameters and the optimizer state to host memory, then the GPU's cached
        blocks back to the driver (``release_cached``; a no-op on CPU)."""
        self._move(torch.device("cpu"))
        release_cached(self.device)  # last: after the optimizer state has moved
        self._offloaded = True

    def onload(self) -> None:
        """Bring parameters and optimizer state back to the training device (``step`` calls it)."""
        if self._offloaded:
            self._move(self.device)
            self._offloaded = False

    def _move(self, device: torch.device) -> None:
        self.model.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                # Adam's ``step`` counter stays on the CPU (torch keeps it there unless fused).
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device)

    # --- weights and checkpoints ---------------------------------------------------------------

    def state_dict_for_engine(self) -> dict[str, torch.Tensor]:
        """Detached CPU copies of ``model.state_dict()``, same keys (tied weights keep both keys
        and share one copy), ready for the engine's ``load_state_dict(strict=True)``."""
        copies: dict[_StorageKey, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        state: dict[str, torch.Tensor] = self.model.state_dict()
        for name, tensor in state.items():
            key = _storage_key(tensor)
            if key not in copies:
                copies[key] = tensor.detach().to("cpu", copy=True)
            out[name] = copies[key]
        return out

    def weight_buckets(self, bucket_bytes: int, dtype: torch.dtype | None = None) -> Iterator[WeightBucket]:
        """The weights for ``Engine.load_weight_buckets``: ``pack_buckets`` over the tensors of
        ``model.state_dict()`` (HF names, in its order), each storage once (so a tied
        ``lm_head.weight`` is left out: the engine ties it), cast to ``dtype`` if given.

        Nothing is cloned: each tensor is copied straight from the model (on whatever device)
        into the bucket file, so the host holds one bucket at a time. The model must not change
        until the generator is exhausted or closed."""
        state: dict[str, torch.Tensor] = self.model.state_dict()
        seen: set[_StorageKey] = set()
        unique: list[tuple[str, torch.Tensor]] = []
        for name, tensor in state.items():
            key = _storage_key(tensor)
            if key not in seen:
                seen.add(key)
                unique.append((name, tensor))
        return pack_buckets(unique, bucket_bytes=bucket_bytes, dtype=dtype)

    def save(self, store: CheckpointStore | ShardedStore, version: int) -> Path:
        """Write model, optimizer and step as ``version`` into ``store``; returns the path."""
        store = _file_store(store)
        return store.save(
            version,
            self.global_step,
            self.model.state_dict(),
            self.optimizer.state_dict(),
            trainer_state={"backend": "torch"},
        )

    def load(self, store: CheckpointStore | ShardedStore, version: int | None = None) -> int:
        """Restore model, optimizer and step from ``version`` (default: the latest); returns it."""
        store = _file_store(store)
        if version is None:
            version = store.latest()
            if version is None:
                raise CheckpointError(f"no checkpoint in {store.directory}")
        payload = store.load(version)
        backend = payload.get("trainer", {}).get("backend", "torch")
        if backend != "torch":
            raise CheckpointError(
                f"checkpoint {store.path(version)} was written by the {backend!r} backend; "
                "resume it with that backend (the optimizer state layouts differ)"
            )
        self.model.load_state_dict(payload["model"], strict=True)
        self.optimizer.load_state_dict(payload["optimizer"])
        self.global_step = int(payload["step"])
        return version

    def export_hf(self, directory: Path) -> Path:
        """Write the current weights (and ``model_dir``'s tokenizer files) as an HF model dir."""
        return export_hf_model(self.model.save_pretrained, self.model_dir, directory)


#: What makes two tensors the same one (tied weights): storage, offset, shape, stride.
_StorageKey = tuple[int, int, tuple[int, ...], tuple[int, ...]]


def _storage_key(tensor: torch.Tensor) -> _StorageKey:
    return (
        tensor.untyped_storage().data_ptr(),
        int(tensor.storage_offset()),
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )


def _file_store(store: CheckpointStore | ShardedStore) -> CheckpointStore:
    if not isinstance(store, CheckpointStore):
        raise CheckpointError(
            f"the torch backend keeps single-file checkpoints; {store.directory} holds sharded ones "
            "(written by the verl backend)"
        )
    return store
