"""`specserve serve` as a user runs it: a URL printed, the OpenAI client answered, Ctrl-C exits cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(600)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout_s: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"no {needle!r} from specserve serve:\n{''.join(lines[-40:])}")


def test_specserve_serve_answers_and_stops_on_ctrl_c(smollm2_gguf):
    openai = pytest.importorskip("openai")
    port = _free_port()
    command = [sys.executable, "-P", "-m", "specserve.cli", "serve", "--device", "cpu", "--port", str(port)]
    command += ["--model", str(smollm2_gguf), "--ray-address", "local"]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        lines = _wait_for_line(proc, "serving", timeout_s=300)
        assert f"http://127.0.0.1:{port}" in lines[-1]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
            temperature=0,
        )
        assert reply.choices[0].message.content
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        _wait_for_engine_metrics(f"http://127.0.0.1:{port}/metrics")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_for_engine_metrics(url: str) -> None:
    """`curl localhost:8000/metrics`: the engine replica's counters, labelled by its replica id (the
    replica pushes them to the app's metrics hub every 2 s)."""
    deadline = time.monotonic() + 60
    while True:
        samples = [
            s
            for family in text_string_to_metric_families(httpx.get(url, timeout=30).text)
            for s in family.samples
            if s.name == "specserve_generation_tokens_total" and s.value > 0
        ]
        if samples:
            assert samples[0].labels["replica"] != "local"
            return
        assert time.monotonic() < deadline, "no engine metrics at /metrics"
        time.sleep(0.5)


def test_specserve_serve_rejects_bad_flags():
    result = subprocess.run(
        [sys.executable, "-P", "-m", "specserve.cli", "serve", "--tp", "0"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "--tp:" in result.stderr  # the flag as typed, not the config field
    both = [
        sys.executable,
        "-P",
        "-m",
        "specserve.cli",
        "serve",
        "--no-speculative",
        "--speculative",
        "ngram",
    ]
    result = subprocess.run(both, capture_output=True, text=True)
    assert result.returncode == 2 and "--no-speculative contradicts" in result.stderr
