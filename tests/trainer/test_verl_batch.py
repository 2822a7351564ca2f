"""build_batch / response_values: samples in verl's layout, checked position by position."""

from __future__ import annotations

import pytest
import torch
from verl.utils import tensordict_utils as tu

from trainer.samples import Sample
from trainer.verl_batch import build_batch, response_values, split_point

# A two-call agent sample: prompt 5 6 7, response 10 11, tool result 8 9 (masked), response 12.
AGENT = Sample(
    rollout="A",
    call_ids=("c1", "c2"),
    tokens=(5, 6, 7, 10, 11, 8, 9, 12),
    loss_mask=(0, 0, 0, 1, 1, 0, 0, 1),
    logprobs=(0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3),
    versions=(-1, -1, -1, 0, 0, -1, -1, 1),
)
SHORT = Sample("B", ("c3",), (5, 6, 20), (0, 0, 1), (0.0, 0.0, -0.4), (-1, -1, 2))


def test_split_at_the_first_trained_token() -> None:
    assert (split_point(AGENT), split_point(SHORT)) == (3, 2)
    # Position 0 is never trained: a sampled first token does not make an empty prompt.
    first = Sample("C", ("c",), (1, 2, 3), (1, 0, 1), (-0.5, 0.0, -0.6), (0, -1, 0))
    assert split_point(first) == 2
    with pytest.raises(ValueError, match="no trainable token"):
        split_point(Sample("D", ("c",), (1, 2), (1, 0), (-0.5, 0.0), (0, -1)))


def test_layout_of_prompts_responses_and_masks() -> None:
    td = build_batch([(AGENT, 1.5, 0.25), (SHORT, -1.0, 0.5)], temperature=0.7, max_token_len=4)
    # Left-padded prompts, right-padded responses (pad id 0), P = 3, R = 5.
    assert td["prompts"].tolist() == [[5, 6, 7], [0, 5, 6]]
    assert td["responses"].tolist() == [[10, 11, 8, 9, 12], [20, 0, 0, 0, 0]]
    # The tool result inside the response stays masked.
    assert td["response_mask"].tolist() == [[1, 1, 0, 0, 1], [1, 0, 0, 0, 0]]
    assert td["loss_mask"].tolist() == td["response_mask"].tolist()
    expected = torch.tensor([[-0.1, -0.2, 0.0, 0.0, -0.3], [-0.4, 0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(td["sampler_log_probs"], expected)
    assert td["advantages"].tolist() == [[1.5, 1.5, 0.0, 0.0, 1.5], [-1.0, 0.0, 0.0, 0.0, 0.0]]
    assert td["norm_weights"].tolist() == [[0.25, 0.25, 0.0, 0.0, 0.25], [0.5, 0.0, 0.0, 0.0, 0.0]]
    # No-padding layout: the real tokens only, each row's positions from 0.
    assert td["input_ids"].values().tolist() == [5, 6, 7, 10, 11, 8, 9, 12, 5, 6, 20]
    assert td["input_ids"].offsets().tolist() == [0, 8, 11]
    assert td["position_ids"].values().tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2]
    assert tu.get(td, "temperature") == 0.7
    # The micro-batch budget is raised to the longest sequence (verl requires it to fit).
    assert tu.get(td, "max_token_len_per_gpu") == 8
    assert tu.get(td, "use_remove_padding") is False


def test_response_values_aligns_per_token_outputs_with_the_response() -> None:
    td = build_batch([(AGENT, 1.0, 1.0), (SHORT, 1.0, 1.0)], temperature=1.0, max_token_len=64)
    # An engine output over whole sequences, e.g. log-probs: position t holds the value for
    # token t + 1 (the logits at t predict t + 1). Fake it with the flat index.
    output = torch.nested.nested_tensor_from_jagged(torch.arange(11.0), offsets=td["input_ids"].offsets())
    # AGENT's response tokens are at 3..7, predicted at 2..6; SHORT's token 2 at flat index 9.
    assert response_values(output, td).tolist() == [[2, 3, 4, 5, 6], [9, 0, 0, 0, 0]]


def test_an_empty_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        build_batch([], temperature=1.0, max_token_len=64)
