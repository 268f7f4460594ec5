"""Offline throughput: kvllm vs HF transformers `generate` on SmolLM2 (CPU), both in the same dtype, in one process.

64 requests, 256-token prompts of real text, 256 new tokens with ignore_eos, greedy. HF runs static batches of
the same size. Also measures the bare matmul floor of one decode step (every linear layer + LM head at
the batch size, no attention or norms) so the engine's overhead over pure GEMM time is visible.

    .venv/bin/python -m bench.offline_throughput [--threads 1,2] [--engines cpu,cpu+int8,torch]

Every engine setting runs the same requests at every thread count in one process (ratios within one run are what
to compare on a shared machine); the GEMM floors are the fp32 model's (an int8 engine's weights dequantized), so int8
rows are shown against fp32, and each engine measures them right before its own runs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from engine.threads import configure_threads

# before torch loads: the engine's own OpenMP waiting (passive after a short spin, engine/threads.py), so a 2-thread
# sweep does not spin-collapse; --default-wait leaves libgomp's own policy (spin ~300k times, then sleep)
WAIT_POLICY = None if "--default-wait" in sys.argv else "passive"
THREADS = configure_threads(1, wait_policy=WAIT_POLICY)

import torch  # noqa: E402

from bench.common import DOCS, RESULTS, median, run_requests, text_prompts, timed, write_section  # noqa: E402
from engine import Engine, SamplingParams  # noqa: E402
from engine.config import parse_dtype  # noqa: E402


def kvllm_run(engine: Engine, prompts, output_len: int, batch: int) -> tuple[float, float]:
    """Output tok/s with at most `batch` sequences running, and mean decode step time (s) at full batch."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    outs, elapsed = run_requests(engine, prompts, params, batch, prefix=f"b{batch}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == len(prompts) * output_len
    engine.check_invariants()
    return tokens / elapsed, elapsed


def decode_step_time(engine: Engine, prompts, batch: int, floor_once, steps: int = 16) -> tuple[float, float, float]:
    """A pure decode step with `batch` running sequences against its GEMM floor, the two timed in alternation
    (each step, then `floor_once`), so a machine whose speed drifts moves both: (median step, median floor, median
    of the per-pair ratios)."""
    # long enough that the first sequences are still decoding when the last prompt's chunked prefill ends
    prompt_tokens = sum(len(p) for p in prompts[:batch])
    prefill_steps = prompt_tokens // engine.config.max_num_batched_tokens + 2
    params = SamplingParams(temperature=0, max_tokens=prefill_steps + steps + 4, ignore_eos=True)
    for i, p in enumerate(prompts[:batch]):
        engine.add_request(p, params, f"probe-{i}")
    times, floors = [], []
    while engine.has_unfinished_requests():
        before = engine.stats().prompt_tokens_total
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        st = engine.stats()  # all sequences running and no prompt token computed in this step: a pure decode step
        if st.num_running == batch and st.num_waiting == 0 and st.prompt_tokens_total == before:
            times.append(dt)
            floors.append(timed(floor_once, 1, warmup=False)[0])
    if not times:
        raise RuntimeError(f"never had {batch} sequences decoding together (KV pool too small?)")
    times, floors = times[1:] or times, floors[1:] or floors
    return median(times), median(floors), median([t / f for t, f in zip(times, floors)])


def hf_run(model, prompts, output_len: int, batch: int) -> float:
    total, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i:i + batch])  # all prompts have the same length: no padding
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=0)
            total += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return total / (time.perf_counter() - t0)


def matmul_floor(engine: Engine, batch: int, repeats: int = 10, lm_head: bool = True) -> float:
    """Seconds for the bare GEMMs (model dtype) of one decode step: x[batch, in] @ W.T for every linear + LM head
    (without the LM head: the GEMMs of a prefill chunk of `batch` tokens, which needs logits only at its end)."""
    once = floor_step(engine, batch, lm_head)
    with torch.inference_mode():
        return median(timed(once, repeats))


def floor_step(engine: Engine, batch: int, lm_head: bool = True):
    """A callable that runs those bare GEMMs once."""
    from engine.models.onednn import OneDnnLinear
    from engine.models.packed import PackedLinear
    from engine.models.quant import Int8Linear

    vocab = engine.model_config.vocab_size
    # torch's own GEMMs on dense weights (a packed layer's .weight unpacks it, an int8 one dequantizes it), whatever
    # the engine runs
    weights = [m.weight.to(engine.dtype).contiguous() for m in engine.model.modules()
               if isinstance(m, (torch.nn.Linear, PackedLinear, OneDnnLinear, Int8Linear))
               and (lm_head or m.out_features != vocab)]
    hidden = engine.model_config.hidden_size
    xs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=engine.dtype) for w in weights}
    xh = torch.randn(batch, hidden, dtype=engine.dtype)
    has_lm_head = any(w.shape[0] == engine.model_config.vocab_size for w in weights)
    lm_weight = None if has_lm_head or not lm_head else (
        engine.model.embed_tokens.weight if hasattr(engine.model, "embed_tokens") else None)

    @torch.inference_mode()
    def once():
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)
        if lm_weight is not None:
            torch.nn.functional.linear(xh, lm_weight)

    return once


