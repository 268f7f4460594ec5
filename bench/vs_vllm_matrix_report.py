"""The docs/benchmarks.md section of the serving matrix (bench/vs_vllm_matrix.py): a headline line per cell with its
target and verdict, then each configuration's cells in detail, the memory-limited cell, kvllm's decode step against
its floor, the startups and the commands."""
from __future__ import annotations

from bench.common import bf16_features, commit, cpu_name, host_suffix
from bench.vs_vllm_cells import CONFIGS, MEMORY, MEMORY_CONFIG, REPRO, cell_named

SECTION = "kvllm vs vLLM's CPU build: the serving matrix (vLLM's client)"
# issue 48: output tok/s kvllm / vLLM at both servers' defaults (>= 1.0x at concurrency 1, 1.5x above), on the
# memory-limited pool with Kara; kvllm's TPOT over its decode-step floor in the chat cell at concurrency 32
TARGET_ONE, TARGET_BATCHED, TARGET_MEMORY, TARGET_FLOOR = 1.0, 1.5, 2.0, 1.2


def speed_target(concurrency: int) -> float:
    return TARGET_ONE if concurrency == 1 else TARGET_BATCHED


def verdict(value: float, target: float, at_most: bool = False) -> str:
    return "meets" if (value <= target if at_most else value >= target) else "misses"


def results(data: dict) -> dict[tuple[str, str, str], dict]:
    """(config, cell, server) -> the client's result, for the runs that completed."""
    return {(r["config"], r["cell"], r["server"]): r["result"] for r in data["rows"] if "result" in r}


def headline_rows(data: dict) -> list[list[str]]:
    """[cell, config, kvllm tok/s, vLLM tok/s, ratio, target, verdict] for every cell both servers ran, in run
    order; the memory cell once per kvllm variant (Kara's row carries the target)."""
    res, rows, seen = results(data), [], set()
    for r in data["rows"]:
        key = (r["config"], r["cell"])
        if key in seen:
            continue
        seen.add(key)
        variants = ["kvllm", "kvllm+kara", "kvllm+kara-w64"] if r["config"] == MEMORY_CONFIG else ["kvllm"]
        for name in variants:
            k, v = res.get((*key, name)), res.get((*key, "vllm"))
            if r["config"] == MEMORY_CONFIG:
                target = TARGET_MEMORY if name == "kvllm+kara" else None
            else:
                target = speed_target(cell_named(r["cell"]).concurrency)
            label = f"{r['cell']} ({name})" if r["config"] == MEMORY_CONFIG else r["cell"]
            if not (k and v):
                rows.append([label, r["config"], _tok(k), _tok(v), "-", _x(target), "not run"])
                continue
            ratio = k["output_throughput"] / v["output_throughput"]
            rows.append([label, r["config"], _tok(k), _tok(v), f"{ratio:.2f}x", _x(target),
                         verdict(ratio, target) if target else "-"])
    return rows


def _tok(r: dict | None) -> str:
    return "-" if r is None else f"{r['output_throughput']:.1f}"


def _x(target: float | None) -> str:
    return "-" if target is None else f">= {target:g}x"


def _table(header: list[str], rows: list[list[str]], align: str) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _pair(r: dict, metric: str, scale: float = 1.0) -> str:
    """'median / p99' of a metric in ms (scale 1e-3: s)."""
    a, b = r.get(f"median_{metric}_ms"), r.get(f"p99_{metric}_ms")
    fmt = (lambda v: f"{v * scale:.1f}") if scale != 1.0 else (lambda v: f"{v:.0f}")  # noqa: E731
    return "-" if a is None else f"{fmt(a)} / {fmt(b)}"


def _per_cpu(r: dict) -> str:
    cpu = r.get("_server_cpu", {}).get("total")
    return f"{r['total_output_tokens'] / cpu:.1f} ({cpu / r['duration']:.2f})" if cpu else "-"


def detail_table(data: dict, config: str) -> str:
    res = results(data)
    rows = []
    for row in (r for r in data["rows"] if r["config"] == config):
        cell = cell_named(row["cell"])
        r = row.get("result")
        if r is None:
            rows.append([row["cell"], row["server"], "failed: see the run's log"] + ["-"] * 10)
            continue
        n = max(r["completed"], 1)
        bound = "-" if cell.rate == "inf" else f"{float(cell.rate) * r['total_output_tokens'] / n:.0f}"
        other = res.get((config, row["cell"], "vllm"))
        ratio = f"{r['output_throughput'] / other['output_throughput']:.2f}x" if row["server"] == "kvllm" and other \
            else ""
        rows.append([row["cell"], row["server"], f"{r['completed']} x {r['total_input_tokens'] / n:.0f}/"
                     f"{r['total_output_tokens'] / n:.0f}", "all at once" if cell.rate == "inf" else
                     f"Poisson {cell.rate}/s", str(cell.concurrency), bound, f"{r['completed']} / {r['failed']}",
                     f"{r['output_throughput']:.1f}", ratio, _pair(r, "ttft"), _pair(r, "tpot"), _pair(r, "itl"),
                     _per_cpu(r)])
    return _table(["cell", "server", "requests x prompt/output tokens", "arrivals", "max concurrency",
                   "arrival bound tok/s", "ok / failed", "output tok/s", "kvllm / vLLM", "TTFT ms median / p99",
                   "TPOT ms median / p99", "ITL ms median / p99", "server tok per CPU-s (cores)"],
                  rows, ["---", "---", "---", "---", "--:", "--:", "---", "--:", "--:", "--:", "--:", "--:", "--:"])


