"""bench/vs_vllm_matrix.py without servers: the cells cover every factor level, `--cells` selects what it names,
the launch lines are the bare ones at the defaults and equal at the explicit settings, the memory pools hold the
same number of sequences, and the headline marks each cell against its target."""
from __future__ import annotations

import math
from argparse import Namespace
from pathlib import Path

import pytest

from bench import vs_vllm_matrix
from bench.vs_vllm_cells import CELLS, CONFIGS, ENDPOINTS, MEMORY, REPRO, SHAPES, cell_named, plan, select, sizes
from bench.vs_vllm_matrix_report import floor_rows, headline_rows, render


def test_cells_cover_every_level_and_the_issue_reproduction():
    names = [c.name for c in CELLS]
    assert len(set(names)) == len(names)
    assert {c.endpoint for c in CELLS} == set(ENDPOINTS)
    assert {c.shape for c in CELLS} == set(SHAPES)
    assert {c.rate for c in CELLS} == {"inf", "2", "6"}
    assert {c.concurrency for c in CELLS} == {1, 8, 32, 64}
    repro = cell_named(REPRO)
    assert (repro.endpoint, repro.input_len, repro.output_len, repro.rate, repro.concurrency, repro.num_prompts) == \
        ("chat", 256, 256, "6", 32, 48)
    # a Poisson cell's arrivals ask for more output tok/s than a server makes, so its tok/s measures the server
    assert all(float(c.rate) * c.output_len >= 500 for c in CELLS if c.rate != "inf")
    assert all(c.num_prompts >= c.concurrency for c in CELLS)  # each cell reaches its concurrency


def test_select_by_bare_name_config_glob_and_memory():
    pairs = plan()
    assert len(pairs) == len(CONFIGS) * len(CELLS) + 1
    assert select(pairs, None) == pairs
    assert select(pairs, REPRO) == [("defaults", REPRO), ("explicit", REPRO)]
    assert select(pairs, f"defaults/{REPRO},memory/*") == [("defaults", REPRO), ("memory", MEMORY.name)]
    assert {c for c, _ in select(pairs, "explicit/*")} == {"explicit"}
    assert all(n.startswith("chat-") and n.endswith("-c1") for _, n in select(pairs, "chat-*-c1"))
    with pytest.raises(ValueError, match="nope"):
        select(pairs, f"{REPRO},nope")


def test_quick_sizes_shrink():
    n, i, o = sizes(cell_named("chat-reason-inf-c1"), quick=True)
    assert (n, i, o) == (2, 16, 64)
    assert sizes(cell_named(REPRO), quick=False) == (48, 256, 256)


def _args() -> Namespace:
    return Namespace(model_dir=Path("build/smollm2-hf"), kvllm_model="smollm2", port=8791, quick=False,
                     engine_order=["kvllm", "vllm"])


def _after_model(cmd: list[str]) -> list[str]:
    return cmd[cmd.index("serve") + 2:]


def test_launch_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(vs_vllm_matrix, "available_cores", lambda: 2)
    args = _args()
    bare = ["--host", "127.0.0.1", "--port", "8791", "--served-model-name", "smollm2"]
    v = vs_vllm_matrix.server_for("vllm", "defaults", args, tmp_path / "v.log")
    k = vs_vllm_matrix.server_for("kvllm", "defaults", args, tmp_path / "k.log")
    assert _after_model(v.cmd) == bare and _after_model(k.cmd) == bare
    assert v.env["VLLM_CPU_KVCACHE_SPACE"] == k.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert v.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    monkeypatch.setattr(vs_vllm_matrix, "available_cores", lambda: 8)  # kvllm would take 8 threads: told 2
    k8 = vs_vllm_matrix.server_for("kvllm", "defaults", args, tmp_path / "k.log")
    assert _after_model(k8.cmd) == bare + ["--threads", "2"]
    v = vs_vllm_matrix.server_for("vllm", "explicit", args, tmp_path / "v.log")
    k = vs_vllm_matrix.server_for("kvllm", "explicit", args, tmp_path / "k.log")
    assert _after_model(v.cmd) == bare + vs_vllm_matrix.EXPLICIT
    assert _after_model(k.cmd) == bare + ["--threads", "2"] + vs_vllm_matrix.EXPLICIT + ["--kv-cache-memory", "2GiB"]


