"""The training backends' options, declared once, and the keyword constructor built from them.

Owns :class:`TrainerOptions` (what both backends take: optimizer, loss, batching, truncation),
:class:`VerlOptions` (those plus the verl backend's own: reference model, LoRA, mini-batches,
precision, and the rank this process is), the names of the loss choices (``LossMode``,
``OffPolicy``), the checks that need no model, and :func:`keyword_options`, which gives a
backend's ``__init__(self, model_dir, options)`` the keyword signature
``(model_dir, *, lr=..., ...)`` of its options class: typed for mypy, shown by
``inspect.signature``, and built into one options object before the backend sees it.

It is light (no verl, no model): the driver of the trainer's ranks reads them too. It does not
own what a backend does with an option (``trainer.policy``, ``trainer.verl_backend``), what each
loss is (``trainer.losses``), which backend takes which (``trainer.factory``), nor the
appliance's configuration that fills them in.

The defaults differ in one place: ``off_policy`` is "bypass" for the torch backend (its historical
behaviour) and "decoupled" (truncated importance sampling) for verl.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Concatenate, Literal, ParamSpec, TypeVar, get_args

import torch

from trainer.normalization import Normalization, check_normalization
from trainer.samples import Overflow

#: The policy losses and off-policy corrections (what each one is: ``trainer.losses``).
LossMode = Literal["ppo", "gspo", "cispo"]
LOSS_MODES: tuple[str, ...] = get_args(LossMode)
OffPolicy = Literal["bypass", "decoupled"]
OFF_POLICY_MODES: tuple[str, ...] = get_args(OffPolicy)

_P = ParamSpec("_P")
_Options = TypeVar("_Options")
_Self = TypeVar("_Self")


@dataclass(frozen=True, kw_only=True)
class TrainerOptions:
    """The options both backends take (``ValueError`` on a value no backend can use)."""

    #: The training device ("cpu", "cuda", "cuda:1", ...).
    device: str | torch.device = "cpu"
    #: AdamW's learning rate (constant) and weight decay.
    lr: float = 1e-5
    weight_decay: float = 0.0
    #: The total gradient norm is clipped to this; None: not clipped.
    grad_clip: float | None = 1.0
    #: The loss's ratio clip: ``[1 - clip_ratio, 1 + clip_ratio_high]`` (None: ``clip_ratio``).
    clip_ratio: float = 0.2
    clip_ratio_high: float | None = None
    #: The engine's sampling temperature: the logits are divided by it, so that the trainer's
    #: log-probs are of the distribution the recorded ones were sampled from.
    temperature: float = 1.0
    #: Tokens per micro-batch; the gradients of a step's micro-batches add up.
    max_tokens_per_microbatch: int = 4096
    #: The policy loss (``trainer.losses``).
    loss: LossMode = "ppo"
    #: The off-policy correction (``trainer.losses``) and its importance-weight cap.
    off_policy: OffPolicy = "bypass"
    is_cap: float = 2.0
    #: How each token's loss is weighted (``trainer.normalization``).
    normalization: Normalization = "rollout"
    #: Samples longer than this are truncated (None: never), as ``overflow`` says.
    max_sample_tokens: int | None = None
    overflow: Overflow = "cut"

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.max_tokens_per_microbatch < 1:
            raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {self.max_tokens_per_microbatch}")
        check_option(self.off_policy, OFF_POLICY_MODES, "off_policy")
        if self.is_cap < 1.0:
            raise ValueError(f"is_cap must be >= 1, got {self.is_cap}")
        check_normalization(self.normalization)

    @property
    def clip_ratios(self) -> tuple[float, float]:
        """The ratio clip's (low, high) (``trainer.losses.actor_config``)."""
        return self.clip_ratio, self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


@dataclass(frozen=True, kw_only=True)
class VerlOptions(TrainerOptions):
    """The verl backend's options: the common ones, then its own."""

    off_policy: OffPolicy = "decoupled"
    #: The KL penalty against the reference model (0: no reference model) and its estimator.
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    #: LoRA adapters of this rank (0: full fine-tuning) and alpha (None: twice the rank).
    lora_rank: int = 0
    lora_alpha: int | None = None
    #: Optimizer steps per training step, over that many chunks of its rollouts.
    mini_batches: int = 1
    #: The compute dtype ("bf16", "fp16", "fp32"); None: bf16 on cuda, fp32 on cpu.
    param_dtype: str | None = None
    gradient_checkpointing: bool = False
    #: Pack each micro-batch's sequences into one row (False: pad them).
    remove_padding: bool = True
    #: This process's rank in a world of ``world_size`` ranks meeting at ``init_method``
    #: (``trainer.ranks``; None at world size 1).
    rank: int = 0
    world_size: int = 1
    init_method: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mini_batches < 1 or self.kl_coef < 0 or self.lora_rank < 0:
            raise ValueError("need mini_batches >= 1, kl_coef >= 0 and lora_rank >= 0")


def check_option(value: str, valid: tuple[str, ...], what: str) -> None:
    """``ValueError`` naming the valid choices unless ``value`` is one of them."""
    if value not in valid:
        raise ValueError(f"unknown {what} {value!r}; use one of {', '.join(valid)}")


def keyword_options(
    make: Callable[_P, _Options],
) -> Callable[
    [Callable[[_Self, str | Path, _Options], None]], Callable[Concatenate[_Self, str | Path, _P], None]
]:
    """Decorate ``__init__(self, model_dir, options)`` to be called as ``(model_dir, **kw)``,
    ``kw`` being the keywords of ``make`` (an options class): ``options = make(**kw)``."""

    def decorate(
        init: Callable[[_Self, str | Path, _Options], None],
    ) -> Callable[Concatenate[_Self, str | Path, _P], None]:
        @functools.wraps(init)
        def __init__(self: _Self, model_dir: str | Path, /, *args: _P.args, **kw: _P.kwargs) -> None:
            init(self, model_dir, make(*args, **kw))

        own = list(inspect.signature(init).parameters.values())[:2]  # self, model_dir
        keywords = inspect.signature(make).parameters.values()
        __init__.__signature__ = inspect.signature(init).replace(  # type: ignore[attr-defined]
            parameters=[*own, *keywords]
        )
        return __init__

    return decorate