def memory_table(data: dict) -> str:
    res = results(data)
    base = res.get((MEMORY_CONFIG, MEMORY.name, "vllm"))
    rows = []
    for row in (r for r in data["rows"] if r["config"] == MEMORY_CONFIG):
        r = row.get("result")
        if r is None:
            rows.append([row["server"], str(row["pool_tokens"]), "failed: see the run's log"] + ["-"] * 8)
            continue
        c = r["_counters"]
        count = lambda k: f"{c[k]:.0f}" if k in c else "-"  # noqa: E731
        ratio = f"{r['output_throughput'] / base['output_throughput']:.2f}x" if base and row["server"] != "vllm" \
            else ""
        rows.append([row["server"], str(row["pool_tokens"]), f"{r['completed']} / {r['failed']}",
                     f"{r['output_throughput']:.1f}", ratio, _pair(r, "ttft", 1e-3), _pair(r, "tpot"),
                     count("num_preemptions"), count("swapped_out_blocks"), count("compression_rounds"), _per_cpu(r)])
    return _table(["server", "KV pool (tokens)", "ok / failed", "output tok/s", "vs vLLM", "TTFT s median / p99",
                   "TPOT ms median / p99", "preemptions", "swapped blocks", "compression rounds",
                   "server tok per CPU-s (cores)"], rows, ["---", "--:", "---", "--:", "--:", "--:", "--:", "--:",
                                                           "--:", "--:", "--:"])


def floor_rows(data: dict) -> list[list[str]]:
    """kvllm's median TPOT in the REPRO cell of each configuration over the decode step's floor at that batch, and
    over the step plus the prefills a request's TPOT carries (`batch` other prompts over its output tokens), measured
    and at their floors."""
    f = data.get("floor")
    if not f:
        return []
    floor = f["gemm_s"] + f["kv_s"]
    share = f["batch"] / (f["output"] - 1) if "prefill_s" in f else None  # prompts prefilled per output token
    out = []
    for config in CONFIGS if "config" not in f else [f["config"]]:  # runs before the floor named its config: all
        r = results(data).get((config, REPRO, "kvllm"))
        if r is None:
            continue
        tpot = r["median_tpot_ms"] / 1e3
        row = [f"{REPRO} ({config})", f"{f['batch']} x {f['slots']}, {f['dtype']}", f"{1e3 * tpot:.1f}",
               f"{1e3 * f['step_s']:.1f}", f"{1e3 * f['gemm_s']:.1f} + {1e3 * f['kv_s']:.1f} = {1e3 * floor:.1f}",
               f"{f['step_s'] / floor:.2f}x", f"{tpot / floor:.2f}x", f"<= {TARGET_FLOOR:g}x",
               verdict(tpot / floor, TARGET_FLOOR, at_most=True)]
        if share is None:
            row += ["-"] * 5
        else:
            with_prefills = f["step_s"] + share * f["prefill_s"]
            floor_with = floor + share * f["prefill_floor_s"]
            row += [f"{f['prompt']}: {1e3 * f['prefill_s']:.0f} ({1e3 * f['prefill_floor_s']:.0f})",
                    f"{1e3 * with_prefills:.1f} ({1e3 * floor_with:.1f})", f"{tpot / with_prefills:.2f}x",
                    f"{tpot / floor_with:.2f}x", f"{floor_with / floor:.2f}x"]
        out.append(row)
    return out


def section(cells: list[str] | tuple[str, ...] = ()) -> str:
    """This host's section: one for CPUs with AVX512-BF16 or AMX, where both servers default to bfloat16, one for
    CPUs without, where kvllm defaults to float32 and vLLM to bfloat16 all the same, so a run on one kind of host
    does not replace the other's table. A run of the explicit cells alone (`cells`: the run's `config/cell` names)
    has a section of its own, so it does not replace the table at the defaults either."""
    explicit_only = bool(cells) and all(c.startswith("explicit/") for c in cells)
    return SECTION + (" at equal explicit settings" if explicit_only else "") + host_suffix()


