"""The backends' options: one declaration, checked once, taken as keywords by both backends."""

from __future__ import annotations

import inspect
from dataclasses import fields
from pathlib import Path

import pytest

from trainer.factory import VERL_ONLY_OPTIONS
from trainer.options import TrainerOptions, VerlOptions, keyword_options
from trainer.policy import PolicyTrainer
from trainer.verl_backend import VerlFSDPTrainer


def test_defaults_differ_only_in_off_policy() -> None:
    common = TrainerOptions()
    verl = VerlOptions()
    assert (common.off_policy, verl.off_policy) == ("bypass", "decoupled")
    assert all(
        getattr(common, f.name) == getattr(verl, f.name)
        for f in fields(TrainerOptions)
        if f.name != "off_policy"
    )


def test_verl_only_options_are_verl_options_own_minus_its_place_in_the_world() -> None:
    own = {f.name for f in fields(VerlOptions)} - {f.name for f in fields(TrainerOptions)}
    assert own - {"rank", "world_size", "init_method"} == VERL_ONLY_OPTIONS


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"max_tokens_per_microbatch": 0}, "max_tokens_per_microbatch must be >= 1"),
        ({"off_policy": "sometimes"}, "unknown off_policy 'sometimes'"),
        ({"is_cap": 0.5}, "is_cap must be >= 1"),
        ({"normalization": "batch"}, "unknown normalization 'batch'"),
    ],
)
def test_bad_common_options_are_rejected_by_both(options: dict[str, object], message: str) -> None:
    for cls in (TrainerOptions, VerlOptions):
        with pytest.raises(ValueError, match=message):
            cls(**options)  # type: ignore[arg-type]


def test_bad_verl_options_are_rejected() -> None:
    for bad in ({"mini_batches": 0}, {"kl_coef": -0.1}, {"lora_rank": -1}):
        with pytest.raises(ValueError, match="need mini_batches >= 1"):
            VerlOptions(**bad)


def test_backends_take_their_options_as_keywords() -> None:
    for cls, options in ((PolicyTrainer, TrainerOptions), (VerlFSDPTrainer, VerlOptions)):
        params = inspect.signature(cls).parameters
        assert list(params) == ["model_dir", *(f.name for f in fields(options))]
        assert all(params[f.name].kind is inspect.Parameter.KEYWORD_ONLY for f in fields(options))


def test_keyword_options_builds_the_options_object() -> None:
    class Backend:
        @keyword_options(TrainerOptions)
        def __init__(self, model_dir: str | Path, options: TrainerOptions) -> None:
            self.model_dir, self.options = model_dir, options

    backend = Backend("m", lr=0.5, loss="gspo")
    assert backend.model_dir == "m" and backend.options == TrainerOptions(lr=0.5, loss="gspo")
    with pytest.raises(TypeError, match="kl_coef"):
        Backend("m", kl_coef=0.1)  # type: ignore[call-arg]


def test_the_ranks_driver_checks_the_options_before_starting_a_rank() -> None:
    from trainer.ranks import RankedTrainer

    with pytest.raises(ValueError, match="need mini_batches >= 1"):
        RankedTrainer("unused", ranks=2, mini_batches=0)
    with pytest.raises(TypeError, match="lora"):
        RankedTrainer("unused", ranks=2, lora=8)
