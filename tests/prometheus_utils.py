"""A real Prometheus on loopback, and an ASGI app served by uvicorn in a thread (a helper module, not a
test file)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import uvicorn

DEADLINE_S = 60.0  # how long to wait for a process to come up or a scrape to land before failing


def find_or_install_prometheus() -> str | None:
    """`prometheus` on PATH; when missing and running as root with apt, Debian's package installed
    (after `apt-get update` if the package is unknown). None when it cannot be had."""
    found = shutil.which("prometheus")
    if found or os.geteuid() != 0 or not shutil.which("apt-get"):
        return found
    # Both pytest workers may get here at once; apt's own lock would fail the second outright.
    with open(Path(tempfile.gettempdir()) / "specserve-prometheus-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if found := shutil.which("prometheus"):  # the other worker installed it meanwhile
            return found
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"]
        if subprocess.run(install, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True)
            subprocess.run(install, env=env, capture_output=True)
    return shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _until(condition, what: str, deadline_s: float = DEADLINE_S, every_s: float = 0.1):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every_s)
    raise TimeoutError(f"gave up waiting for {what}")


class Prometheus:
    """A Prometheus process on 127.0.0.1:<free port> with its own config and data in `workdir`;
    scrape jobs are added later by rewriting the config and reloading it."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.workdir = workdir
        self.config = workdir / "prometheus.yml"
        self.log = workdir / "prometheus.log"
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs: []\n")
        self.http = httpx.Client(base_url=self.url, timeout=10)
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                    "--web.enable-lifecycle",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            _until(self._ready, "Prometheus to be ready")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"prometheus exited ({self.process.returncode}):\n{self.log.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            return self.http.get("/-/ready").status_code == 200
        return False

    def scrape(self, job: str, target: str, interval: str = "1s") -> None:
        """Scrape `http://<target>/metrics` every `interval` as `job` (replacing any other job)."""
        self.config.write_text(
            f"global:\n  scrape_interval: {interval}\n  scrape_timeout: {interval}\n"
            f"scrape_configs:\n  - job_name: {job}\n    metrics_path: /metrics\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        self.http.post("/-/reload").raise_for_status()

    def last_scrape(self, job: str) -> float | None:
        """When the latest successful scrape of `job` started (unix seconds), None before the first."""
        # timestamp() of a selector is the sample's time; of an expression (`up == 1`) it would be the
        # evaluation time, i.e. now: filter with `and` so the sample's own timestamp survives.
        query = f'timestamp(up{{job="{job}"}}) and up{{job="{job}"}} == 1'
        reply = self.http.get("/api/v1/query", params={"query": query}).json()
        result = reply["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def wait_for_scrape_after(self, job: str, t: float) -> float:
        """Block until a scrape of `job` that started after `t` is stored; its start time."""
        return _until(lambda: (s := self.last_scrape(job)) is not None and s > t and s, f"a scrape of {job}")

    def stop(self) -> None:
        self.http.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextlib.contextmanager
def uvicorn_thread(app) -> Iterator[str]:
    """Serve an ASGI app on 127.0.0.1:<free port> from a background thread; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        _until(lambda: server.started or not thread.is_alive(), "uvicorn to start")
        assert server.started, "uvicorn did not start"
        host, port = sock.getsockname()
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(DEADLINE_S)
        sock.close()