def render(data: dict) -> str:
    head = _table(["cell", "config", "kvllm output tok/s", "vLLM output tok/s", "kvllm / vLLM", "target", "verdict"],
                  headline_rows(data), ["---", "---", "--:", "--:", "--:", "---", "---"])
    parts = [
        f"kvllm {data.get('kvllm') or commit()} vs {data['versions']}; CPU: {cpu_name()} ({bf16_features()}); "
        "SmolLM2-135M-Instruct, "
        f"{data['threads']} threads. Every cell is one `vllm bench serve` run (vLLM's client) against each server "
        "in turn, real-text prompts cut from the Python language reference (pydoc_data), ignore_eos, temperature 0; "
        "a cell's name is endpoint (cmpl, chat) - shape (short 128/128, mid 256/256, longin 1024/128, reason "
        "128/1024 prompt/output tokens) - arrivals (inf: all at once, pN: Poisson at N req/s) - max concurrency. "
        "Configurations: *defaults* = each server's bare launch line (each picks its own dtype, bfloat16 on an "
        "AVX512-BF16 CPU, batch limits, max_model_len and prefix caching, on in both); *explicit* = both at the "
        "same dtype, batch limits, max_model_len, KV memory, prefix caching off; *memory* = defaults but for a KV "
        "pool of 3 uncompressed sequences. Targets (issue 48): kvllm / vLLM >= 1.0x at concurrency 1 and >= 1.5x "
        "above at the defaults (the explicit rows are held to the same line, for reference), >= 2x for kvllm with "
        "Kara on the memory pool, kvllm's median TPOT <= 1.2x its decode-step floor. One run on a shared 2-core "
        f"machine: absolute numbers are noisy. {data['seconds']:.0f} s.",
        "**Headline** (one line per cell; output tok/s under vLLM's client):\n\n" + head]
    floor = floor_rows(data)
    if floor:
        f = data["floor"]
        parts.append(
            "**TPOT against kvllm's decode-step floor** (bench/step_floor.py, no server running: kvllm's decode "
            "step at the cell's batch, its concurrency x its mean prompt plus half the output, and the step's floors: "
            f"its linear layers at the faster GEMM's 2048-row rate, {f['rates']['gflops']:.0f} GFLOP/s, plus its K/V "
            f"reads at {f['rates']['read_gbs']:.1f} GB/s. TPOT also carries the prefills of the requests that "
            "arrive: with the client holding its concurrency, each request that finishes lets the next one in, so "
            "over one request's output tokens about concurrency other prompts are prefilled on the same cores. The "
            "four columns after the verdict add that share, concurrency / (output tokens - 1) prefills of the cell's "
            "mean prompt per output token, each prefill measured alone on the idle engine (median of three) and, in "
            "brackets, at its floor, its FLOPs at the GEMM rate; 'TPOT / (step + prefills)' near 1 means the server "
            "adds nothing of its own. The last column is the least 'TPOT / floor' the cell's work allows, its step "
            "and its share of prefills both at their floors: where it is above the target, no server running its "
            "prefills on the same cores can meet it):\n\n"
            + _table(["cell", "batch x KV slots", "kvllm median TPOT ms", "decode step ms", "floor: GEMM + K/V ms",
                      "step / floor", "TPOT / floor", "target", "verdict", "prompt tokens: prefill ms (floor)",
                      "step + prefills ms (floor)", "TPOT / (step + prefills)", "TPOT / its floor with prefills",
                      "least TPOT / floor the work allows"],
                     floor, ["---", "---", "--:", "--:", "--:", "--:", "--:", "---", "---", "--:", "--:", "--:",
                             "--:", "--:"]))
    for config in CONFIGS:
        if any(r["config"] == config for r in data["rows"]):
            parts.append(f"**{config}** ('arrival bound': the output tok/s the arrivals allow, rate x output tokens; "
                         "prompt tokens as each server counted them):\n\n" + detail_table(data, config))
    if any(r["config"] == MEMORY_CONFIG for r in data["rows"]):
        parts.append(f"**memory** ({MEMORY.name}: requests of ~{MEMORY.input_len}-token prompts on the chat "
                     f"endpoint, {MEMORY.output_len} new tokens, all sent at once; each server's default KV block, "
                     "vLLM `--num-gpu-blocks-override` (one more block: its null block), kvllm `--num-kv-blocks`; "
                     "kvllm+kara = `--kv-compression kara` at its default settings; kvllm+kara-w64 = the throughput "
                     "benches' tuned Kara, |W| 64, |U| 8, r 0.25, α 8, a round every 56 tokens):\n\n"
                     + memory_table(data))
    parts.append("**Startup** (process start to /health 200; the CPU a started server burns over 5 s with no "
                 "request):\n\n" + _table(["config", "server", "startup s", "CPU cores busy while idle"],
                                          [[x["config"], x["server"], f"{x['startup_s']:.0f}",
                                            f"{x['idle_cores']:.2f}"] for x in data["launches"]],
                                          ["---", "---", "--:", "--:"]))
    lines = [f"{x['config']} {x['server']}: {x['command']}" for x in data["launches"]]
    lines += [f"client, {kind}: {cmd}" for kind, cmd in data.get("client_commands", {}).items()]
    parts.append("Commands (paths relative to the repository; the vLLM tools run from build/vllm-venv/bin; each cell "
                 "changes only the client's dataset, --custom-output-len, --num-prompts, --request-rate and "
                 "--max-concurrency):\n\n```\n" + "\n".join(lines) + "\n```")
    if data.get("errors"):
        parts.append("Errors:\n\n" + "\n".join(f"- {e}" for e in data["errors"]))
    return "\n\n".join(parts)