class _WordTokenizer:
    """Whitespace 'tokens': enough for the prompt cutting and pool arithmetic."""

    def __call__(self, text):
        return Namespace(input_ids=text.split())

    def decode(self, ids):
        return " ".join(ids)

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "system prompt of six words here " + messages[0]["content"] + " assistant"


def test_memory_pools_hold_the_same_sequences(tmp_path):
    w, flags, pools = vs_vllm_matrix.memory_flags(_args(), _WordTokenizer(), tmp_path)
    assert (w.num_prompts, w.output_len, w.max_concurrency, w.endpoint) == (12, 1024, None, ENDPOINTS["chat"])
    seq = 6 + MEMORY.input_len + 1 + MEMORY.output_len + 1
    assert flags["vllm"][flags["vllm"].index("--num-gpu-blocks-override") + 1] == str(3 * math.ceil(seq / 128) + 1)
    assert flags["kvllm"][flags["kvllm"].index("--num-kv-blocks") + 1] == str(3 * math.ceil(seq / 16))
    assert flags["kvllm+kara"] == flags["kvllm"] + ["--kv-compression", "kara"]
    assert pools["vllm"] >= 3 * seq and pools["kvllm"] >= 3 * seq
    length = lambda f: f[f.index("--max-model-len") + 1]  # noqa: E731
    assert length(flags["vllm"]) == length(flags["kvllm"]) == str(seq + 32)


def _result(tok_s: float, tpot_ms: float = 50.0) -> dict:
    return {"output_throughput": tok_s, "completed": 4, "failed": 0, "total_input_tokens": 1024,
            "total_output_tokens": 1024, "duration": 10.0, "median_tpot_ms": tpot_ms, "p99_tpot_ms": tpot_ms,
            "median_ttft_ms": 100.0, "p99_ttft_ms": 200.0, "median_itl_ms": tpot_ms, "p99_itl_ms": tpot_ms,
            "_counters": {"num_preemptions": 0.0}, "_server_cpu": {"total": 15.0}}


def test_headline_marks_each_cell_against_its_target():
    rows = [{"config": "defaults", "cell": "cmpl-short-inf-c1", "server": "kvllm", "result": _result(100.0)},
            {"config": "defaults", "cell": "cmpl-short-inf-c1", "server": "vllm", "result": _result(100.0)},
            {"config": "defaults", "cell": REPRO, "server": "kvllm", "result": _result(140.0, 35.0)},
            {"config": "defaults", "cell": REPRO, "server": "vllm", "result": _result(100.0)},
            {"config": "explicit", "cell": REPRO, "server": "kvllm", "result": _result(150.0)},
            {"config": "memory", "cell": MEMORY.name, "server": "kvllm", "result": _result(150.0), "pool_tokens": 1},
            {"config": "memory", "cell": MEMORY.name, "server": "kvllm+kara", "result": _result(210.0),
             "pool_tokens": 1},
            {"config": "memory", "cell": MEMORY.name, "server": "vllm", "result": _result(100.0), "pool_tokens": 1}]
    data = {"rows": rows, "launches": [], "errors": [], "versions": "vllm 0.32.0", "threads": 2, "seconds": 1.0,
            "floor": {"batch": 32, "slots": 400, "dtype": "bfloat16", "step_s": 0.032, "gemm_s": 0.02, "kv_s": 0.01,
                      "rates": {"gflops": 300.0, "read_gbs": 20.0}}}
    head = {(r[0], r[1]): r for r in headline_rows(data)}
    assert head[("cmpl-short-inf-c1", "defaults")][4:] == ["1.00x", ">= 1x", "meets"]
    assert head[(REPRO, "defaults")][4:] == ["1.40x", ">= 1.5x", "misses"]
    assert head[(REPRO, "explicit")][-1] == "not run"
    assert head[(f"{MEMORY.name} (kvllm+kara)", "memory")][4:] == ["2.10x", ">= 2x", "meets"]
    assert head[(f"{MEMORY.name} (kvllm)", "memory")][4:] == ["1.50x", "-", "-"]
    (floor,) = [r for r in floor_rows(data) if "defaults" in r[0]]
    assert floor[5:] == ["1.07x", "1.17x", "<= 1.2x", "meets", "-", "-", "-", "-", "-"]
    # with the prefills TPOT carries: 32 prompts over 17 - 1 output tokens, 5 ms each (floor 2.5 ms):
    # step 32 + 2 x 5 = 42 ms, floor 30 + 2 x 2.5 = 35 ms; TPOT 35 ms over each; the least TPOT the work
    # allows, 35 ms, over the step's floor of 30 ms
    data["floor"].update(prompt=286, output=17, prefill_s=0.005, prefill_floor_s=0.0025)
    (floor,) = [r for r in floor_rows(data) if "defaults" in r[0]]
    assert floor[9:] == ["286: 5 (2)", "42.0 (35.0)", "0.83x", "1.00x", "1.17x"]
    text = render(data)
    assert text.index("**Headline**") < text.index("**defaults**") < text.index("**memory**")
    # a floor measured for one configuration (its dtype) is held against that configuration's TPOT only
    assert [r[0] for r in floor_rows(data)] == [f"{REPRO} (defaults)", f"{REPRO} (explicit)"]  # older runs: both
    data["floor"]["config"] = "explicit"
    assert [r[0] for r in floor_rows(data)] == [f"{REPRO} (explicit)"]


