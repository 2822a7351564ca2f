"""Whether a weight push fits the served model, checked alike by the torch and vLLM engines.

Owns the checks made before anything of a push is copied: a whole state dict
(``check_state_dict``) and each bucket of a bucketed push (``check_bucket``) against the served
model's tensor names and shapes, each refused with one ``BadRequest`` that names what is
missing, unexpected, repeated or misshapen. Which names an engine expects (a tied LM head, the
checkpoint's or the live model's) and how it copies what passed are the engine's own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import torch

from contracts.errors import BadRequest
from trainer.buckets import WeightBucket, dtype_of


def check_state_dict(shapes: Mapping[str, Sequence[int]], weights: Mapping[str, torch.Tensor]) -> None:
    """``weights`` holds every name of ``shapes``, with its shape, and nothing else."""
    missing, unexpected = shapes.keys() - weights.keys(), weights.keys() - shapes.keys()
    misshapen = [k for k in shapes.keys() & weights.keys() if tuple(weights[k].shape) != tuple(shapes[k])]
    if missing or unexpected or misshapen:
        raise BadRequest(
            "the state dict does not fit the served model: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}, "
            f"wrong shapes {sorted(misshapen)[:5]}"
        )


def check_bucket(
    bucket: WeightBucket, shapes: Mapping[str, Sequence[int]], seen: set[str], *, dtypes: bool = False
) -> None:
    """Every entry of ``bucket`` names a tensor of ``shapes`` not in ``seen`` yet, once, with its
    shape (and, with ``dtypes``, a torch dtype); adds the names to ``seen``."""
    names = Counter(entry.name for entry in bucket.entries)
    unexpected = sorted(name for name in names if name not in shapes)
    repeated = sorted(name for name, count in names.items() if name in seen or count > 1)
    misshapen = sorted(
        e.name for e in bucket.entries if e.name in shapes and tuple(shapes[e.name]) != tuple(e.shape)
    )
    unknown = sorted({e.dtype for e in bucket.entries if not _is_dtype(e.dtype)}) if dtypes else []
    if unexpected or repeated or misshapen or unknown:
        raise BadRequest(
            f"weight bucket {bucket.index} does not fit the served model: unexpected "
            f"{unexpected[:5]}, repeated {repeated[:5]}, wrong shapes {misshapen[:5]}"
            + (f", unknown dtypes {unknown[:5]}" if dtypes else "")
        )
    seen.update(names)


def _is_dtype(name: str) -> bool:
    try:
        dtype_of(name)
    except ValueError:
        return False
    return True
