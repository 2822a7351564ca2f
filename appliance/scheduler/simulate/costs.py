"""What the simulated machine's work costs, and how its GPUs are laid out.

Owns :class:`CostModel` (decode, prefill, training, switch and push figures, one GPU's) and
:class:`Layout` (the GPUs in all, which generate and which train, the engine replicas). Plain
arithmetic on measured figures: the event loop (``loop``) asks it what each piece of work takes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from appliance.scheduler.decide import Mode


@dataclass(frozen=True, slots=True)
class CostModel:
    """What the machine's work costs. Defaults: a 9B model in bf16 on one H200 (vLLM engine,
    collocated trainer); replace them with measured figures (``docs/scheduler.md``)."""

    #: Aggregate decode tokens/s the engine approaches as the batch grows (asymptote).
    peak_tokens_per_s: float = 8000.0
    #: Decoding sequences at which the aggregate reaches half its peak. One sequence alone gets
    #: ``peak / (1 + b_half)`` tokens/s (163 with the defaults).
    b_half: float = 48.0
    #: Aggregate prefill tokens/s (prompt tokens not in the KV / prefix cache).
    prefill_tokens_per_s: float = 30000.0
    #: Seconds of a training step independent of its size (optimizer, checkpoint, publishing).
    train_step_s: float = 30.0
    #: Seconds per trained token (prompt + sampled tokens of every rollout in the batch).
    train_s_per_token: float = 1.5e-4
    #: Seconds from the decision to train until the step starts (engine sleeps, trainer loads).
    switch_to_train_s: float = 10.0
    #: Seconds from the end of a step until the engine serves the new weights.
    switch_to_generate_s: float = 15.0
    #: A switch frees the KV cache: running rollouts recompute their context on their next call.
    kv_dropped_on_switch: bool = True
    #: Split mode: seconds generation pauses for each step's weight push (trainer GPUs to engine
    #: GPUs, and the engine loading them). Collocated, the push is in ``switch_to_generate_s``.
    push_s: float = 5.0
    #: A push resets the engines' prefix cache (vLLM's holds the old weights' keys and values):
    #: running rollouts recompute their context on their next call.
    kv_dropped_on_push: bool = True
    #: An engine replica on ``t`` GPUs (tensor parallel) is ``t ** tp_exponent`` times as fast as
    #: on one, decoding and prefilling (1: linear; all-reduces per layer make it less).
    tp_exponent: float = 0.8
    #: ``g`` GPUs take a training step ``g ** train_exponent`` times as fast as one (data
    #: parallel with sharded optimizer state; 1: linear).
    train_exponent: float = 0.9
    #: Seconds each decoding sequence's every token takes longer per rollout alive (decoding, in
    #: a tool or in its harness): where the harnesses and the proxy share the engine's processor
    #: (an engine on CPU), their work slows decoding. 0 where the engine has its accelerator to
    #: itself. Fitted with the decode curve (``calibrate.fit_decode``).
    rollout_token_s: float = 0.0

    def decode_rate(self, decoding: int, alive: int = 0) -> float:
        """Tokens/s each of ``decoding`` concurrently decoding sequences samples (one GPU), with
        ``alive`` rollouts running (``rollout_token_s``)."""
        # total(b) = peak * b / (b + b_half), shared equally: total(b) / b = peak / (b + b_half).
        if not self.rollout_token_s:
            return self.peak_tokens_per_s / (decoding + self.b_half)
        return 1.0 / ((decoding + self.b_half) / self.peak_tokens_per_s + self.rollout_token_s * alive)

    def replica_speed(self, gpus: int) -> float:
        """How many times as fast as one GPU's an engine replica on ``gpus`` GPUs is."""
        return math.pow(gpus, self.tp_exponent)

    def train_s(self, tokens: float, gpus: int = 1) -> float:
        """Seconds one step over ``tokens`` trained tokens takes on ``gpus`` GPUs (switches
        excluded)."""
        return (self.train_step_s + self.train_s_per_token * tokens) / math.pow(gpus, self.train_exponent)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], base: CostModel | None = None) -> CostModel:
        """``base`` (default: the defaults) with the fields named in ``values`` replaced, e.g. a
        JSON object of measured figures. Unknown names are an error."""
        names = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(f"unknown cost model fields {unknown}; known: {sorted(names)}")
        converted: dict[str, Any] = {
            name: bool(value) if names[name].type == "bool" else float(value)
            for name, value in values.items()
        }
        return replace(base or cls(), **converted)


@dataclass(frozen=True, slots=True)
class Layout:
    """The simulated machine's GPUs and what each does."""

    #: GPUs in all (the cost model's figures are one GPU's).
    gpus: int = 1
    #: Split mode: the GPUs that generate; the others train. None: half of them, as
    #: ``appliance.placement.plan`` plans it.
    split: int | None = None
    #: Engine replicas on the generating GPUs, each on an equal share of them (tensor parallel
    #: within a replica). None: one per generating GPU.
    replicas: int | None = None

    def pools(self, mode: Mode) -> tuple[int, int]:
        """GPUs that generate and GPUs that train; collocated, both are all of them."""
        if mode != "split":
            return self.gpus, self.gpus
        generating = self.gpus // 2 if self.split is None else self.split
        return generating, self.gpus - generating

    def replica_gpus(self, mode: Mode) -> tuple[int, ...]:
        """The GPUs of each engine replica, after checking that the layout works for ``mode``."""
        generating, training = self.pools(mode)
        if generating < 1 or training < 1:
            raise ValueError(
                f"split mode needs GPUs that generate and GPUs that train: {self.gpus} GPUs, "
                f"{generating} generating (split must be between 1 and gpus - 1)"
            )
        count = generating if self.replicas is None else self.replicas
        if count < 1 or generating % count:
            raise ValueError(f"{generating} generating GPUs do not make {count} equal engine replicas")
        return (generating // count,) * count

    def label(self, mode: Mode) -> str:
        """``8`` (collocated) or ``4+4`` (split: generating + training)."""
        generating, training = self.pools(mode)
        return f"{generating}+{training}" if mode == "split" else str(self.gpus)
