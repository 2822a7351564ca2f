"""``lightning-appliance engine-host``: a vLLM server on this machine for an appliance elsewhere.

Owns the one command that turns a machine into a remote engine replica: it starts vLLM from
``.venv-vllm`` with the appliance's worker extension and the dev routes (the same command line
the appliance launches its own servers with, ``vllm_process.server_command``), listening on
``--host`` (all interfaces by default) and ``--port``, prints the URL the appliance reaches it at,
and with ``--appliance`` and ``--token`` registers it there (``POST /admin/engines``). It then
serves until Ctrl-C (or SIGTERM), and stops the server's whole process group. The appliance
checks the model, catches it up and routes to it; nothing of that is this command's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contracts.errors import ApplianceError

if TYPE_CHECKING:
    from appliance.engines.vllm_process import ServerSettings


def add_parser(sub: Any) -> None:
    """``engine-host`` and its flags."""
    host = sub.add_parser(
        "engine-host", help="serve the policy with vLLM here, for an appliance on another machine"
    )
    host.add_argument(
        "--model", required=True, help="the run's model: a directory, or a registered name (tiny, ...)"
    )
    host.add_argument(
        "--port", type=int, required=True, help="the port vLLM listens on (open it to the appliance)"
    )
    host.add_argument(
        "--host", default="0.0.0.0", help="the address vLLM listens on (default: every interface)"
    )
    host.add_argument("--advertise", default=None, help="the host name the appliance reaches this one by")
    host.add_argument(
        "--appliance", default=None, help="the appliance's URL (http://host:8640): register there"
    )
    host.add_argument(
        "--token",
        default=os.environ.get("APPLIANCE_ADMIN_TOKEN"),
        help="the appliance's admin token (its data directory's admin_token; or APPLIANCE_ADMIN_TOKEN, "
        "which keeps it off the command line)",
    )
    host.add_argument(
        "--logprobs-mode",
        default="raw_logprobs",
        help="as the run samples: raw_logprobs at temperature 1, processed_logprobs otherwise",
    )
    host.add_argument("--vllm-python", type=Path, default=Path(".venv-vllm/bin/python"))
    host.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    host.add_argument(
        "--dtype", default="auto", help="as the appliance serves: float32 on CPU, bfloat16 on GPUs"
    )
    host.add_argument("--max-model-len", type=int, default=None)
    host.add_argument("--max-batch-size", type=int, default=16)
    host.add_argument("--tensor-parallel-size", type=int, default=1)
    host.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="the run's [trainer] lora_rank, for a LoRA run (it then serves the adapters it pulls)",
    )
    host.add_argument("--data-dir", type=Path, default=Path("engine-data"), help="the server's log and model")
    host.add_argument("--startup-timeout", type=float, default=600.0)


def run(args: argparse.Namespace) -> int:
    """``lightning-appliance engine-host``: 0 after a clean stop, 2 on an error one can fix."""
    from appliance.engines.models import resolve
    from appliance.engines.vllm_process import ServerSettings, vllm_python

    if args.appliance and not args.token:
        raise ApplianceError(
            "--appliance needs --token (or APPLIANCE_ADMIN_TOKEN): the appliance's admin token"
        )
    args.data_dir.mkdir(parents=True, exist_ok=True)
    model = resolve(args.model, args.data_dir / "models")
    settings = ServerSettings(
        model_dir=model.path,
        python=vllm_python(args.vllm_python),
        host=args.host,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_batch_size,
        tensor_parallel_size=args.tensor_parallel_size,
        lora_rank=args.lora_rank,
        extra_args=("--logprobs-mode", args.logprobs_mode),
    )
    print(
        f"starting vLLM for {model.name} on port {args.port} (log: {args.data_dir / 'vllm.log'})", flush=True
    )
    return asyncio.run(_serve(args, settings))


def advertised_url(host: str, port: int, advertise: str | None) -> str:
    """The URL the appliance reaches the server at: ``advertise``, else the listening address,
    else (listening everywhere) this machine's name."""
    name = advertise or (socket.getfqdn() if host in ("0.0.0.0", "::", "") else host)
    return f"http://{name}:{port}"


async def register(appliance: str, token: str, url: str) -> dict[str, Any]:
    """``POST /admin/engines`` on the appliance; its answer, or an ``ApplianceError`` with its
    one-line refusal."""
    import aiohttp

    headers = {"Authorization": f"Bearer {token}"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{appliance.rstrip('/')}/admin/engines", json={"url": url}, headers=headers
        ) as response,
    ):
        body = await response.json(content_type=None)
        if response.status not in (200, 201):
            message = body.get("error", {}).get("message") if isinstance(body, dict) else None
            raise ApplianceError(
                f"the appliance refused this engine (HTTP {response.status}): {message or body}"
            )
        return dict(body)


async def _serve(args: argparse.Namespace, settings: ServerSettings) -> int:
    import aiohttp

    from appliance.engines.vllm_process import ServerProcess

    server = ServerProcess(settings, port=args.port, log_path=args.data_dir / "vllm.log")
    url = advertised_url(args.host, args.port, args.advertise)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # Health is asked at the listening address (0.0.0.0 reaches this machine's own on Linux).
    async with aiohttp.ClientSession() as session:
        await server.start(session, args.startup_timeout)
    try:
        print(f"engine serving at {url}", flush=True)
        if args.appliance:
            entry = await register(args.appliance, args.token, url)
            print(f"registered with {args.appliance} as {entry['id']} ({entry['state']})", flush=True)
        waiting = asyncio.ensure_future(server.wait())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if waiting.done():
            print(f"vLLM exited with status {waiting.result()}; its log: {server.log_path}", file=sys.stderr)
            return 1
        stopping.cancel()
        return 0
    finally:
        with contextlib.suppress(Exception):
            await server.stop()
