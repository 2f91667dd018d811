"""SmolLM2 served through Ray Serve on GPUs (run on the lent machine): greedy output of a TP=2
replica (NCCL) against a TP=1 replica, and tokens/s through HTTP against the engine in-process.

    python3 -P scripts/serve_check.py [--out DIR] [--tp 2]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import ray
from ray import serve

from specserve.assets import dataset_path, pull
from specserve.model.tokenizer import chat_prompt_ids, load_tokenizer
from specserve.serve.app import build_app

MAX_TOKENS = 200_000  # KV slots per server, so the in-process bench engine fits beside it


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deploy(tp: int, device: str, dtype: str) -> None:
    args = {
        "model": "smollm2-135m-instruct",
        "device": device,
        "dtype": dtype,
        "tp_size": tp,
        "max_total_tokens": MAX_TOKENS,
        "speculative": {"method": "ngram", "num_steps": 4},
    }
    serve.run(build_app(args), name="specserve", route_prefix="/", blocking=False)
    while serve.status().applications["specserve"].status != "RUNNING":
        assert serve.status().applications["specserve"].status != "DEPLOY_FAILED", serve.status()
        time.sleep(1)


def _greedy(url: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    r = httpx.post(f"{url}/generate", json={"input_ids": prompts, "sampling_params": params}, timeout=600)
    assert r.status_code == 200, r.text
    return [o["output_ids"] for o in r.json()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on GPU), float32, ...")
    parser.add_argument("--skip-bench", action="store_true", help="only compare TP=N with TP=1")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--max-new-tokens", default="256")
    args = parser.parse_args()
    model = pull("smollm2-135m-instruct")
    tok = load_tokenizer(model)
    lines = dataset_path("mt-bench").read_text().splitlines()
    questions = [json.loads(line)["turns"][0] for line in lines if line][:16]
    prompts = [chat_prompt_ids(tok, [{"role": "user", "content": q}]) for q in questions]
    ray.init(include_dashboard=False, logging_level="WARNING")
    port = _port()
    url = f"http://127.0.0.1:{port}"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    report: dict = {}
    _deploy(1, args.device, args.dtype)
    tp1 = _greedy(url, prompts, 64)
    bench = [
        sys.executable, "-P", "-m", "specserve.cli", "bench", "--batch-sizes", args.batch_sizes,
        "--max-new-tokens", args.max_new_tokens, "--device", args.device,
        "--speculative", "ngram", "--num-steps", "4", "--max-total-tokens", str(MAX_TOKENS),
        "--page-size", "16", "--url", url, "--out", str(Path(args.out, "bench_http.json")),
    ]  # fmt: skip
    if not args.skip_bench:
        report["bench"] = subprocess.run(bench, capture_output=True, text=True, check=True).stdout
    serve.delete("specserve")
    _deploy(args.tp, args.device, args.dtype)
    tpn = _greedy(url, prompts, 64)
    same = [a == b for a, b in zip(tp1, tpn, strict=True)]
    prefix = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        for a, b in zip(tp1, tpn, strict=True)
    ]
    report["tp_vs_tp1"] = {
        "tp": args.tp,
        "prompts": len(same),
        "identical": sum(same),
        "mean_common_prefix": sum(prefix) / len(prefix),
    }
    serve.shutdown()
    ray.shutdown()
    Path(args.out, "serve_check.json").write_text(json.dumps(report, indent=2))
    print(report.get("bench", ""))
    print(
        f"greedy through Ray Serve on {args.device} ({args.dtype}), 64 tokens, 16 MT-Bench prompts:",
        json.dumps(report["tp_vs_tp1"]),
    )


if __name__ == "__main__":
    main()
