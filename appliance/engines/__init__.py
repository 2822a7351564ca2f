"""Engines: sampling tokens from the policy, token ids in and token ids out.

Owns the ``Engine`` contract (``base``: generate, sleep/wake, load weights, the request ranges
every engine checks) and its implementations: ``TorchEngine`` in this process (``torch_engine``,
with its step loop, batches and weights in ``torch_steps``, ``torch_batch``, ``torch_weights``),
``VLLMEngine`` over a vLLM server in its own virtualenv and process (``vllm_engine`` and its
``vllm_*`` parts; ``vllm_worker`` runs inside vLLM, never here), ``EngineFleet`` over replicas
(``fleet``) and the factory that picks one (``factory``). Beside them: what both engines share
(``served``, ``weight_checks``), the numerics of choosing tokens (``sampling``), output
constraints (``constraints``), LoRA adapters (``lora``), the model registry and the tiny test
model (``models``, ``tiny_model``). Chat templates, tools and HTTP to agents are the proxy's.

May import: ``appliance.config`` and ``appliance.placement`` (the factory's settings),
``appliance.chat`` (a model's chat format), ``trainer.buckets`` (the weight-bucket format) and
``contracts``. The rest of the appliance imports it; nothing below the appliance does.
"""
