"""Policy-loss options shared by both backends: which verl loss, and how off-policy tokens are
corrected.

Owns what the loss options (named in ``trainer.options``: ``LossMode``, ``OffPolicy``) mean: the
verl ``ActorConfig`` their losses read, typed handles on verl's loss functions, and
:func:`importance_weights`. It does not own the forward pass or the step (``trainer.policy``,
``trainer.verl_backend``) nor the per-token normalization weights (``trainer.normalization``).

Losses (verl ``core_algos``; ``r_t = pi_theta / pi_old`` per token, ``A`` the advantage):

- ``"ppo"``: verl's ``vanilla`` PPO clip, ``max(-A r, -A clip(r, 1-eps, 1+eps))`` (dual-clip at 3
  for A < 0).
- ``"gspo"``: sequence-level ratio ``s = exp(mean_t log r_t)`` over each sample's trained tokens,
  clipped like PPO (eps is usually much smaller, e.g. 3e-4 / 4e-4).
- ``"cispo"``: ``-sg(clip(r)) * A * log pi_theta``: the clipped ratio only weights the gradient,
  so clipped tokens still contribute.

Off-policy correction. Every sampled token carries the log-prob the engine sampled it with
(``pi_sampler``), which may be an older policy version (asynchronous training) and is never
numerically identical to the trainer's (bf16 engine vs fp32 trainer):

- ``"bypass"``: ``pi_old = pi_sampler``. The loss's own ratio and clip act against the sampler;
  nothing else is reweighted (verl's bypass mode with ``ppo_clip``). Tokens far off-policy get
  clipped, i.e. lose their gradient.
- ``"decoupled"``: ``pi_old`` is the policy being trained, just before the update (the proximal
  policy of decoupled PPO); each token's loss is multiplied by the truncated importance weight
  ``w = min(pi_old / pi_sampler, cap)`` (detached; truncated IS). Off-policy tokens keep their
  gradient, reweighted and capped. With one optimizer update per batch ``pi_old == pi_theta`` at
  that update, so the loss ratio is exactly 1 and PPO / GSPO / CISPO give the same gradient;
  the ratio only matters from the second mini-batch of a step on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
from verl.trainer.ppo import core_algos
from verl.utils import torch_functional as verl_F
from verl.workers.config import ActorConfig
from verl.workers.config.actor import PolicyLossConfig

from trainer.options import LOSS_MODES, LossMode, check_option

#: Our loss names -> verl's registered policy-loss names.
VERL_LOSS_NAMES: dict[str, str] = {"ppo": "vanilla", "gspo": "gspo", "cispo": "cispo"}


class PolicyLossFn(Protocol):
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
get_policy_loss_fn: Callable[[str], PolicyLossFn] = core_algos.get_policy_loss_fn
kl_penalty = cast(Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor], core_algos.kl_penalty)
logprobs_from_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = verl_F.logprobs_from_logits
entropy_from_logits: Callable[[torch.Tensor], torch.Tensor] = verl_F.entropy_from_logits


def actor_config(
    loss: LossMode = "ppo",
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    max_token_len: int = 16384,
) -> Any:
    """The verl ``ActorConfig`` that verl's policy losses (and ``ppo_loss``) read.

    Aggregation is ``token-sum``: the per-token weights (normalization x importance) carry all
    the scaling. verl's own KL and entropy terms stay off (``use_kl_loss=False``, entropy
    coefficient 0): they would be summed unweighted; the backends add the KL term themselves
    with the normalization weights. ``strategy``, ``rollout_n`` and the batch sizes are required
    by its validation but not read by the loss; an empty ``global_batch_info`` means one rank.
    """
    check_option(loss, LOSS_MODES, "loss")
    return ActorConfig(
        strategy="fsdp2",
        rollout_n=1,
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=1,
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=max_token_len,
        clip_ratio=clip_ratio_high,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        policy_loss=PolicyLossConfig(loss_mode=VERL_LOSS_NAMES[loss]),
        loss_agg_mode="token-sum",
        entropy_coeff=0.0,
        use_kl_loss=False,
        use_torch_compile=False,
    )


def importance_weights(
    old_log_prob: torch.Tensor, sampler_log_prob: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated IS weights ``min(exp(old - sampler), cap)`` (no gradient) and a bool tensor of
    where the cap bit. The log-ratio is clamped at 20 first so ``exp`` cannot overflow."""
    with torch.no_grad():
        log_ratio = (old_log_prob.detach() - sampler_log_prob).clamp(max=20.0)
        raw = torch.exp(log_ratio)
        return raw.clamp(max=cap), raw > cap
