"""Code that runs inside vLLM's worker processes (in vLLM's own virtualenv), never in the appliance.

Owns ``ApplianceWorkerExtension``, the ``--worker-extension-cls`` vLLM mixes into each worker, so
that ``POST /collective_rpc`` can call ``appliance_reload_weights``. It imports nothing from the
appliance (the file is copied next to the server and put on its ``PYTHONPATH`` alone) and
nothing from vLLM at import time, so it type-checks without vLLM installed.

Why not vLLM's own ``reload_weights`` alone: its layerwise reload copies new values into a tied
embedding in place, but the LM head that shares that tensor loads nothing and is not processed
again; on CPU that processing holds a prepacked copy of the weight for the logits GEMM, so the
head kept computing with the old embedding (measured: log-probs off by ~1.5 after a push).
"""

from __future__ import annotations

from typing import Any


class ApplianceWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def appliance_reload_weights(self, weights_path: str) -> int:
        """Reload the weights in place from the safetensors in ``weights_path``; returns the
        number of tied LM heads whose processed copy was rebuilt."""
        worker: Any = self
        worker.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        return reprocess_tied_lm_heads(worker.model_runner.get_model())


def reprocess_tied_lm_heads(model: Any) -> int:
    """Rerun the post-load processing of unquantized LM heads tied to an embedding."""
    embeddings = {
        id(module.weight) for module in model.modules() if type(module).__name__ == "VocabParallelEmbedding"
    }
    done = 0
    for module in model.modules():
        method: Any = getattr(module, "quant_method", None)
        if (
            type(module).__name__ == "ParallelLMHead"
            and id(getattr(module, "weight", None)) in embeddings
            and type(method).__name__ == "UnquantizedEmbeddingMethod"
        ):
            method.process_weights_after_loading(module)
            done += 1
    return done