def test_the_floor_is_measured_for_the_defaults_run_else_the_explicit_one(monkeypatch):
    """run_floor measures the step at the batch of the defaults' REPRO run, at dtype auto; a run of the explicit
    cells alone gets its floor at the explicit dtype, and names that configuration."""
    from bench import step_floor, vs_vllm_matrix

    calls = []

    def fake_child(threads, steps, dtype, workloads, offline, prefills):
        calls.append((dtype, workloads[0][1:]))
        return {"dtype": dtype, "rates": {"gflops": 100.0, "read_gbs": 10.0}, "model": {},
                "rows": [{"step": 0.05, "flops": 1e9, "weight_bytes": 1, "kv_bytes": 1e7}], "prefills": [{"wall": 0.3}]}

    monkeypatch.setattr(step_floor, "run_child", fake_child)
    monkeypatch.setattr(step_floor, "prefill_floor", lambda model, rates, tokens: 0.2)
    args = Namespace(quick=False)
    explicit = {"config": "explicit", "cell": REPRO, "server": "kvllm", "result": _result(150.0)}
    defaults = {"config": "defaults", "cell": REPRO, "server": "kvllm",
                "result": {**_result(140.0), "total_input_tokens": 4 * 300}}
    data = {"rows": [explicit, defaults], "errors": []}
    vs_vllm_matrix.run_floor(args, data)
    assert calls[-1] == ("auto", (4, 300 + 128)) and data["floor"]["config"] == "defaults"
    data = {"rows": [explicit], "errors": []}
    vs_vllm_matrix.run_floor(args, data)
    assert calls[-1][0] == "bfloat16" and data["floor"]["config"] == "explicit"


class _FakeServer:
    name = "kvllm"

    def __init__(self, fail_start: bool = False) -> None:
        self.fail_start, self.events = fail_start, []

    def start(self) -> None:
        self.events.append("start")
        if self.fail_start:
            raise RuntimeError("no port")

    def stop(self) -> None:
        self.events.append("stop")


def test_serve_cells_warms_runs_each_cell_and_always_stops(tmp_path, monkeypatch):
    """The launch loop bench/vs_vllm_matrix.py and bench/row_split.py share: warm-up, then every cell in order; a
    launch that fails to start is recorded with its tag, runs no cell, and the server is stopped either way."""
    calls = []
    monkeypatch.setattr(vs_vllm_matrix, "run_client", lambda client, server, w, model_dir, res, log: calls.append(
        res.name))
    monkeypatch.setattr(vs_vllm_matrix, "write_prompts", lambda tok, path, n, length, seed: path)
    ran, errors = [], []
    ok = _FakeServer()
    vs_vllm_matrix.serve_cells(ok, "defaults_kvllm", ["a", "b"], _args(), None, tmp_path, errors,
                               ran.append, started=lambda: ok.events.append("started"))
    assert ok.events == ["start", "started", "stop"] and ran == ["a", "b"] and errors == []
    assert calls == ["warmup_defaults_kvllm.json"]
    bad = _FakeServer(fail_start=True)
    vs_vllm_matrix.serve_cells(bad, "explicit_vllm", ["a"], _args(), None, tmp_path, errors, ran.append)
    assert bad.events == ["start", "stop"] and ran == ["a", "b"] and errors == ["explicit_vllm: no port"]


