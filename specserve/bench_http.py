"""`specserve bench --url`: the same MT-Bench workload as the offline bench, sent to a running server.

Each batch size B sends B concurrent native `/generate` requests (the chat-templated prompt ids,
greedy, a fixed number of new tokens with EOS ignored) and times submission to the last response,
so its tokens/s compare directly with the offline rows of the engine in-process.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from specserve.bench import BenchRow, _row


def time_http(
    url: str, batch: list[list[int]], new_tokens: int, timeout_s: float = 1800
) -> tuple[float, float | None]:
    """(seconds, accept length or None) for one batch of concurrent requests."""
    return asyncio.run(_run(url.rstrip("/"), batch, new_tokens, timeout_s))


async def _run(url: str, batch: list[list[int]], new_tokens: int, timeout_s: float):
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    limits = httpx.Limits(max_connections=len(batch) + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        await client.post(f"{url}/flush_cache")  # no prefix reuse between runs
        start = time.perf_counter()
        responses = await asyncio.gather(
            *(
                client.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": params})
                for ids in batch
            )
        )
        seconds = time.perf_counter() - start
    metas = []
    for r in responses:
        r.raise_for_status()
        metas.append(r.json()["meta_info"])
    assert all(m["completion_tokens"] == new_tokens for m in metas)
    verify = sum(m.get("spec_verify_ct", 0) for m in metas)
    return seconds, (len(batch) * new_tokens / verify if verify else None)


def http_rows(url: str, prompts: list[list[int]], batch_sizes: list[int], new_tokens: int) -> list[BenchRow]:
    time_http(url, prompts[:2], 8)  # warm-up
    rows = []
    for b in batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        seconds, accept = time_http(url, batch, new_tokens)
        rows.append(_row("specserve-http", b, new_tokens, seconds, accept))
    return rows