def own_gemm_step(engine: Engine, batch: int, repeats: int = 10) -> float:
    """Seconds for one decode step's linear layers + LM head at `batch` rows as this engine runs them (its
    gemm_backend / quantization): the floor of the step with the engine's own GEMMs."""
    from engine.models.onednn import OneDnnLinear
    from engine.models.packed import PackedLinear
    from engine.models.quant import Int8Linear

    vocab = engine.model_config.vocab_size
    layers = [m for m in engine.model.modules()
              if isinstance(m, (torch.nn.Linear, PackedLinear, OneDnnLinear, Int8Linear)) and m.out_features != vocab]
    xs = {m.in_features: torch.randn(batch, m.in_features, dtype=engine.dtype) for m in layers}
    xh = torch.randn(batch, engine.model_config.hidden_size, dtype=engine.dtype)

    def once():
        for m in layers:
            m(xs[m.in_features])
        engine.model.compute_logits(xh)

    with torch.inference_mode():
        return median(timed(once, repeats))


def prefix_caching_rows(args) -> str:
    """The workload with a shared system prompt in front of every request, prefix caching on vs off: output tok/s and
    the median / p90 time to first token (arrival to first token, from each RequestOutput's metrics)."""
    rows = []
    for on in (False, True):
        engine = Engine(model="smollm2", dtype=args.dtype, device="cpu", max_num_seqs=64,
                        max_num_batched_tokens=2048, max_model_len=2048, enable_prefix_caching=on)
        system = text_prompts(engine.tokenizer, 1, args.prefix_len, seed=1)[0]
        prompts = [system + p for p in text_prompts(engine.tokenizer, args.num_prompts, args.input_len)]
        kvllm_run(engine, [p[-8:] for p in prompts[:4]], 4, 4)  # warm-up that caches nothing of the workload
        engine.reset_stats()
        params = SamplingParams(temperature=0, max_tokens=args.prefix_output_len, ignore_eos=True)
        outs, wall = run_requests(engine, prompts, params, 64, prefix="p")
        ttft = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
        st = engine.stats()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        hit = st.prefix_cache_hits / st.prefix_cache_queries if st.prefix_cache_queries else 0.0
        rows.append((on, tokens / wall, median(ttft), ttft[int(0.9 * (len(ttft) - 1))], hit, st.prompt_tokens_total))
        del engine
    lines = ["| prefix caching | output tok/s | median TTFT | p90 TTFT | prompt tokens computed | prefix hit rate |",
             "|---|---:|---:|---:|---:|---:|"]
    for on, tps, t50, t90, hit, computed in rows:
        lines.append(f"| {'on' if on else 'off'} | {tps:.1f} | {t50:.1f} s | {t90:.1f} s | {computed} "
                     f"| {100 * hit:.0f}% |")
    return "\n".join(lines) + (
        f"\n\n{args.num_prompts} requests, each a shared {args.prefix_len}-token system prompt + its own "
        f"{args.input_len}-token real-text prompt, {args.prefix_output_len} new tokens (greedy, ignore_eos), all "
        f"submitted at once (TTFT includes queueing); {torch.get_num_threads()} CPU thread(s). With prefix caching "
        f"the system prompt is computed by the first requests admitted and taken from the cache by the rest.")


ENGINES = {  # name -> Engine keyword arguments
    "cpu": dict(attention_backend="cpu"),  # gemm_backend auto: packed float32 panels, or bf16 packed for oneDNN
    "cpu+int8": dict(attention_backend="cpu", quantization="int8"),
    "torch": dict(attention_backend="torch"),
    "cpu+fp16kv": dict(attention_backend="cpu", kv_cache_dtype="float16"),
    "cpu+int8+fp16kv": dict(attention_backend="cpu", quantization="int8", kv_cache_dtype="float16"),
    "cpu+torchgemm": dict(attention_backend="cpu", gemm_backend="torch"),  # the CPU kernel with F.linear's GEMMs
    "cpu+torchops": dict(attention_backend="cpu", layer_ops="torch"),  # norms, RoPE, SiLU, K/V writes in torch ops
}


