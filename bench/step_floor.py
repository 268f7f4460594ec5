"""kvllm's decode step against its two floors, at the decode batches of bench/vs_vllm.py: the step's linear layers at
this CPU's packed-GEMM rate (or, where the batch is small, its weights at the read rate), plus its K/V reads at the
read rate. Per row: the median step, its operator time by term (torch.profiler; the fused decoder call names each
kernel inside it, csrc/decoder_layers.cpp), each term's floor, the host time between operators, and the step over
the sum of the floors. Then the two offline workloads whole: kvllm's run (all prompts at once, as bench/vs_vllm.py
runs them) against the run's floor (its prefill FLOPs at the GEMM rate, then every decode step's floors). This is
the measurement behind the vs_vllm reading's "which term holds a row back".

    python -m bench.step_floor                                # threads 1,2; the three vs_vllm decode batches
    python -m bench.step_floor --threads 1 --steps 8 --no-write

`run_child(threads, steps, dtype=..., workloads=[...], offline=[])` measures other decode batches at another dtype
(bench/vs_vllm_matrix.py: its chat cell at concurrency 32, bfloat16), and `floors(rates, row)` gives their floors.

Rates, measured in the same interpreter right before the rows: the faster of the packed GEMM and torch's (MKL) on
the model's gate/up projection at 2048 rows (the rate a prefill chunk gets), and one long read of a 1 GiB tensor
(torch sum). Each thread count runs in its own interpreter (OpenMP reads its wait policy when torch loads).

The one profiling tool kept in bench/ (the other single-question scripts were retired; their readings are in
docs/results/cpu_kernels.md): it writes its section to docs/results/offline_throughput.md.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

# (name, running sequences, KV slots each): the middle of each vs_vllm decode phase
WORKLOADS = [("offline 64 x 256/256", 64, 384), ("offline 32 x 128/128", 32, 192),
             ("serving 32 x 128/128, 16 at once", 16, 192)]
# (name, sequences, prompt tokens, output tokens): bench/vs_vllm.py's offline workloads, run whole
OFFLINE = [("offline 64 x 256/256", 64, 256, 256), ("offline 32 x 128/128", 32, 128, 128)]
TERMS = ("GEMM", "attention", "argmax", "other ops")


def term_of(op: str) -> str:
    if any(k in op for k in ("packed_linear", "block_linear", "bf16_linear", "quant_panel_linear", "int8_linear",
                             "_linear_pointwise")) or op in (
            "aten::addmm", "aten::mm", "aten::linear"):
        return "GEMM"
    if "paged_attention" in op:
        return "attention"
    if "argmax" in op:
        return "argmax"
    return "other ops"


def rates(model, threads: int, dtype=None) -> dict:
    """GFLOP/s of the packed GEMM and of torch's at 2048 rows, and GB/s of one long read, at `threads` threads.
    At bfloat16 (dtype) the packed GEMM is the model's own bf16 layer (oneDNN, or under a row split its bf16 panels)
    and torch's is F.linear in bfloat16."""
    import torch

    from bench.common import median, timed
    from engine.models.packed import PackedLinear

    torch.set_num_threads(threads)
    dtype = dtype or torch.float32
    lin = next(m for name, m in model.named_modules() if name.endswith("gate_up_proj"))
    if getattr(lin, "many_rows", None) is not None:  # a row split (engine/models/row_split.py): 2048 rows run there
        lin, dtype = lin.many_rows, torch.bfloat16
    out_f, in_f = lin.out_features, lin.in_features
    if dtype == torch.float32 and not isinstance(lin, PackedLinear):  # e.g. GGUF blocks: the same weights as
        dense = torch.nn.Linear(in_f, out_f, bias=False)              # float32 panels
        dense.weight.data = lin.weight.detach().float()
        lin = PackedLinear(dense)
    x = torch.randn(2048, in_f, dtype=dtype)
    x_lin = x.float() if getattr(lin, "w_panels", None) is not None else x  # bf16 panels take float32 rows
    dense_w = torch.randn(out_f, in_f, dtype=dtype)
    with torch.no_grad():
        gemm_s = median(timed(lambda: lin(x_lin), 5))
        mkl_s = median(timed(lambda: torch.nn.functional.linear(x, dense_w), 5))
    big = torch.ones(2 ** 28)
    read_s = median(timed(lambda: big.sum(), 5))
    flops = 2 * 2048 * in_f * out_f
    return {"packed_gflops": flops / gemm_s / 1e9, "mkl_gflops": flops / mkl_s / 1e9,
            "gflops": flops / min(gemm_s, mkl_s) / 1e9, "read_gbs": big.numel() * 4 / read_s / 1e9}


