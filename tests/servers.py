"""A real `moebox serve` process for the HTTP tests: started on a free loopback port, waited for through
/health (bounded polling, no fixed sleeps), stopped at the end."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metric(self, name: str) -> float:
        """Sum of a Prometheus metric's samples (all label sets)."""
        text = httpx.get(f"{self.base_url}/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#") and
                   (line[len(name)] in " {"))

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_server(args: list[str], cache_dir: Path, log: Path, timeout: float = 180) -> Server:
    port = free_port()
    # one intra-op thread: on the 2-core test box the engine, the HTTP loop and the test's clients share the cores
    env = {**os.environ, "MOEBOX_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "moebox.cli", "serve", "--port", str(port), *args],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, port, log)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"server not healthy in {timeout} s: {log.read_text()[-2000:]}")
