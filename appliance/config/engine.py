"""The ``[engine]`` section: which generation engine, how it batches, and the vLLM server's
settings (``appliance.engines.factory.create_engine`` reads it). It does not own starting
the engine, nor resolving ``engine`` = "auto" (``ApplianceConfig.with_resolved_device``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from appliance.config.checks import at_least, one_of, seconds
from contracts.errors import ConfigError

#: The generation engines ``engine`` may name.
ENGINES = ("torch", "vllm")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """The generation engine: which one, how it batches, and the vLLM server's settings
    (``appliance.engines.factory.create_engine`` reads this section)."""

    #: Generation engine ("engine" in TOML, flags and environment): "torch" (in process),
    #: "vllm" (its own process and venv: make vllm) or "auto" (vllm on GPUs where its venv
    #: exists, else torch; resolved with the device, see ``ApplianceConfig.with_resolved_device``).
    kind: str = "auto"
    #: Concurrent generations the engine batches together.
    max_batch_size: int = 16
    #: vLLM servers, each on tensor_parallel_size GPUs of its own.
    engine_replicas: int = 1
    #: vLLM engine: GPUs the served model is sharded over (tensor parallelism).
    tensor_parallel_size: int = 1
    #: vLLM engine: fraction of each GPU's memory vLLM takes for weights and KV cache (GPU only;
    #: None: the placement plan's, which leaves room for what shares the GPU, at most 0.9).
    gpu_memory_utilization: float | None = None
    #: vLLM engine: run without CUDA graphs (None: eager on CPU, where compiling costs minutes and
    #: buys nothing; CUDA graphs on GPU, which decode several times faster for small batches).
    enforce_eager: bool | None = None
    #: vLLM engine: the interpreter of vLLM's own virtualenv (``make vllm-cpu`` or ``make vllm-gpu``);
    #: a relative path is looked up from the working directory, then from the project root.
    vllm_python: Path = Path(".venv-vllm/bin/python")
    #: vLLM engine: port of its server on 127.0.0.1 (0: a Unix socket of its own instead).
    vllm_port: int = 0
    #: vLLM engine: longest prompt + completion in tokens (None: the model's own context).
    vllm_max_model_len: int | None = None
    #: vLLM engine: GiB of host memory for the KV cache when serving on CPU.
    vllm_cpu_kv_cache_gib: int = 1
    #: vLLM engine: seconds to wait for its server to answer /health after a (re)start.
    vllm_startup_timeout_s: float = 600.0
    #: vLLM engine: attach to a server already running at this URL (e.g. ``http://127.0.0.1:8000``,
    #: or ``unix:/path/to/socket`` for one started with ``--uds``) instead of launching one; None
    #: launches and supervises its own.
    vllm_url: str | None = None
    #: vLLM servers on other machines that join the engine fleet (``http://host:port``, each
    #: started by ``lightning-appliance engine-host`` or ``vllm serve`` with the worker
    #: extension); more join at run time through ``POST /admin/engines``. They serve beside
    #: the local engine, never sleep, and take each new policy version.
    remote: tuple[str, ...] = ()
    #: Seconds a remote replica may take to take a weight update (or a catch-up call); past it
    #: the update goes on without it, and it serves no new rollouts until it catches up.
    remote_deadline_s: float = 60.0
    #: Seconds a call on a remote replica may wait for its next token (its first counted from
    #: the call's start); past it the call is ended there, as it is at once when the replica's
    #: ``/health`` probe fails: one with no token yet is served by another replica, one with
    #: tokens fails (a replica cut off without a reset never answers again).
    remote_stall_s: float = 30.0
    #: How remote replicas take new weights: "http" (each pulls the published version from the
    #: appliance's ``/admin/weights`` routes, checked by SHA-256: any network that passes HTTP)
    #: or "shm" (files in this host's ``/dev/shm``: replicas on this machine only).
    remote_weights: str = "http"
    #: The appliance's URL as remote replicas reach it, for their weight pulls (None: the
    #: proxy's own URL, its host name where it listens on every address).
    weights_url: str | None = None

    def __post_init__(self) -> None:
        one_of("engine", self.kind, ("auto", *ENGINES))
        for name in ("max_batch_size", "engine_replicas", "tensor_parallel_size", "vllm_max_model_len"):
            at_least(name, getattr(self, name), 1)
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"gpu_memory_utilization must be above 0 and at most 1; got {self.gpu_memory_utilization}"
            )
        if not 0 <= self.vllm_port <= 65535:
            raise ConfigError(f"vllm_port must be a port number (0: a Unix socket); got {self.vllm_port}")
        at_least("vllm_cpu_kv_cache_gib", self.vllm_cpu_kv_cache_gib, 1)
        seconds("vllm_startup_timeout_s", self.vllm_startup_timeout_s)
        seconds("remote_deadline_s", self.remote_deadline_s)
        seconds("remote_stall_s", self.remote_stall_s)
        for url in self.remote:
            remote_url(url)
        one_of("remote_weights", self.remote_weights, ("http", "shm"))
        if self.weights_url is not None:
            remote_url(self.weights_url)
        if self.vllm_url and self.engine_replicas > 1:
            raise ConfigError(
                f"vllm_url attaches to one running server, but engine_replicas is {self.engine_replicas}: "
                "drop vllm_url (the appliance launches a server per replica) or use --engine-replicas 1"
            )


def remote_url(url: str) -> str:
    """``url`` without a trailing slash, if it is a remote replica's ``http(s)://host:port``;
    a ``ConfigError`` naming it otherwise."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ConfigError(f"a remote engine must be an http://host:port URL; got {url!r}")
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        raise ConfigError(f"a remote engine must be an http://host:port URL; got {url!r}") from None
    return url.strip().rstrip("/")