def linear_numel(model, weight_bytes: int = 4, rows: int = 1) -> tuple[int, int]:
    """(weights of every linear layer incl. the LM head, bytes of those weights) as a step of `rows` rows reads them:
    a GGUF block layer (gemm_backend 'gguf') its int8 q and float32 d, m; a layer on quantized panels its panels'
    bytes; a layer whose calls of that many rows go to its bfloat16 copy (a row split) 2 bytes a weight; a packed
    layer of half-precision panels (engine/models/packed.py `widen_linears`) its panels' 2 bytes; any other its
    weights of `weight_bytes` each."""
    copies = {id(m.many_rows) for m in model.modules() if getattr(m, "many_rows", None) is not None}
    total, nbytes = 0, 0
    for m in model.modules():
        if id(m) not in copies and hasattr(m, "in_features") and hasattr(m, "out_features"):
            total += m.in_features * m.out_features
            if getattr(m, "many_rows", None) is not None and rows > m.many_rows_above:
                nbytes += m.in_features * m.out_features * 2
            elif hasattr(m, "q_packed"):
                nbytes += sum(t.numel() * t.element_size() for t in (m.q_packed, m.d, m.m))
            elif hasattr(m, "bits"):  # quantized panels (engine/models/quant_panels.py)
                nbytes += m.w_panels.numel()
            elif getattr(m, "w_packed", None) is not None and m.w_packed.element_size() == 2:  # half panels
                nbytes += m.in_features * m.out_features * m.w_packed.element_size()
            else:
                nbytes += m.in_features * m.out_features * weight_bytes
    return total, nbytes


def child(spec: dict) -> dict:
    from engine.threads import configure_threads

    configure_threads(spec["threads"])
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.common import median, text_prompts, timed
    from engine import Engine, SamplingParams

    workloads = spec.get("workloads", WORKLOADS)
    longest = max([slots for _, _, slots in workloads] + [p + o for _, _, p, o in spec.get("offline", OFFLINE)])
    engine = Engine(model="smollm2", dtype=spec.get("dtype", "float32"), device="cpu", max_num_seqs=64,
                    max_num_batched_tokens=2048, max_model_len=max(1024, longest + 2 * spec["steps"] + 32),
                    kv_cache_memory="2GiB", seed=0, enable_prefix_caching=False,
                    kv_cache_dtype=spec.get("kv_cache_dtype", "auto"))
    cfg = engine.model_config
    split = getattr(engine.core, "row_split", False)  # dtype auto on a .gguf model: engine/models/row_split.py
    widened = getattr(engine.core, "widened", False)  # half weights on packed panels (engine/linear_path.py)
    half = str(getattr(engine.core, "weight_dtype", "")).removeprefix("torch.")
    out = {"dtype": "auto (row split)" if split else f"{half} panels widened in the GEMM" if widened
           else str(engine.dtype).removeprefix("torch."),
           "rates": rates(engine.model, spec["threads"], engine.dtype), "rows": []}
    torch.set_num_threads(spec["threads"])
    elem = torch.empty((), dtype=engine.dtype).element_size()
    weights, weight_bytes = linear_numel(engine.model, elem)
    kv_bytes_per_slot = cfg.num_layers * 2 * cfg.num_kv_heads * engine.core.kv_cache.format.row_bytes(cfg.head_dim)
    for name, batch, slots in workloads:
        params = SamplingParams(temperature=0, max_tokens=spec["steps"] * 2 + 16, ignore_eos=True)
        ids = [f"{name}-{i}" for i in range(batch)]
        for rid, prompt in zip(ids, text_prompts(engine.tokenizer, batch, slots, seed=batch)):
            engine.add_request(prompt, params, rid)
        prefilled = engine.stats().prompt_tokens_total + batch * slots
        while engine.stats().prompt_tokens_total < prefilled:  # chunked prefill (decode rows ride along)
            engine.step()
        engine.step()  # the first step with every sequence decoding
        walls = []
        for _ in range(spec["steps"]):
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(spec["steps"]):
                engine.step()
        profiled = (time.perf_counter() - t0) / spec["steps"]
        ops = {t: 0.0 for t in TERMS}
        for e in prof.key_averages():
            ops[term_of(e.key)] += e.self_cpu_time_total / 1e6 / spec["steps"]
        logits = torch.randn(batch, cfg.vocab_size)
        draw = {"torch": median(timed(lambda: logits.argmax(dim=-1), 20)),
                "kvllm": median(timed(lambda: engine.model.layer_ops.argmax(logits), 20))}
        for rid in ids:
            engine.abort(rid)
        engine.check_invariants()
        out["rows"].append({"workload": name, "batch": batch, "slots": slots, "step": median(walls), "ops": ops,
                            "host": profiled - sum(ops.values()),
                            "flops": 2 * batch * weights,
                            "weight_bytes": linear_numel(engine.model, elem, rows=batch)[1],
                            "kv_bytes": batch * slots * kv_bytes_per_slot, "draw": draw})
    out["prefills"] = []
    for name, tokens in spec.get("prefills", []):  # one prompt alone, as a request arriving at an idle engine
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        walls = []
        for prompt in text_prompts(engine.tokenizer, 4, tokens, seed=tokens):
            t0 = time.perf_counter()
            engine.generate([prompt], params)
            walls.append(time.perf_counter() - t0)
        engine.check_invariants()
        out["prefills"].append({"workload": name, "tokens": tokens, "wall": median(walls[1:])})
    head = cfg.vocab_size * cfg.hidden_size
    out["model"] = {"weights": weights, "head": head, "weight_bytes": weight_bytes, "kv_per_slot": kv_bytes_per_slot,
                    "attn_flops_per_pair": 4 * cfg.num_q_heads * cfg.head_dim * cfg.num_layers}
    out["offline"] = []
    for name, n, prompt_len, output_len in spec.get("offline", OFFLINE):
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        prompts = text_prompts(engine.tokenizer, n, prompt_len, seed=7)
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
        engine.check_invariants()
        out["offline"].append({"workload": name, "n": n, "prompt": prompt_len, "output": output_len, "wall": wall,
                               "tokens": sum(len(o.outputs[0].token_ids) for o in outs)})
    return out


