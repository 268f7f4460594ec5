"""Servers and clients of bench/vs_vllm.py: `vllm serve` (its own venv) and `kvllm serve` as subprocesses on a
loopback port, `vllm bench serve` and `kvllm bench serve` against either, and the preemption counters of /metrics.

Every server runs in a process group of its own, so stopping it also ends vLLM's engine-core and worker processes.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.vllm_env import ROOT, VENV
from bench.vs_vllm_offline import cpu_delta, cpu_summary, tree_cpu

SERVED_NAME = "smollm2"
# cumulative counters read before and after each client run (kvllm has all; vLLM the preemptions)
COUNTERS = ("num_preemptions", "compression_rounds", "compression_blocks_freed", "swapped_out_blocks",
            "recomputed_tokens")


def vllm_env(threads: int, kv_gib: int | None = None) -> dict[str, str]:
    """vLLM's CPU settings: OpenMP threads bound to cores 0..threads-1, compile cache inside build/, no hub."""
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",
           "VLLM_CACHE_ROOT": str(ROOT / "build" / "vllm-cache"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1",
           # vLLM 0.32 with torch 2.13 saves its compiled model as an AOT artifact that it then fails to load
           # ("'function' object has no attribute 'finalize_loading'") and recompiles at every start
           "VLLM_USE_AOT_COMPILE": "0"}
    if kv_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    return env


