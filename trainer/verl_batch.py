"""Samples in verl's batch layout, and the loss function verl's engine calls per micro-batch.

Owns :func:`build_batch` (samples -> verl's no-padding ``TensorDict``), :func:`response_values`
(the inverse for per-token engine outputs) and :func:`step_loss`, which adds up a rank's
:class:`~trainer.step_plan.LossTotals`.
It does not own the engine or the step (``trainer.verl_backend``), the loss options
(``trainer.losses``) nor the weights (``trainer.normalization``).

The layout. verl's actor batch is a prompt followed by a response. A sample here is a token
sequence whose sampled tokens may come in several stretches (multi-call agents: tool results and
the next user turn in between, mask 0). The split is made at the first trained token: the
"prompt" is everything before it, the "response" everything from it on, and
``response_mask`` is the sample's loss mask over the response, so tool/observation tokens inside
the response stay masked. Position 0 is never trained (nothing predicts it), so the prompt is
never empty, as verl requires. The batch is built left/right padded, exactly as verl's trainer
builds it, and converted with verl's own ``left_right_2_no_padding``: input ids and position ids
become nested (jagged) tensors; the per-response-token fields stay ``(rows, max_response_len)``.

Extra per-token fields (``sampler_log_probs``, ``norm_weights``, and when precomputed
``old_log_probs`` / ``ref_log_prob``) ride along: verl slices every field of the batch into its
micro-batches, and :func:`step_loss` turns them into what verl's ``ppo_loss`` reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from trainer.losses import importance_weights, kl_penalty
from trainer.options import OffPolicy
from trainer.samples import Sample
from trainer.step_plan import LossTotals, Row


def split_point(sample: Sample) -> int:
    """Index of the first trained token (>= 1): where the "response" starts."""
    for t in range(1, len(sample.tokens)):
        if sample.loss_mask[t]:
            return t
    raise ValueError(f"a sample of rollout {sample.rollout!r} has no trainable token")


def build_batch(
    rows: Sequence[Row],
    *,
    temperature: float,
    max_token_len: int,
    inert: int = 0,
    remove_padding: bool = False,
) -> TensorDict:
    """The rows as verl's no-padding batch, ready for ``train_batch`` / ``infer_batch``.

    ``max_token_len`` is the micro-batch budget in tokens (raised to the longest row if needed:
    verl requires every sequence to fit one micro-batch). The last ``inert`` rows are padding
    (``trainer.step_plan``): they run through the model with a zero loss mask.
    ``remove_padding``: the engine packs each micro-batch's sequences into one row without
    padding (the model separates them by their position ids); else it pads them.
    """
    if not rows:
        raise ValueError("a batch needs at least one row")
    if not 0 <= inert <= len(rows):
        raise ValueError(f"{inert} inert rows in a batch of {len(rows)}")
    splits = [split_point(sample) for sample, _, _ in rows]
    b = len(rows)
    p = max(splits)
    r = max(len(sample.tokens) - k for (sample, _, _), k in zip(rows, splits, strict=True))
    prompts = torch.zeros(b, p, dtype=torch.long)
    responses = torch.zeros(b, r, dtype=torch.long)
    attention = torch.zeros(b, p + r, dtype=torch.long)
    response_mask = torch.zeros(b, r, dtype=torch.float32)
    sampler = torch.zeros(b, r, dtype=torch.float32)
    advantages = torch.zeros(b, r, dtype=torch.float32)
    weights = torch.zeros(b, r, dtype=torch.float32)
    for i, ((sample, advantage, weight), k) in enumerate(zip(rows, splits, strict=True)):
        tokens = torch.tensor(sample.tokens, dtype=torch.long)
        n = len(tokens) - k
        prompts[i, p - k :] = tokens[:k]  # left padded
        attention[i, p - k : p + n] = 1
        responses[i, :n] = tokens[k:]  # right padded
        mask = torch.tensor(sample.loss_mask[k:], dtype=torch.float32)
        if i >= b - inert:
            mask.zero_()
        response_mask[i, :n] = mask
        sampler[i, :n] = torch.tensor(sample.logprobs[k:], dtype=torch.float32) * mask
        advantages[i, :n] = advantage * mask
        weights[i, :n] = weight * mask
    # Position ids count real tokens only (0 at each row's first token), as verl computes them.
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    td = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention,
            "position_ids": position_ids,
            "response_mask": response_mask,
            "sampler_log_probs": sampler,
            "advantages": advantages,
            "norm_weights": weights,
        },
        batch_size=[b],
    )
    td = left_right_2_no_padding(td)
    longest = int(attention.sum(-1).max())
    tu.assign_non_tensor(
        td,
        temperature=float(temperature),
        use_remove_padding=remove_padding,
        use_fused_kernels=False,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=max(max_token_len, longest),
        calculate_entropy=True,
        compute_loss=True,
        global_batch_size=None,
    )
    return td


def response_values(output: torch.Tensor, batch: TensorDict) -> torch.Tensor:
    """A per-token engine output over whole sequences (nested, e.g. ``log_probs``) as
    ``(rows, max_response_len)`` aligned with ``response_mask``, on the CPU."""
    return no_padding_2_padding(output, batch).detach().float().cpu()


def step_loss(
    actor_cfg: Any,
    stats: LossTotals,
    *,
    off_policy: OffPolicy,
    is_cap: float,
    kl_coef: float,
    kl_type: str,
    dp_size: int = 1,
    model_output: dict[str, Any],
    data: TensorDict,
    dp_group: Any = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``ppo_loss`` with this appliance's weights, plus a weighted KL term; bound with
    ``functools.partial`` and handed to ``train_batch`` / ``infer_batch`` as ``loss_function``.

    Per micro-batch: picks ``pi_old`` (the sampler's log-probs in bypass mode; in decoupled mode
    the precomputed proximal ones, or, with one update per step, the current ones detached),
    sets ``rollout_is_weights = norm_weight * truncated IS weight`` (token-sum aggregation, see
    ``trainer.normalization``), calls ``ppo_loss``, and adds ``kl_coef * sum_t w_t KL_t`` against
    ``ref_log_prob``, scaled by ``dp_size`` as verl scales its token sums (FSDP averages the
    ranks' gradients). Accumulates the step's metrics into ``stats``.
    """
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    fields = ["response_mask", "sampler_log_probs", "norm_weights"]
    fields += [key for key in ("old_log_probs", "ref_log_prob") if key in data]
    padded = data.select(*fields).to_padded_tensor()
    mask = padded["response_mask"].bool()
    sampler = padded["sampler_log_probs"].to(log_prob.dtype)
    if off_policy == "decoupled":
        old = padded["old_log_probs"] if "old_log_probs" in fields else log_prob.detach()
        is_weight, capped = importance_weights(old, sampler, is_cap)
    else:
        old, is_weight, capped = sampler, torch.ones_like(sampler), torch.zeros_like(mask)
    data["old_log_probs"] = old.detach()
    data["rollout_is_weights"] = padded["norm_weights"] * is_weight * mask
    # The entropy is a metric here (coefficient 0): detached, so the backward pass does not run
    # through a softmax over the whole vocabulary at every position for a zero gradient.
    if "entropy" in model_output:
        model_output = {**model_output, "entropy": model_output["entropy"].detach()}
    loss, metrics = ppo_loss(actor_cfg, model_output, data, dp_group)

    n = int(mask.sum())
    with torch.no_grad():
        if "entropy" in model_output:
            stats.entropy_sum += float(no_padding_2_padding(model_output["entropy"], data)[mask].sum())
        stats.clipfrac_sum += float(metrics["actor/pg_clipfrac"].aggregate()) * n
        stats.ppo_kl_sum += float(metrics["actor/ppo_kl"].aggregate()) * n
        stats.is_weight_sum += float(is_weight[mask].sum())
        stats.is_capped_sum += float(capped[mask].sum())
    if kl_coef > 0.0:
        # k3 ("low_var_kl") by default: unbiased for KL(policy || ref) and always >= 0.
        kld = kl_penalty(log_prob, padded["ref_log_prob"].to(log_prob.dtype), kl_type)
        loss = loss + kl_coef * dp_size * (kld * padded["norm_weights"] * mask).sum()
        stats.kl_ref_sum += float(kld.detach()[mask].sum())
    stats.loss += float(loss.detach())
    stats.tokens += n
    return loss, metrics
