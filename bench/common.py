"""Shared benchmark helpers: real-text prompts and result-table output."""
from __future__ import annotations

import datetime
import glob
import os
import platform
import statistics
import subprocess
from pathlib import Path

LICENSES = "/usr/share/common-licenses"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
#: docs/results/: the comparisons behind the headline ones (one markdown file per topic) and earlier runs
RESULTS = DOCS.parent / "results"


def real_text() -> str:
    """Plain English text available on every Debian machine (the license texts), then stdlib sources."""
    parts = []
    for path in sorted(glob.glob(f"{LICENSES}/*")):
        if os.path.isfile(path) and not os.path.islink(path):
            parts.append(Path(path).read_text(errors="ignore"))
    if not parts:  # fall back on Python's own sources
        import inspect
        import textwrap

        parts.append(textwrap.dedent(inspect.getsource(textwrap)))
    return "\n\n".join(parts)


def text_prompts(tokenizer, num: int, length: int, seed: int = 0) -> list[list[int]]:
    """`num` prompts of exactly `length` token ids cut from real text at spread-out offsets."""
    import random

    ids = tokenizer(real_text()).input_ids
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(ids) - length) for _ in range(num)]
    return [ids[s:s + length] for s in starts]


def run_requests(engine, prompts, params, concurrency: int, prefix: str = "r", on_step=None):
    """Run `prompts` keeping at most `concurrency` requests in the engine (a client-side limit, like
    `vllm bench serve --max-concurrency`), through the public add_request / step API. `on_step(stats)` is called
    after every step. Returns the outputs in prompt order and the wall time."""
    import time

    todo = list(enumerate(prompts))[::-1]
    inflight: dict[str, int] = {}
    outs = [None] * len(prompts)
    t0 = time.perf_counter()
    while todo or inflight:
        while todo and len(inflight) < concurrency:
            i, p = todo.pop()
            inflight[engine.add_request(p, params, f"{prefix}-{i}")] = i
        for out in engine.step():
            outs[inflight.pop(out.request_id)] = out
        if on_step is not None:
            on_step(engine.stats())
    return outs, time.perf_counter() - t0


def median(xs):
    return statistics.median(xs)


def timed(fn, repeats: int, warmup: bool = True) -> list[float]:
    """Wall seconds of `repeats` calls of fn (after one untimed call unless warmup=False)."""
    import time

    if warmup:
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


NO_BF16 = "no AVX512-BF16 / AMX"


def cpu_flags() -> list[str] | None:
    """The first CPU's flags in /proc/cpuinfo (None where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return None


def bf16_features() -> str:
    """The CPU features that decide both servers' default dtype against vLLM (bfloat16 with either; without, kvllm
    picks float32 and vLLM still bfloat16)."""
    flags = cpu_flags()
    if flags is None:
        return "?"
    return ", ".join(x for x in ("avx512_bf16", "amx_tile") if x in flags) or NO_BF16


def host_suffix() -> str:
    """Appended to the title of a vs-vLLM section at the servers' default dtypes on a CPU without AVX512-BF16 or
    AMX, so that host's table sits beside the bfloat16 hosts' one instead of replacing it."""
    return ", on a CPU without AVX512-BF16" if bf16_features() == NO_BF16 else ""


def float32_host_suffix() -> str:
    """Appended to the float32 vs-vLLM section's title on a CPU without AVX-512: both servers run their float32 GEMMs
    on 8-wide FMAs there, a different contest from the AVX-512 hosts' table, which it sits beside."""
    flags = cpu_flags()
    return ", on a CPU without AVX-512" if flags is not None and "avx512f" not in flags else ""


def cpu_name() -> str:
    """'AMD EPYC (family 26 model 2), AVX-512' from /proc/cpuinfo: the machines of this project change between
    sessions, and a table is only comparable with others from the same CPU."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine()
    flags = info.get("flags", "").split()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    name = info.get("model name", platform.machine())
    return f"{name} (family {info.get('cpu family', '?')} model {info.get('model', '?')}), {isa}"


def commit() -> str:
    """The checkout's short commit, which labels a run's numbers ('?' outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=DOCS.parent.parent, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def machine() -> str:
    import torch

    return f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}"


def write_section(title: str, command: str, body: str, path: Path = DOCS) -> None:
    """Replace (or append) the `## title` section of `path`: docs/benchmarks.md for the headline comparisons, a
    file under docs/results/ for the others (so that a rerun replaces its section wherever the section lives)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else "# Benchmarks\n\nEvery table is written by the script named in its command line.\n"
    stamp = datetime.date.today().isoformat()
    section = f"## {title}\n\n`{command}` ({stamp}, {machine()})\n\n{body.strip()}\n"
    marker = f"## {title}\n"
    if marker in text:
        head, rest = text.split(marker, 1)
        nxt = rest.find("\n## ")
        tail = rest[nxt + 1:] if nxt != -1 else ""
        text = head + section + ("\n" + tail if tail else "")
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text)