@dataclass
class Server:
    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    log: Path
    proc: subprocess.Popen | None = None
    startup_s: float = 0.0
    idle_cores: float = 0.0

    def start(self, timeout: float = 1800.0) -> "Server":
        with socket.socket() as sock:  # a server left on the port would answer /health for this one
            if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                raise RuntimeError(f"port {self.port} is already in use; pick another with --port")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while starting; see {self.log}")
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5).status == 200:
                    self.startup_s = time.perf_counter() - t0
                    self._warm_up()
                    self.idle_cores = self._idle_cores()
                    return self
            except OSError:
                time.sleep(2)
        self.stop()
        raise RuntimeError(f"{self.name} not healthy after {timeout:.0f} s; see {self.log}")

    def _idle_cores(self, seconds: float = 5.0) -> float:
        """CPU cores the server keeps busy while it has no request (a polling loop shows here)."""
        c0 = sum(self.cpu_seconds().values())
        time.sleep(seconds)
        return (sum(self.cpu_seconds().values()) - c0) / seconds

    def _warm_up(self) -> None:
        """One short completion, so no measured run pays a server's first-request costs."""
        body = json.dumps({"model": SERVED_NAME, "prompt": "Hello, my name is", "max_tokens": 4,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=600).read()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by each thread of the server's process tree (bench/vs_vllm_offline.py)."""
        return tree_cpu(self.proc.pid)

    def counters(self) -> dict[str, float]:
        """The server's cumulative counters of COUNTERS found in /metrics (vLLM's or kvllm's Prometheus names)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30).read().decode()
        out = {}
        for name in COUNTERS:
            m = re.search(rf"^(?:vllm|kvllm):{name}_total(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
            if m:
                out[name] = float(m.group(1))
        return out


def vllm_server(model_dir: Path, port: int, threads: int, log: Path, *, kv_gib: int | None, flags: list[str],
                dtype: str = "float32", bare: bool = False):
    """bare: the launch line a user types, the model, host, port and served name then `flags` only (no dtype, seed
    or log level): vLLM at its own defaults for everything `flags` leaves out."""
    cmd = [str(VENV / "bin" / "vllm"), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", SERVED_NAME]
    if not bare:
        cmd += ["--dtype", dtype, "--seed", "0", "--uvicorn-log-level", "warning"]
    return Server("vllm", cmd + flags, vllm_env(threads, kv_gib), port, log)


def kvllm_server(model_dir: Path, port: int, threads: int | None, log: Path, *, flags: list[str],
                 dtype: str = "float32", bare: bool = False):
    """bare: as for vllm_server; threads None: no --threads (kvllm serve then runs one thread per core)."""
    cmd = [sys.executable, "-m", "server.cli", "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", SERVED_NAME]
    if not bare:
        cmd += ["--dtype", dtype, "--seed", "0"]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    if not bare:
        cmd += ["--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    return Server("kvllm", cmd + flags, {**os.environ, "TQDM_DISABLE": "1"}, port, log)


@dataclass
class Workload:
    """One client run: the same jsonl prompts, output length, rate and concurrency for both clients."""
    dataset: Path
    num_prompts: int
    output_len: int
    max_concurrency: int | None
    request_rate: str = "inf"
    num_warmups: int = 2
    test_request: bool = True  # vLLM's client first sends one request of the workload's size, untimed
    endpoint: str = "/v1/completions"  # or "/v1/chat/completions" (the server applies the chat template)


def vllm_client_cmd(w: Workload, model_dir: Path, port: int, result: Path) -> list[str]:
    backend = "openai-chat" if w.endpoint.endswith("/chat/completions") else "openai"
    # --skip-chat-template on both endpoints: the jsonl holds the raw text; on chat the server templates it
    cmd = [str(VENV / "bin" / "vllm"), "bench", "serve", "--backend", backend, "--base-url",
           f"http://127.0.0.1:{port}", "--endpoint", w.endpoint, "--model", SERVED_NAME, "--tokenizer",
           str(model_dir), "--dataset-name", "custom", "--dataset-path", str(w.dataset), "--custom-output-len",
           str(w.output_len), "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(w.num_prompts),
           "--request-rate", w.request_rate, "--ignore-eos", "--temperature", "0", "--num-warmups",
           str(w.num_warmups), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name,
           "--disable-tqdm"]
    if w.max_concurrency:
        cmd += ["--max-concurrency", str(w.max_concurrency)]
    if not w.test_request:
        cmd += ["--ready-check-timeout-sec", "0"]
    return cmd


def kvllm_client_cmd(w: Workload, model_dir: Path, port: int, result: Path) -> list[str]:
    cmd = [sys.executable, "-m", "server.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", w.endpoint, "--model", SERVED_NAME, "--tokenizer", str(model_dir), "--dataset",
           f"text:{w.dataset}", "--output-len", str(w.output_len), "--num-prompts", str(w.num_prompts),
           "--request-rate", w.request_rate, "--ignore-eos", "--temperature", "0", "--num-warmups",
           str(w.num_warmups), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", str(result), "--disable-tqdm"]
    if w.max_concurrency:
        cmd += ["--max-concurrency", str(w.max_concurrency)]
    return cmd


class CpuSampler:
    """Samples a server's per-thread CPU seconds every `period` s in a thread, so the CPU of the client's measured
    window alone can be read afterwards (the client's start-up, test request and warm-ups fall outside it)."""

    def __init__(self, server: Server, period: float = 0.5) -> None:
        self.server, self.period = server, period
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append((time.time(), self.server.cpu_seconds()))
            if self._stop.wait(self.period):
                self.samples.append((time.time(), self.server.cpu_seconds()))
                return

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, t: float) -> dict[str, float]:
        """Per-thread CPU seconds at time t, linear between the two samples around it."""
        before = max((s for s in self.samples if s[0] <= t), key=lambda s: s[0], default=self.samples[0])
        after = min((s for s in self.samples if s[0] >= t), key=lambda s: s[0], default=self.samples[-1])
        if after[0] == before[0]:
            return dict(before[1])
        f = (t - before[0]) / (after[0] - before[0])
        return {k: before[1].get(k, 0.0) + f * (v - before[1].get(k, 0.0)) for k, v in after[1].items()}


def run_client(client: str, server: Server, w: Workload, model_dir: Path, result: Path, log: Path) -> dict:
    """Run one client against a started server; returns its result JSON plus the server's counters and CPU time
    over the client's measured window (its `duration`, ending when the result file was written)."""
    make = vllm_client_cmd if client == "vllm" else kvllm_client_cmd
    cmd = make(w, model_dir, server.port, result)
    env = vllm_env(1) if client == "vllm" else {**os.environ, "TQDM_DISABLE": "1"}
    before = server.counters()
    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    with open(log, "w") as f, CpuSampler(server) as cpu:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not result.is_file():
        raise RuntimeError(f"{client} bench serve against {server.name} failed ({proc.returncode}); see {log}")
    out = json.loads(result.read_text())
    end = result.stat().st_mtime
    out["_server_cpu_threads"] = cpu_delta(cpu.at(end - out["duration"]), cpu.at(end))
    out["_server_cpu"] = cpu_summary(out["_server_cpu_threads"])
    out["_server_cpu_s"] = out["_server_cpu"]["total"]
    after = server.counters()
    out["_counters"] = {k: after[k] - before.get(k, 0.0) for k in after}
    out["_command"] = " ".join(cmd)
    return out


def display(cmd: list[str]) -> str:
    """A command line for the docs: repository-relative paths, the venv's tools by their own names."""
    text = " ".join(cmd)
    for old, new in ((str(VENV / "bin") + "/", ""), (sys.executable, "python"), (str(ROOT) + "/", "")):
        text = text.replace(old, new)
    return text
