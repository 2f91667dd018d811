"""`specserve serve`: start (or join) Ray, run the app on host:port, wait for Ctrl-C, shut down cleanly."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from specserve.api import API_KEY_ENV
from specserve.cli_spec_args import (
    add_speculative_arguments,
    draft_vocab_setting,
    shape_setting,
    speculative_from_args,
)

if TYPE_CHECKING:
    # pydantic only when serving: `specserve bench` builds this parser too, on machines without it.
    from pydantic import ValidationError

APP_NAME = "specserve"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="asset name, .gguf file or HF folder (default: SmolLM2)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel ranks per engine replica (default: 1)"
    )
    parser.add_argument("--replicas", type=int, default=1, help="engine replicas (default: 1)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output")
    parser.add_argument(
        "--no-speculative",
        action="store_true",
        help="plain decoding (default: the model's shipped draft head, else the n-gram drafter)",
    )
    add_speculative_arguments(parser, default="`default`; --no-speculative for none")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require `Authorization: Bearer KEY` on every endpoint but /health (default: ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster to join (default: a running local one, else a new one)",
    )


def config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "tp_size": args.tp,
        "num_replicas": args.replicas,
        "device": args.device,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
    }
    if args.model:
        config["model"] = args.model
    # The environment's key goes into the config: on a cluster joined with --ray-address, the replicas
    # do not inherit this shell's environment.
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    if api_key:
        config["api_key"] = api_key
    vocab = {**shape_setting(args), **draft_vocab_setting(args)}
    if args.no_speculative:
        config["speculative"] = None
    elif args.speculative in (None, "default") and args.adaptive:  # the default drafter, adapted
        config["speculative"] = {"method": "default", "adaptive": True, **vocab}
    elif args.speculative == "default" or (args.speculative is None and vocab):
        # resolved by each replica, against its own install (--num-steps etc. over its own)
        config["speculative"] = {"method": "default", **vocab} if vocab else "default"
    elif args.speculative:
        config["speculative"] = speculative_from_args(args)
    return config


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from specserve.serve.config import ServeConfig

    if args.no_speculative and (args.speculative or args.adaptive or shape_setting(args)):
        print(
            "specserve serve: error: --no-speculative contradicts --speculative / --adaptive", file=sys.stderr
        )
        return 2
    try:
        config = ServeConfig.model_validate(config_from_args(args))
    except ValidationError as err:
        print(f"specserve serve: error: {_first_error(err)}", file=sys.stderr)
        return 2
    return serve_until_interrupted(config, args.ray_address)


def serve_until_interrupted(config: Any, ray_address: str | None = None) -> int:
    import ray
    from ray import serve

    from specserve.serve.app import build_app
    from specserve.serve.metrics_hub import kill_hub

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ray.init(address=ray_address, include_dashboard=False, logging_level="WARNING")
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
        url = f"http://{config.host}:{config.port}"
        print(f"specserve: serving {config.model_name} at {url}  (OpenAI: {url}/v1, native: {url}/generate)")
        print("specserve: Ctrl-C to stop", flush=True)
        stop.wait()
        print("specserve: shutting down", flush=True)
    finally:
        serve.shutdown()
        kill_hub(APP_NAME)  # on a cluster that lives on (--ray-address), nothing else would
        ray.shutdown()
    return 0


# ServeConfig's fields as `serve`'s flags spell them, for its errors
_FLAGS = {
    "tp_size": "--tp",
    "num_replicas": "--replicas",
    "max_model_len": "--max-model-len",
    "port": "--port",
}


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    where = _FLAGS.get(where, where)
    message = first["msg"].removeprefix("Value error, ")
    return message if not where or message.startswith(where) else f"{where}: {message}"