def run_floor(model: dict, rates_: dict, n: int, prompt_len: int, output_len: int) -> tuple[float, float]:
    """(prefill, decode) floor seconds of one offline run: every prompt token through the layers (and the causal
    attention's FLOPs) at the GEMM rate, the LM head once a sequence; then each decode step's two floors as in the
    step table (the first output token comes from the prefill)."""
    gemm, read = rates_["gflops"] * 1e9, rates_["read_gbs"] * 1e9
    body = model["weights"] - model["head"]
    pairs = n * prompt_len * (prompt_len + 1) // 2  # (query, key) pairs of the causal prefill
    prefill = (2 * n * prompt_len * body + 2 * n * model["head"] + pairs * model["attn_flops_per_pair"]) / gemm
    step_gemm = max(2 * n * model["weights"] / gemm, model["weight_bytes"] / read)
    decode = sum(step_gemm + n * (prompt_len + s) * model["kv_per_slot"] / read for s in range(1, output_len))
    return prefill, decode


def run_child(threads: int, steps: int, **spec) -> dict:
    """child() in its own interpreter; spec may set dtype, workloads [(name, batch, slots)], offline runs and
    prefills [(name, prompt tokens)] (one prompt's prefill alone, the median of three after a warm-up)."""
    spec = json.dumps({"threads": threads, "steps": steps, **spec})
    proc = subprocess.run([sys.executable, "-m", "bench.step_floor", "--child", spec], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"child at {threads} threads failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def prefill_floor(model: dict, rates_: dict, tokens: int) -> float:
    """Seconds one prompt of `tokens` tokens takes at the floor: its FLOPs at the GEMM rate (run_floor's prefill)."""
    return run_floor(model, rates_, 1, tokens, 1)[0]


def floors(rates_: dict, row: dict) -> tuple[float, float]:
    """(GEMM, K/V read) floor seconds of one measured decode step (a row of child())."""
    gemm = max(row["flops"] / (rates_["gflops"] * 1e9), row["weight_bytes"] / (rates_["read_gbs"] * 1e9))
    return gemm, row["kv_bytes"] / (rates_["read_gbs"] * 1e9)


def table(results: dict[int, dict]) -> str:
    ms = lambda s: f"{1e3 * s:.1f}"  # noqa: E731
    lines = ["| threads | decode batch (running x KV slots) | step | GEMM (floor) | attention (floor) | argmax | "
             "other ops | host | step / floors |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for threads, res in results.items():
        r = res["rates"]
        for row in res["rows"]:
            gemm_floor, kv_floor = floors(r, row)
            ops = row["ops"]
            lines.append(
                f"| {threads} | {row['workload']}: {row['batch']} x {row['slots']} | {ms(row['step'])} ms | "
                f"{ms(ops['GEMM'])} ({ms(gemm_floor)}) | {ms(ops['attention'])} ({ms(kv_floor)}) | "
                f"{ms(ops['argmax'])} | {ms(ops['other ops'])} | {ms(row['host'])} | "
                f"{row['step'] / (gemm_floor + kv_floor):.2f}x |")
    lines.append("")
    lines.append("| threads | logits [batch, vocab] | torch.argmax | kvllm argmax (csrc/layer_ops.cpp) | ratio |")
    lines.append("|---:|---|---:|---:|---:|")
    for threads, res in results.items():
        for row in res["rows"]:
            d = row["draw"]
            lines.append(f"| {threads} | [{row['batch']}, 49152] | {1e3 * d['torch']:.2f} ms | "
                         f"{1e3 * d['kvllm']:.2f} ms | {d['torch'] / d['kvllm']:.1f}x |")
    lines.append("")
    lines.append("| threads | offline run | kvllm | kvllm output tok/s | floor: prefill + decode | "
                 "floor output tok/s | kvllm / floor |")
    lines.append("|---:|---|---:|---:|---:|---:|---:|")
    for threads, res in results.items():
        for run in res["offline"]:
            pre, dec = run_floor(res["model"], res["rates"], run["n"], run["prompt"], run["output"])
            lines.append(f"| {threads} | {run['workload']} | {run['wall']:.1f} s | {run['tokens'] / run['wall']:.1f} | "
                         f"{pre:.1f} + {dec:.1f} = {pre + dec:.1f} s | {run['tokens'] / (pre + dec):.1f} | "
                         f"{run['wall'] / (pre + dec):.2f}x |")
    rates_line = "; ".join(
        f"{t} thread{'' if str(t).split(',')[0] == '1' else 's'}: GEMM at 2048 rows packed {res['rates']['packed_gflops']:.0f}, torch (MKL) "
        f"{res['rates']['mkl_gflops']:.0f} GFLOP/s; read {res['rates']['read_gbs']:.1f} GB/s"
        for t, res in results.items())
    return "\n".join(lines) + f"\n\nRates measured in each run (the floors take the faster GEMM): {rates_line}."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per row (and as many profiled)")
    ap.add_argument("--dtype", default="float32", help="model dtype (float32: the vs_vllm rows' dtype)")
    ap.add_argument("--kv-cache-dtype", nargs="+", default=None,
                    help="KV page dtypes to compare (e.g. auto int8 fp8_e4m3): one row set each, in its own section")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    t0 = time.time()
    kv_dtypes = args.kv_cache_dtype or ["auto"]
    # rows are labelled by their thread count, and by the KV dtype when several are compared
    results = {(t if args.kv_cache_dtype is None else f"{t}, KV {kv}"): run_child(
        int(t), args.steps, dtype=args.dtype, kv_cache_dtype=kv) for t in args.threads.split(",") for kv in kv_dtypes}
    body = table(results) + (
        f"\n\nSmolLM2-135M-Instruct, {args.dtype} activations, K/V in the model dtype unless a row names its KV "
        "dtype (8-bit rows: one byte a value and a float32 scale per token and KV head), greedy; each row: `batch` real-text prompts of "
        "`slots` tokens, prefilled, then the median wall time of the decode steps that follow (every sequence "
        "running), and torch.profiler's operator time per step by term over as many steps again (layer_ops auto: "
        "the fused decoder call, its kernels named inside it). Floors: GEMM = the "
        "step's linear-layer FLOPs (every layer and the LM head at `batch` rows) at the faster float32 GEMM's "
        "2048-row rate, or its weights as the step reads them (the GGUF file's blocks under gemm_backend 'gguf', the "
        "default for this model) at the read rate where that is longer; attention = the K/V bytes the step reads at "
        "the read rate. host = the profiled steps' wall time minus their operator time (Python, scheduling, "
        "detokenization, thread wake-ups; the profiler's own bookkeeping adds a little). Offline runs: "
        "`Engine.generate` of all the workload's real-text prompts at once (greedy, ignore_eos; max_num_seqs 64, "
        "max_num_batched_tokens 2048); their floor: the prompts' linear-layer and causal-attention FLOPs and the LM "
        "head once a sequence at the GEMM rate, then every decode step's GEMM floor plus its K/V bytes at the read "
        "rate, summed (one core does not overlap the two: a step's GEMMs are bound by its FMAs, its attention by "
        f"DRAM reads). {time.time() - t0:.0f} s.")
    print(body)
    if not args.no_write:
        from bench.common import RESULTS, write_section

        title = "Decode step against its floors (the vs_vllm decode batches)"
        cmd = "python -m bench.step_floor " + " ".join(sys.argv[1:])
        if args.kv_cache_dtype is not None:  # the KV dtype comparison is a headline of its own
            write_section("Decode step by KV page dtype (8-bit pages)", cmd, body)
        else:
            write_section(title, cmd, body, RESULTS / "offline_throughput.md")


if __name__ == "__main__":
    main()
