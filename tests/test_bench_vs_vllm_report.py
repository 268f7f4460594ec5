"""bench/vs_vllm.py's tables without servers: a KV dtype vLLM's CPU build refuses on this CPU becomes a row that
says why, kvllm's 8-bit rows still against vLLM at its default, and the run goes on."""
from __future__ import annotations

from bench.vs_vllm import refusal
from bench.vs_vllm_report import memory_table, offline_table, startup_table

REASON = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX."


def _workload(name: str, tok_s: float) -> dict:
    return {"name": name, "tok_s": tok_s, "first_ids": [[1, 2]]}


def _offline(engine: str, kv: str, kv_dtype: str, rates: tuple[float, float]) -> dict:
    return {"engine": engine, "threads": 2, "kv": kv, "kv_cache_dtype": kv_dtype, "startup_s": 20.0,
            "workloads": [_workload("64 x 256/256", rates[0]), _workload("32 x 128/128", rates[1])]}


def test_refusal_reads_vllms_reason_from_its_log(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("INFO starting\n(EngineCore pid=1) ERROR 12-07 [core.py:1510] RuntimeError: Worker failed with "
                   f"error '{REASON}', please check the stack trace above for the root cause\n")
    assert refusal(log) == REASON
    log.write_text("RuntimeError: Engine core initialization failed. See root cause above.\n")
    assert refusal(log) is None  # not about the KV dtype: the run fails as before


def test_refused_rows_say_why_and_keep_the_ratio_to_vllms_default():
    results = [_offline("kvllm", "default", "auto", (200.0, 240.0)), _offline("vllm", "default", "auto", (40.0, 40.0)),
               _offline("kvllm", "8-bit", "int8", (250.0, 280.0)),
               {"engine": "vllm", "threads": 2, "kv": "8-bit", "kv_cache_dtype": "fp8_e5m2", "refused": REASON}]
    rows = [line for line in offline_table(results).splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 4
    refused = [r for r in rows if "refused" in r]
    assert len(refused) == 2 and all(f"refused: {REASON}" in r and "int8 / fp8_e5m2" in r for r in refused)
    assert "| 6.25x |" in refused[0] and "| 7.00x |" in refused[1]  # 250 / 40, 280 / 40
    assert all(len(r.split("|")) == len(rows[0].split("|")) for r in rows)
    assert "vllm" in startup_table({"offline": results}) and startup_table({"offline": results}).count("| vllm |") == 1


def test_refused_memory_row_keeps_the_table_shape():
    done = {"completed": 8, "failed": 0, "output_throughput": 50.0, "median_ttft_ms": 1000.0, "p99_ttft_ms": 2000.0,
            "median_tpot_ms": 40.0, "p99_tpot_ms": 60.0, "_counters": {}}
    rows = [{"threads": 2, "server": "vllm", "result": done, "pool_tokens": 3136, "startup_s": 60.0},
            {"threads": 2, "server": "vllm+fp8_e5m2", "refused": REASON, "pool_tokens": 6272},
            {"threads": 2, "server": "kvllm+kara+int8", "result": {**done, "output_throughput": 250.0},
             "pool_tokens": 5200, "startup_s": 20.0}]
    lines = memory_table(rows).splitlines()
    assert all(len(line.split("|")) == len(lines[0].split("|")) for line in lines)
    assert f"refused: {REASON}" in lines[3]
    assert "5.00x meets 4x" in lines[4]  # against vLLM at its default KV dtype, as before


def test_main_keeps_the_report_section_reachable():
    """main() writes its section with vs_vllm_report.section: a local import of another `section` (the matrix
    report's) made that name local to main, and the run died at its very end with UnboundLocalError."""
    from bench import vs_vllm

    assert "section" not in vs_vllm.main.__code__.co_varnames
