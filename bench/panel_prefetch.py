"""The bf16 panel GEMM (csrc/bf16_linear.cpp) with and without its prefetch of the next panel group, in one process:
first every bf16-panel linear of the default model (SmolLM2 at `--dtype auto`: the row split's copies, the LM head
included) called in model order at a few row counts, then whole decode steps of the default engine at a few batch
sizes. The prefetch is switched with torch.ops.kvllm_cpu.set_bf16_prefetch between alternating rounds, and each
side's median is reported with the ratio.

    python -m bench.panel_prefetch [--threads 2] [--rounds 7] [--no-write]
"""
from __future__ import annotations

import argparse
import json
import time

from bench.common import cpu_name, median, write_section

SECTION = "bf16 panels: prefetching the next group"
GEMM_ROWS = (8, 16, 32, 64, 256)
DECODE = ((16, 256), (32, 384), (64, 384))  # (sequences, KV slots each)


def alternate(fn, ops, rounds: int) -> dict[bool, float]:
    """Median seconds of fn() with the prefetch on and off, the two alternating over `rounds` rounds."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 * rounds):
        on = i % 2 == 0
        ops.set_bf16_prefetch(on)
        t = time.perf_counter()
        fn()
        times[on].append(time.perf_counter() - t)
    ops.set_bf16_prefetch(True)
    return {on: median(ts) for on, ts in times.items()}


def run(threads: int, rounds: int) -> dict:
    from engine.threads import configure_threads

    configure_threads(threads)
    import torch

    from bench.common import text_prompts
    from engine import Engine, SamplingParams
    from engine.attention import cpu_ext
    from engine.models.bf16_panels import Bf16PanelLinear

    ops = cpu_ext.load()
    engine = Engine(model="smollm2", max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=1024,
                    kv_cache_memory="2GiB", seed=0, enable_prefix_caching=False)
    panels = [m for m in engine.model.modules() if isinstance(m, Bf16PanelLinear)]
    if not panels:
        raise SystemExit("no bf16 panels here: --dtype auto runs the row split only on a CPU with AVX512-BF16")
    out: dict = {"cpu": cpu_name(), "threads": threads, "rounds": rounds, "layers": len(panels), "gemm": [],
                 "decode": []}
    weights = sum(m.in_features * m.out_features for m in panels)
    for rows in GEMM_ROWS:
        xs = {m.in_features: torch.randn(rows, m.in_features) for m in panels}

        def model_gemms() -> None:
            for m in panels:
                m(xs[m.in_features])

        model_gemms()
        t = alternate(model_gemms, ops, rounds)
        out["gemm"].append({"rows": rows, "on": t[True], "off": t[False], "gflops": 2 * rows * weights / t[True] / 1e9})
        print(f"gemm {rows} rows: on {1e3 * t[True]:.2f} ms, off {1e3 * t[False]:.2f} ms", flush=True)
    params = SamplingParams(temperature=0, max_tokens=4 * rounds + 16, ignore_eos=True)
    for batch, slots in DECODE:
        ids = [f"{batch}-{i}" for i in range(batch)]
        for rid, prompt in zip(ids, text_prompts(engine.tokenizer, batch, slots, seed=batch)):
            engine.add_request(prompt, params, rid)
        prefilled = engine.stats().prompt_tokens_total + batch * slots
        while engine.stats().prompt_tokens_total < prefilled:
            engine.step()
        engine.step()
        t = alternate(engine.step, ops, 2 * rounds)
        for rid in ids:
            engine.abort(rid)
        engine.check_invariants()
        out["decode"].append({"batch": batch, "slots": slots, "on": t[True], "off": t[False]})
        print(f"decode {batch} x {slots}: on {1e3 * t[True]:.1f} ms, off {1e3 * t[False]:.1f} ms", flush=True)
    engine.shutdown()
    return out


def render(data: dict) -> str:
    ms = lambda s: f"{1e3 * s:.2f}"  # noqa: E731
    lines = [f"The {data['layers']} bf16-panel linears of SmolLM2 at `--dtype auto` (the row split's copies and the LM "
             "head), called in model order:", "",
             "| rows | prefetch on (ms) | off (ms) | off / on | GFLOP/s on |", "|---:|---:|---:|---:|---:|"]
    for r in data["gemm"]:
        lines.append(f"| {r['rows']} | {ms(r['on'])} | {ms(r['off'])} | {r['off'] / r['on']:.2f}x | {r['gflops']:.0f} |")
    lines += ["", "Whole decode steps of the default engine (`Engine(model='smollm2')`, greedy, every sequence "
              "decoding):", "", "| sequences x KV slots | step, prefetch on (ms) | off (ms) | off / on |",
              "|---|---:|---:|---:|"]
    for r in data["decode"]:
        lines.append(f"| {r['batch']} x {r['slots']} | {ms(r['on'])} | {ms(r['off'])} | {r['off'] / r['on']:.2f}x |")
    lines += ["", f"{data['cpu']}, {data['threads']} threads, one process; the two settings alternate "
              f"({data['rounds']} rounds of the GEMMs, {2 * data['rounds']} steps each way), medians. Why the "
              "prefetch: each panel group's first row tile otherwise waits on DRAM for its weights, which hardware "
              "prefetch does not fetch ahead across groups (csrc/bf16_linear.cpp, rows_of)."]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    data = run(a.threads, a.rounds)
    print(json.dumps(data, indent=1))
    body = render(data)
    print(body)
    if not a.no_write:
        cmd = "python -m bench.panel_prefetch" + ("" if a.threads == 2 else f" --threads {a.threads}") + (
            "" if a.rounds == 7 else f" --rounds {a.rounds}")
        write_section(SECTION, cmd, body)


if __name__ == "__main__":
    main()