def workload_floor(floors: dict, n: int, batch: int, input_len: int, output_len: int) -> float:
    """Bare-GEMM seconds of n requests run `batch` at a time: their prefill GEMMs + output_len decode steps of
    each wave (a lower bound for any engine: no attention, norms or sampling)."""
    return floors["prefill_per_token"] * input_len * n + floors[batch] * output_len * -(-n // batch)


def engine_rows(name: str, args, prompts_fn, batches: list[int]):
    """Throughput at each max-running batch and the decode-step probe at ~input_len and ~input+output KV slots, with
    the GEMM floors measured from this engine's weights (as dense fp32: an int8 engine's dequantized) right before
    its workload, so a drifting machine moves both sides of each ratio alike."""
    engine = Engine(model="smollm2", dtype=args.dtype, device="cpu", max_num_seqs=64, max_num_batched_tokens=2048,
                    max_model_len=2048, **ENGINES[name])
    prompts = prompts_fn(engine.tokenizer, args.num_prompts, args.input_len)
    floors = {}
    if not args.probe_only:
        floors = {b: matmul_floor(engine, b) for b in sorted({*batches, args.hf_batch})}
        chunk = 2048
        floors["prefill_per_token"] = matmul_floor(engine, chunk, repeats=3, lm_head=False) / chunk
    kvllm_run(engine, prompts[:4], 8, 4)  # warm-up
    runs = {b: kvllm_run(engine, prompts, args.output_len, b) for b in batches} if not args.probe_only else {}
    probe = min(64, len(prompts))
    floor_once = floor_step(engine, probe)  # this engine's weights as dense float32 (int8 ones dequantized)
    step_start = decode_step_time(engine, prompts, probe, floor_once)
    long_prompts = prompts_fn(engine.tokenizer, probe, args.input_len + args.output_len - 16)
    step_end = decode_step_time(engine, long_prompts, probe, floor_once)
    del floor_once
    own = own_gemm_step(engine, probe)
    tokenizer = engine.tokenizer
    del engine
    return floors, runs, (probe, step_start, step_end, own), tokenizer, prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix-only", action="store_true", help="only the prefix-caching rows")
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--prefix-output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batches", default="32,64", help="max running sequences, comma-separated")
    ap.add_argument("--engines", default="cpu,cpu+int8", help=f"comma-separated, from {sorted(ENGINES)}; the "
                    "first one's floors are HF's")
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--hf-num-prompts", type=int, default=32, help="HF runs this many prompts (a rate is measured)")
    ap.add_argument("--dtype", default="float32", help="engines' and HF's dtype; float32 is issue 14's floor, 'auto' "
                    "is the engine's default (bf16 on CPUs with AMX or AVX512-BF16)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--threads", default="1", help="torch threads, comma-separated (e.g. 1,2): each count runs "
                    "every engine and HF")
    ap.add_argument("--probe-only", action="store_true", help="only the decode-step probes (no workload, no HF), "
                    "written to their own section")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    ap.add_argument("--default-wait", action="store_true", help="libgomp's own wait policy (spin GOMP_SPINCOUNT "
                    "times, then sleep) instead of passive")
    args = ap.parse_args()
    torch.manual_seed(0)
    thread_counts = [int(x) for x in str(args.threads).split(",")]
    if args.prefix_only:
        configure_threads(thread_counts[0], wait_policy=WAIT_POLICY)
        body = prefix_caching_rows(args)
        print(body)
        if not args.no_write:
            write_section("Prefix caching (shared system prompt)", "python -m bench.offline_throughput "
                          + " ".join(sys.argv[1:]), body, RESULTS / "offline_throughput.md")
        return

    names = args.engines.split(",")
    for n in names:
        if n not in ENGINES:
            raise SystemExit(f"--engines: unknown {n!r}, choose from {sorted(ENGINES)}")
    batches = [int(b) for b in args.batches.split(",")]
    dtype = parse_dtype(args.dtype)
    dname = str(dtype).removeprefix("torch.")
    waiting = (f"OpenMP waits passively after {THREADS.spin_count or 0} spins" if WAIT_POLICY else
               f"OpenMP waits as libgomp does by default (GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'unset')})")
    t_start = time.perf_counter()
    tput = ["| threads | engine | max running | output tok/s | vs HF (same threads) | workload time | its GEMM floor "
            "| time / floor |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    steps = [f"| threads | engine | decode step at 64 running | KV slots per sequence | bare {dname} GEMM floor (torch) "
             "| step | step / floor | the engine's own GEMMs | step / own GEMMs |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    hf_rows = ["| threads | HF output tok/s (batch {b}, {n} prompts) | HF time / its GEMM floor |".format(
        b=args.hf_batch, n=args.hf_num_prompts), "|---:|---:|---:|"]
    for threads in thread_counts:
        configure_threads(threads, wait_policy=WAIT_POLICY)
        results = {}
        for name in names:
            floors, runs, probe, tokenizer, prompts = engine_rows(name, args, text_prompts, batches)
            results[name] = (floors, runs, probe)
        floors = results[names[0]][0]  # HF's: the first engine's
        hf_tps = None
        if not args.skip_hf and not args.probe_only:
            from transformers import AutoModelForCausalLM

            from engine.loader import smollm2_gguf_path

            gguf = smollm2_gguf_path()
            hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype).eval()
            hf_run(hf, prompts[:2], 4, 2)  # warm-up
            hf_tps = hf_run(hf, prompts[:args.hf_num_prompts], args.output_len, args.hf_batch)
            n = args.hf_num_prompts
            hf_time = n * args.output_len / hf_tps
            hf_floor = workload_floor(floors, n, args.hf_batch, args.input_len, args.output_len)
            hf_rows.append(f"| {threads} | {hf_tps:.1f} | {hf_time / hf_floor:.2f}x ({hf_time:.0f} s / "
                           f"{hf_floor:.0f} s) |")
            del hf
        for name in names:
            floors, runs, (probe, s0, s1, own) = results[name]
            for b, (tps, wall) in runs.items():
                fl = workload_floor(floors, args.num_prompts, b, args.input_len, args.output_len)
                vs = f"{tps / hf_tps:.2f}x" if hf_tps else "-"
                tput.append(f"| {threads} | {name} | {b} | {tps:.1f} | {vs} | {wall:.1f} s | {fl:.1f} s "
                            f"| {wall / fl:.2f}x |")
            for label, slots, (s, fl, ratio) in (("start of decode", args.input_len, s0),
                                                 ("end of decode", args.input_len + args.output_len, s1)):
                steps.append(f"| {threads} | {name} | {label} | ~{slots} | {fl * 1e3:.1f} ms "
                             f"| {s * 1e3:.1f} ms | {ratio:.2f}x | {own * 1e3:.1f} ms | {s / own:.2f}x |")
    if args.probe_only:
        tput = []
    body = "\n".join(([*tput, ""] if tput else []) + steps
                     + ([""] + hf_rows if not (args.skip_hf or args.probe_only) else []))
    body += (f"\n\nSmolLM2-135M-Instruct (Q4_1 GGUF dequantized to {dname} unless the engine is +int8), "
             f"{args.num_prompts} requests x {args.input_len}-token real-text prompts, {args.output_len} new tokens, "
             f"greedy, ignore_eos, at most 'max running' in the engine at once; HF generate runs "
             f"{args.hf_num_prompts} of the prompts in static batches of {args.hf_batch}. Engines: "
             + "; ".join(f"{n} = {ENGINES[n]}" for n in names) + f". GEMM floor: torch's bare {dname} GEMMs (F.linear on the dense weights) of the same work "
             f"at the same threads (prefill GEMMs of every prompt, in 2048-token chunks, + one decode step of GEMMs "
             f"and LM head per output token of each wave of 'max running' requests), measured from each engine's "
             f"weights right before its workload (int8 ones dequantized; HF against the first engine's); the "
             f"decode-step floor is one such step at 64 rows, timed in alternation with the engine's steps (step / "
             f"floor: the median of the per-pair ratios); 'the engine's own GEMMs': that step's linear layers and LM "
             f"head through the "
             f"engine's own modules (packed, int8 or F.linear). {waiting}. {time.perf_counter() - t_start:.0f} s.")
    if args.probe_only:
        body = "\n".join(steps) + (
            f"\n\nSmolLM2-135M-Instruct; the median pure decode step (every sequence running, no prompt token in the "
            f"step) with {min(64, args.num_prompts)} sequences of ~{args.input_len} and ~"
            f"{args.input_len + args.output_len} KV slots, against the bare {dname} GEMMs (+ LM head) of one step at "
            f"that batch and thread count, the two timed in alternation (step / floor: the median of the per-pair "
            f"ratios; int8 engines against their weights dequantized). Engines: "
            + "; ".join(f"{n} = {ENGINES[n]}" for n in names)
            + f". {waiting}. {time.perf_counter() - t_start:.0f} s.")
    print(body)
    if not args.no_write:
        cmd = "python -m bench.offline_throughput " + " ".join(sys.argv[1:])
        title = ("Decode step vs its GEMM floor: KV cache dtype and int8 weights" if args.probe_only
                 else "Offline throughput (kvllm vs HF transformers)")
        if args.probe_only and dname != "float32":  # another dtype's probe keeps the float32 table
            title = f"Decode step vs its GEMM floor, {dname}"
        # the probe is a diagnosis behind the headline table: its sections live under docs/results/
        write_section(title, cmd.strip(), body, RESULTS / "offline_throughput.md" if args.probe_only else DOCS)


if __name__ == "__main__":
    main()
