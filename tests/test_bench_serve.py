"""`kvllm bench serve` (run_benchmark in-process) against the live server with the tiny model."""
from __future__ import annotations

import json
import math

import httpx
import pytest

from bench.serve_client import RequestResult, arrival_times, calculate_metrics, run_benchmark, sample_random
from server_fixtures import *  # noqa: F401,F403
from server_fixtures import serve, wait_drained

INPUT_LEN = 24
OUTPUT_LEN = 8


def test_bench_200_requests_concurrency_32(tiny_server, tiny_engine, tiny_server_model_dir, tmp_path, capsys):
    result = run_benchmark({
        "base_url": tiny_server.base_url, "model": tiny_engine.model_name, "tokenizer": str(tiny_server_model_dir),
        "num_prompts": 200, "max_concurrency": 32, "request_rate": float("inf"), "dataset": "random",
        "input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "ignore_eos": True, "disable_tqdm": True,
        "save_result": str(tmp_path / "result.json"), "plot": str(tmp_path / "result.png"), "seed": 0,
    })
    out = capsys.readouterr().out
    assert result["completed"] == 200 and result["failed"] == 0, result["failure_reasons"]
    assert result["failure_reasons"] == {}
    # every request's usage is right: exact output length, prompt tokens as the server's tokenizer counts them
    assert result["output_lens"] == [OUTPUT_LEN] * 200
    assert result["finish_reasons"] == ["length"] * 200
    expected_prompt = [len(tiny_engine.encode_prompt(p)) for p in result["prompts"]]
    assert result["usage_prompt_tokens"] == expected_prompt
    assert result["input_lens"] == expected_prompt  # the random dataset hits its target lengths exactly
    assert all(n == INPUT_LEN for n in expected_prompt)
    assert result["total_input_tokens"] == sum(expected_prompt)
    assert result["total_output_tokens"] == 200 * OUTPUT_LEN
    assert all(len(itl) == OUTPUT_LEN - 1 for itl in result["itls"])
    assert 1 <= result["max_concurrent_requests"] <= 32
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
                "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms"):
        assert result[key] > 0 and math.isfinite(result[key]), key
    assert result["p99_e2el_ms"] >= result["median_e2el_ms"] >= result["median_ttft_ms"]
    # the vLLM-style table
    assert "============ Serving Benchmark Result ============" in out
    for row in ("Successful requests:", "Failed requests:", "Benchmark duration (s):", "Total input tokens:",
                "Total generated tokens:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                "Total token throughput (tok/s):", "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
                "Mean TPOT (ms):", "P99 ITL (ms):", "Mean E2EL (ms):", "P99 E2EL (ms):"):
        assert row in out, row
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["completed"] == 200 and saved["model_id"] == tiny_engine.model_name
    assert "ttfts" not in saved  # per-request arrays only with --save-detailed, as in vLLM
    assert (tmp_path / "result.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    wait_drained(tiny_engine)


def test_bench_poisson_chat_and_extra_body(tiny_server, tiny_engine, tiny_server_model_dir, tmp_path):
    """Finite Poisson rate on the chat endpoint, per-request KV compression through --extra-body."""
    result = run_benchmark([
        "--base-url", tiny_server.base_url, "--endpoint", "/v1/chat/completions",
        "--tokenizer", str(tiny_server_model_dir), "--num-prompts", "16", "--request-rate", "40",
        "--input-len", "16", "--output-len", "6", "--ignore-eos", "--disable-tqdm",
        "--extra-body", '{"kv_compression": "none"}', "--save-result", str(tmp_path / "r.json"),
        "--save-detailed",
    ])
    assert result["completed"] == 16 and result["failed"] == 0, result["failure_reasons"]
    assert result["backend"] == "openai-chat" and result["model_id"] == tiny_engine.model_name
    assert result["output_lens"] == [6] * 16
    assert result["duration"] >= 16 / 40 * 0.9  # the last arrival is at num_prompts / rate
    saved = json.loads((tmp_path / "r.json").read_text())
    assert len(saved["ttfts"]) == 16 and saved["request_rate"] == 40.0
    wait_drained(tiny_engine)


def test_bench_queue_limit_gives_503_failures(tiny_engine, tiny_server_model_dir):
    """With a small --max-queued-requests, the burst is partly rejected with 503s, counted as failures with
    their reason; nothing crashes or hangs and no block leaks."""
    with serve(tiny_engine, max_queued_requests=2) as srv:
        result = run_benchmark({
            "base_url": srv.base_url, "tokenizer": str(tiny_server_model_dir), "num_prompts": 64,
            "max_concurrency": 32, "input_len": 16, "output_len": 4, "ignore_eos": True, "disable_tqdm": True,
            "request_timeout": 60.0,
        })
        assert result["completed"] + result["failed"] == 64
        assert result["failed"] > 0 and result["completed"] > 0
        reasons = result["failure_reasons"]
        assert sum(reasons.values()) == result["failed"]
        assert all(r.startswith("HTTP 503: The server is overloaded") for r in reasons), reasons
        ok = [i for i, e in enumerate(result["errors"]) if not e]
        assert all(result["output_lens"][i] == 4 for i in ok)
        metrics = httpx.get(srv.base_url + "/metrics").text
        assert f'kvllm:admission_rejections_total{{model_name="{tiny_engine.model_name}"}} ' \
               f'{float(result["failed"])}' in metrics
        assert httpx.get(srv.base_url + "/health").status_code == 200
        assert srv.pending == 0
    wait_drained(tiny_engine)


def test_bench_unreachable_server_counts_failures():
    # a port nothing listens on: every request fails with a connection error, nothing raises or hangs
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run_benchmark({"base_url": f"http://127.0.0.1:{port}", "model": "m", "tokenizer": "none",
                            "num_prompts": 3, "input_len": 8, "output_len": 2, "disable_tqdm": True,
                            "ready_check_timeout": 0})
    assert result["completed"] == 0 and result["failed"] == 3
    assert all("ConnectError" in r for r in result["failure_reasons"])


def test_arrivals_and_metrics_helpers():
    assert arrival_times(5, float("inf"), 1.0, 0) == [0.0] * 5
    t = arrival_times(200, 10.0, 1.0, 0)
    assert t == sorted(t) and t[-1] == pytest.approx(20.0)
    gaps = [b - a for a, b in zip([0.0] + t, t)]
    cv = float(__import__("numpy").std(gaps) / __import__("numpy").mean(gaps))
    assert 0.7 < cv < 1.3  # exponential gaps (Poisson arrivals) have a coefficient of variation of 1
    assert arrival_times(50, 5.0, 1.0, 1) != arrival_times(50, 5.0, 1.0, 2)
    r1 = RequestResult(success=True, ttft=0.1, itl=[0.02, 0.03], latency=0.15, start_time=0.0,
                       chunk_times=[0.1, 0.12, 0.15], output_tokens=3, usage_prompt_tokens=10)
    r2 = RequestResult(success=False, error="HTTP 503: full")
    m = calculate_metrics([r1, r2], 1.0, None, [99.0])
    assert m["completed"] == 1 and m["failed"] == 1 and m["failure_reasons"] == {"HTTP 503: full": 1}
    assert m["total_output_tokens"] == 3 and m["total_input_tokens"] == 10
    assert m["mean_tpot_ms"] == pytest.approx(25.0) and m["mean_ttft_ms"] == pytest.approx(100.0)
    assert m["mean_itl_ms"] == pytest.approx(25.0)


def test_random_dataset_without_tokenizer_is_deterministic():
    a = sample_random(None, 4, 32, 8, seed=3)
    b = sample_random(None, 4, 32, 8, seed=3)
    assert [x.prompt for x in a] == [x.prompt for x in b]
    assert all(x.prompt_len == 32 and x.expected_output_len == 8 for x in a)
