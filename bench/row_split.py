"""What `--dtype auto` runs a .gguf model as on a CPU with AVX512-BF16/AMX (the row split of
engine/models/row_split.py) against the two single-dtype paths it is made of, in one run, on cells of the serving
matrix (bench/vs_vllm_cells.py) under vLLM's client:

    python -m bench.row_split [--cells GLOBS] [--quick] [--no-write]

kvllm serve smollm2 at its defaults (auto: the split), with `--dtype bfloat16` (bfloat16 weights on the panels for
every row count, float32 activations, the fused stack: engine/linear_path.py `panels_apply`), with `--dtype bfloat16
--gemm-backend onednn` (every forward in bf16, layer by layer, on oneDNN's GEMMs: what `--dtype bfloat16` ran
before) and with `--dtype float32` (every forward on the file's blocks, the fused stack); VLLM_CPU_KVCACHE_SPACE=2
for each, 2 threads, a warm-up burst before each launch's cells. The table: output tok/s and median TPOT / TTFT per
cell, and each other path's tok/s over the split's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from argparse import Namespace
from pathlib import Path

from bench.common import cpu_name, write_section
from bench.vllm_env import ROOT, ensure_model_dir, ensure_venv, vllm_version
from bench.vs_vllm_cells import cell_named, select
from bench.vs_vllm_matrix import THREADS, cell_workload, serve_cells, server_for
from bench.vs_vllm_serving import run_client

CELLS = ["cmpl-short-inf-c1", "chat-mid-p2-c1", "cmpl-short-p6-c8", "chat-short-inf-c8", "chat-mid-p6-c32",
         "chat-short-inf-c64"]
# label -> (file tag, flags)
SETTINGS = {"auto (split)": ("auto", []), "bfloat16": ("bfloat16", ["--dtype", "bfloat16"]),
            "bfloat16, oneDNN": ("onednn", ["--dtype", "bfloat16", "--gemm-backend", "onednn"]),
            "float32": ("float32", ["--dtype", "float32"])}
SECTION = "GEMMs split by row count: what --dtype auto runs a .gguf model as"


def run(args, tok, out: Path) -> dict:
    data: dict = {"versions": vllm_version(), "cpu": cpu_name(), "rows": [], "errors": []}
    for label, (tag, flags) in SETTINGS.items():
        server = server_for("kvllm", "defaults", args, out / f"server_{tag}.log", flags)

        def one(name: str, label=label, tag=tag, server=server) -> None:
            res = out / f"{tag}_{name}.json"
            try:
                r = run_client("vllm", server, cell_workload(cell_named(name), args, tok, out), args.model_dir, res,
                               out / f"{res.stem}.log")
            except RuntimeError as err:  # recorded; the next cell runs
                data["errors"].append(f"{label} {name}: {err}")
                return
            data["rows"].append({"setting": label, "cell": name, "tok_s": r["output_throughput"],
                                 "tpot_ms": r["median_tpot_ms"], "ttft_ms": r["median_ttft_ms"], "failed": r["failed"]})
            print(f"  {label} {name}: {r['output_throughput']:.1f} tok/s", flush=True)

        serve_cells(server, tag, args.cell_names, args, tok, out, data["errors"], one)
    return data


def render(data: dict, cells: list[str]) -> str:
    by = {(r["setting"], r["cell"]): r for r in data["rows"]}
    names = list(SETTINGS)
    others = names[1:]
    head = ("| cell | " + " | ".join(f"{s}: tok/s (TPOT / TTFT ms)" for s in names) + " | "
            + " | ".join(f"{s} / split" for s in others) + " |")
    lines = [head, "|---|" + "---:|" * (len(names) + len(others))]
    ratios: dict[str, list[float]] = {s: [] for s in others}
    for c in cells:
        cols = []
        for s in names:
            r = by.get((s, c))
            cols.append(f"{r['tok_s']:.1f} ({r['tpot_ms']:.1f} / {r['ttft_ms']:.0f})" if r else "failed")
        split = by.get((names[0], c))
        rat = []
        for s in others:
            r = by.get((s, c))
            if r and split:
                ratios[s].append(r["tok_s"] / split["tok_s"])
                rat.append(f"{r['tok_s'] / split['tok_s']:.2f}x")
            else:
                rat.append("-")
        lines.append(f"| {c} | " + " | ".join(cols) + " | " + " | ".join(rat) + " |")
    med = ", ".join(f"{s} / split {statistics.median(v):.2f}x" for s, v in ratios.items() if v)
    lines += ["", f"{data['cpu']}, {THREADS} threads; kvllm serve smollm2 (Q4_1 GGUF) at its defaults but for "
              "the flags named; VLLM_CPU_KVCACHE_SPACE=2; client: vLLM's `vllm bench serve` "
              f"({data['versions']}), cells of bench/vs_vllm_cells.py. Median ratio over the cells: {med}."]
    if data["errors"]:
        lines.append("Errors: " + "; ".join(data["errors"]))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default=",".join(CELLS), help="cells of bench/vs_vllm_cells.py (names or globs)")
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the pipeline; writes no docs")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--port", type=int, default=8797)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    ensure_venv()
    args = Namespace(model_dir=ensure_model_dir(), kvllm_model="smollm2", port=a.port, quick=a.quick)
    args.cell_names = [n for _, n in select([("defaults", c) for c in CELLS], a.cells)]
    out = Path(a.out or ROOT / "build" / "row_split" / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(args.model_dir))
    t0 = time.perf_counter()
    data = run(args, tok, out)
    body = render(data, args.cell_names) + f" {time.perf_counter() - t0:.0f} s."
    (out / "row_split.json").write_text(json.dumps(data, indent=1))
    print(body)
    if not (a.quick or a.no_write):
        write_section(SECTION, "python -m bench.row_split " + " ".join(sys.argv[1:]), body)


if __name__ == "__main__":
    main()
