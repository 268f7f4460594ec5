"""How long an idle OpenMP worker should spin before it sleeps: decode-step time at 2 threads under
GOMP_SPINCOUNT values (OMP_WAIT_POLICY=PASSIVE, so 0 sleeps at once), on a quiet machine and beside one busy
process, with the 1-thread step as the reference. This is what engine/threads.py's DEFAULT_SPIN_COUNT rests on.

    python -m bench.omp_spin                                   # float32 + bfloat16, batches 16 and 64
    python -m bench.omp_spin --dtypes float32 --spins 0,1500 --repeats 1 --no-write

Each setting runs in its own interpreter, because libgomp reads the variables only when torch loads it; the
settings alternate within each repeat (the machine is shared: compare the ratios of one repeat, then medians).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

LOADS = ("quiet", "busy")


def child(spec: dict) -> dict:
    """One interpreter: an Engine at `threads` threads; per batch size, `batch` requests of 128-token prompts, the
    median wall time of `steps` decode steps once all are running and their prefill is done."""
    from engine.threads import configure_threads

    settings = configure_threads(spec["threads"])  # the parent exported the policy and spin: they are kept
    from bench.common import median, text_prompts
    from engine import Engine, SamplingParams

    engine = Engine(model="smollm2", dtype=spec["dtype"], device="cpu", max_num_seqs=64, max_num_batched_tokens=2048,
                    max_model_len=1024, kv_cache_memory="1GiB", seed=0, enable_prefix_caching=False)
    out = {"wait_policy": settings.wait_policy, "spin_count": settings.spin_count}
    for batch in spec["batches"]:
        params = SamplingParams(temperature=0, max_tokens=spec["steps"] + 8, ignore_eos=True)
        for i, prompt in enumerate(text_prompts(engine.tokenizer, batch, 128, seed=batch)):
            engine.add_request(prompt, params, f"b{batch}-{i}")
        times = []
        while engine.has_unfinished_requests():
            before = engine.stats()
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            after = engine.stats()
            if after.prompt_tokens_total == before.prompt_tokens_total and after.num_running == batch:
                times.append(dt)
        out[str(batch)] = median(times[1:]) if len(times) > 1 else float("nan")
    return out


def run_child(spec: dict, spin: int | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env.update(OMP_WAIT_POLICY="PASSIVE", TQDM_DISABLE="1")
    if spin is not None:
        env["GOMP_SPINCOUNT"] = str(spin)
    res = subprocess.run([sys.executable, "-m", "bench.omp_spin", "--child", json.dumps(spec)], env=env,
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"child {spec} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


class BusyNeighbour:
    """One process that keeps a core busy (another tenant, a client, a build) for the 'busy' rows."""

    def __init__(self, load: str):
        self.load, self.proc = load, None

    def __enter__(self):
        if self.load == "busy":
            self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--spins", default="0,1500,3000", help="GOMP_SPINCOUNT values at 2 threads, comma-separated")
    ap.add_argument("--steps", type=int, default=48, help="decode steps timed per batch")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--loads", default="quiet,busy")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return

    from bench.common import median, write_section
    from engine.threads import DEFAULT_SPIN_COUNT

    dtypes, loads = args.dtypes.split(","), args.loads.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    spins = [int(s) for s in args.spins.split(",")]
    for load in loads:
        if load not in LOADS:
            raise SystemExit(f"--loads: unknown {load!r}, choose from {LOADS}")
    # setting: (threads, spin); the 1-thread run has no worker to wait
    settings = [(1, 0)] + [(2, s) for s in spins]
    results: dict = {}
    t_start = time.perf_counter()
    for rep in range(args.repeats):
        for load in loads:
            for dtype in dtypes:
                for threads, spin in settings:
                    spec = {"threads": threads, "dtype": dtype, "batches": batches, "steps": args.steps}
                    with BusyNeighbour(load):
                        r = run_child(spec, spin)
                    if threads == 2 and r["spin_count"] != spin:
                        raise SystemExit(f"libgomp got spin {r['spin_count']}, wanted {spin}")
                    for b in batches:
                        results.setdefault((load, dtype, b, threads, spin), []).append(r[str(b)])
                    print(load, dtype, threads, spin, {b: round(r[str(b)] * 1e3, 1) for b in batches}, flush=True)

    head = ("| load | dtype | batch | 1 thread | " + " | ".join(
        f"2 threads, spin {s}" + (" (default)" if s == DEFAULT_SPIN_COUNT else " (passive)" if s == 0 else "")
        for s in spins) + " |")
    lines = [head, "|---|---|---:|---:|" + "---:|" * len(spins)]
    for load in loads:
        for dtype in dtypes:
            for b in batches:
                one = median(results[(load, dtype, b, 1, 0)])
                passive = median(results[(load, dtype, b, 2, 0)]) if 0 in spins else None
                cells = [f"{one * 1e3:.1f} ms"]
                for s in spins:
                    t = median(results[(load, dtype, b, 2, s)])
                    rel = f", {t / passive:.2f}x passive" if passive and s != 0 else ""
                    cells.append(f"{t * 1e3:.1f} ms ({one / t:.2f}x 1 thread{rel})")
                lines.append(f"| {load} | {dtype} | {b} | " + " | ".join(cells) + " |")
    note = (f"Median wall time of one decode step (SmolLM2, 128-token real-text prompts, every sequence running, "
            f"{args.steps} steps per batch size) over {args.repeats} repeats; each setting in its own interpreter "
            f"with OMP_WAIT_POLICY=PASSIVE and GOMP_SPINCOUNT as named, settings alternating within a repeat. "
            f"'busy': one other process spinning on a core (`python -c 'while True: pass'`) during the run. "
            f"In parentheses: speed against 1 thread, and step time against 2 threads with spin 0. "
            f"{time.perf_counter() - t_start:.0f} s.")
    body = "\n".join(lines) + "\n\n" + note
    print(body)
    if not args.no_write:
        write_section("Threads: OpenMP spin before sleep", "python -m bench.omp_spin " + " ".join(sys.argv[1:]),
                      body)


if __name__ == "__main__":
    main()
