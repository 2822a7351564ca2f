"""The verl trainer's weight-push API, once for the trainer and for its ranks' driver.

Owns :class:`PushApi`: ``weight_buckets``'s arguments turned into one
:class:`~trainer.rank_rpc.PushWeights` request, which each subclass carries out in ``push``
(``trainer.verl_backend.VerlFSDPTrainer``: on this rank; ``trainer.ranks.RankedTrainer``: sent
to every rank, rank 0's buckets handed on), and ``export_hf`` from the merged push. It does not
own how the buckets are filled (``trainer.verl_backend``, ``trainer.shard_buckets``,
``trainer.weight_group``) nor their format (``trainer.buckets``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainer.checkpoints import EXPORT_BUCKET_BYTES, buckets_to_hf, export_hf_model
from trainer.rank_rpc import PushWeights

if TYPE_CHECKING:
    from trainer.buckets import WeightBucket


class PushApi(ABC):
    """``weight_buckets`` and ``export_hf`` over a subclass's :meth:`push`."""

    #: The model trained (``export_hf`` copies its tokenizer files).
    model_dir: Path

    def weight_buckets(
        self,
        bucket_bytes: int,
        dtype: torch.dtype | None = None,
        directory: Path | None = None,
        *,
        merged: bool = False,
        via_group: bool = False,
    ) -> Iterator[WeightBucket]:
        """What the engine needs of this version, packed into buckets of about ``bucket_bytes``
        (``trainer.buckets``), cast to ``dtype`` if given, in files under ``directory`` (None:
        the default place), never the whole model at once: with LoRA the adapters alone
        (buckets marked with their ``LoraAdapter``; the engine keeps its base weights), unless
        ``merged``; otherwise (or ``merged``) the weights as ``state_dict_for_engine`` names
        them, a tied LM head left out. ``via_group``: whole weights broadcast over the weight
        group rank 0 hosts (``host_weight_group``, ``trainer.weight_group``); adapters (small)
        still go through a file. Nothing runs until the first bucket is asked for."""
        name = str(dtype).removeprefix("torch.") if dtype is not None else None
        where = str(directory) if directory else None
        return self.push(PushWeights(bucket_bytes, name, where, merged=merged, via_group=via_group))

    @abstractmethod
    def push(self, request: PushWeights) -> Iterator[WeightBucket]:
        """Carry out ``request`` (a generator: nothing runs until the first bucket is asked for)."""

    def export_hf(self, directory: Path) -> Path:
        """Write the current (merged) weights and ``model_dir``'s tokenizer files as an HF dir,
        from the push's buckets (one safetensors shard each; never the whole model in memory)."""
        buckets = self.weight_buckets(EXPORT_BUCKET_BYTES, merged=True)
        return export_hf_model(buckets_to_hf(buckets), self.model_dir, directory)