def test_panel_prefetch_table_names_both_sides_and_the_ratio():
    from bench.panel_prefetch import render

    data = {"cpu": "CPU X", "threads": 2, "rounds": 3, "layers": 121,
            "gemm": [{"rows": 32, "on": 0.020, "off": 0.025, "gflops": 300.0}],
            "decode": [{"batch": 32, "slots": 384, "on": 0.040, "off": 0.044}]}
    text = render(data)
    assert "| 32 | 20.00 | 25.00 | 1.25x | 300 |" in text
    assert "| 32 x 384 | 40.00 | 44.00 | 1.10x |" in text and "CPU X, 2 threads" in text


def test_row_split_table_has_a_ratio_per_setting():
    from bench.row_split import SETTINGS, render

    rows = [{"setting": s, "cell": "c", "tok_s": tok, "tpot_ms": 10.0, "ttft_ms": 100.0, "failed": 0}
            for s, tok in zip(SETTINGS, (200.0, 150.0, 100.0, 50.0))]
    text = render({"cpu": "CPU X", "versions": "v", "rows": rows, "errors": []}, ["c"])
    assert "| c | 200.0 (10.0 / 100) | 150.0 (10.0 / 100) | 100.0 (10.0 / 100) | 50.0 (10.0 / 100) | 0.75x | 0.50x " \
           "| 0.25x |" in text
    assert "bfloat16, oneDNN / split 0.50x" in text and "CPU X" in text


def test_each_kind_of_host_keeps_its_own_section(monkeypatch):
    """A run at the default dtypes on a CPU without AVX512-BF16 (kvllm float32, vLLM bfloat16) writes its own
    section beside the bfloat16 hosts' one, never over it; explicit dtypes keep one section each, but for float32,
    whose run on a CPU without AVX-512 (both servers on 8-wide FMAs) also sits beside the AVX-512 hosts' one."""
    import bench.common as common
    from bench import vs_vllm_matrix_report as matrix, vs_vllm_report as report

    monkeypatch.setattr(common, "bf16_features", lambda: "avx512_bf16")
    assert matrix.section() == matrix.SECTION
    assert report.section("auto") == f"{report.SECTION}, auto"
    monkeypatch.setattr(common, "bf16_features", lambda: common.NO_BF16)
    assert matrix.section() == f"{matrix.SECTION}, on a CPU without AVX512-BF16"
    # the explicit cells alone do not replace the defaults' table; a run with any other cell is the matrix's
    assert matrix.section(["explicit/cmpl-short-inf-c1", f"explicit/{REPRO}"]) == \
        f"{matrix.SECTION} at equal explicit settings, on a CPU without AVX512-BF16"
    assert matrix.section(["explicit/cmpl-short-inf-c1", f"defaults/{REPRO}"]) == matrix.section()
    assert report.section("auto") == f"{report.SECTION}, auto, on a CPU without AVX512-BF16"
    assert report.section("bfloat16") == f"{report.SECTION}, bfloat16"
    # float32 on both: the AVX-512 hosts' section, and one of its own for a CPU with AVX2 only
    monkeypatch.setattr(common, "cpu_flags", lambda: ["avx2", "fma", "avx512f"])
    assert report.section("float32") == report.SECTION
    monkeypatch.setattr(common, "cpu_flags", lambda: ["avx2", "fma"])
    assert report.section("float32") == f"{report.SECTION}, on a CPU without AVX-512"
    monkeypatch.setattr(common, "cpu_flags", lambda: None)  # flags unreadable: the original section
    assert report.section("float32") == report.SECTION
