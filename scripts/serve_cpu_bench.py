"""Streaming throughput through Ray Serve on the CPU, beside the same engine offline.

Starts a local Ray instance and the specserve app over the tiny random Llama of `profile_host.py`,
with a byte-level BPE tokenizer of 1024 ids trained on the MT-Bench prompts at start (so the CPU's
forward and sampling cost little beside the serving path, as on a GPU, and detokenisation is real
BPE), then runs
`specserve bench online --endpoint generate --ignore-eos` against it at the given concurrency, and the
same batch offline through `LLM.generate`, so the online figure comes with the offline one it
should approach. Everything is stopped at the end.

    python scripts/serve_cpu_bench.py [--concurrency 64] [--num-requests 192] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as `python -P`: its neighbour's helper
from profile_host import tiny_model  # noqa: E402


def small_tokenizer():
    """A byte-level BPE of 1024 ids trained on the bench prompts (a fraction of a second)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from specserve.bench_data import prompt_texts

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(prompt_texts("mt-bench"), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS)


def offline_tokens_per_s(folder: Path, args: argparse.Namespace) -> float:
    """The engine alone: one batch of `concurrency` prompts through `LLM.generate`, as the replica
    configures it (page size 16, prefix cache on, no speculation, overlap scheduling)."""
    from specserve import LLM, SamplingParams
    from specserve.bench_data import prompt_texts
    from specserve.model.loader import load_model

    loaded = load_model(str(folder), torch.device("cpu"), torch.float32)
    llm = LLM(loaded, device="cpu", dtype="float32", page_size=16, max_total_tokens=args.max_total_tokens)
    texts = prompt_texts("mt-bench", max_chars=args.max_prompt_chars)
    prompts = (texts * (args.concurrency // len(texts) + 1))[: args.concurrency]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=0.0))
    start = time.perf_counter()
    llm.generate(prompts, params)
    return len(prompts) * args.max_new_tokens / (time.perf_counter() - start)


EOS = "<|endoftext|>"


def serve_app(folder: Path, args: argparse.Namespace, driver_dir: Path) -> str:
    import ray
    from ray import serve

    from specserve.serve.app import build_app

    # Started from an empty folder: a checkout's kernels/ must not shadow the PyPI `kernels` on workers.
    with contextlib.chdir(driver_dir):
        ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app(
        {
            "model": str(folder),
            "device": "cpu",
            "dtype": "float32",
            "speculative": None,
            "max_total_tokens": args.max_total_tokens,
            "max_running_requests": args.concurrency,
            **({} if args.stream_rate is None else {"stream_messages_per_s": args.stream_rate or None}),
        }
    )
    serve.run(app, name="bench", route_prefix="/", blocking=False)
    deadline = time.monotonic() + 300
    while (status := serve.status().applications["bench"].status) != "RUNNING":
        if status == "DEPLOY_FAILED" or time.monotonic() > deadline:
            raise RuntimeError(f"the app did not start: {serve.status().applications['bench']}")
        time.sleep(0.5)
    return f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=192)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-total-tokens", type=int, default=64 * 1024)
    parser.add_argument(
        "--max-prompt-chars",
        type=int,
        default=150,
        help="short prompts: the CPU's reference attention is dense over the batch's whole context",
    )
    parser.add_argument(
        "--stream-rate", type=float, default=None, help="the app's stream_messages_per_s (0: null)"
    )
    parser.add_argument("--skip-offline", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as Ray gives the replica (one CPU): a shared machine's spin-waits cost more

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        tiny_model(folder, small_tokenizer())  # saves the folder the replica loads
        offline = None if args.skip_offline else offline_tokens_per_s(folder, args)
        driver = Path(tmp) / "driver"
        driver.mkdir()
        try:
            url = serve_app(folder, args, driver)
            command = [
                *(sys.executable, "-P", "-m", "specserve.cli", "bench", "online"),
                *("--url", url, "--endpoint", "generate", "--ignore-eos"),
                *("--concurrency", str(args.concurrency), "--num-requests", str(args.num_requests)),
                *("--max-new-tokens", str(args.max_new_tokens)),
                *("--max-prompt-chars", str(args.max_prompt_chars)),
                *("--out", str(Path(tmp) / "online.json")),
            ]
            print("$", " ".join(command[1:]), flush=True)
            subprocess.run(command, check=True, env=os.environ)
            report = json.loads((Path(tmp) / "online.json").read_text())
        finally:
            import ray
            from ray import serve

            if ray.is_initialized():
                serve.shutdown()
                ray.shutdown()
    online = report["output_tokens_per_s"]
    ttft = report["latency_s"]["ttft"]
    ttfts = f"TTFT p50 {ttft['p50']:.3f} s  p99 {ttft['p99']:.3f} s"
    print(f"online  c={args.concurrency}: {online:8.1f} tok/s  {ttfts}")
    if offline is not None:
        print(f"offline b={args.concurrency}: {offline:8.1f} tok/s  (online is {online / offline:.0%} of it)")


if __name__ == "__main__":
    main()
