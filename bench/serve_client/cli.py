"""`kvllm bench serve`: a load-test client for any OpenAI-compatible server, modelled on `vllm bench serve`.

    kvllm bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate inf \
        --max-concurrency 32 --dataset random --input-len 256 --output-len 64 --ignore-eos \
        --save-result result.json --plot result.png

* Requests stream (SSE) over httpx with ``stream_options.include_usage``; arrivals are a Poisson process at
  ``--request-rate`` (gamma with ``--burstiness`` ≠ 1; ``inf`` sends everything at t=0); a client-side
  semaphore bounds requests in flight (``--max-concurrency``).
* Datasets: ``random`` (vLLM's: token ids decoded to text and re-encoded to the target length, with
  ``--random-range-ratio`` and ``--random-prefix-len``) and ``text:FILE`` (a ``.jsonl`` file of
  ``{"prompt": ...}`` lines, or a plain text file cut into windows of ``--input-len`` tokens).
* Metrics as vLLM defines them, client side: TTFT (send → first streamed chunk), ITL (every gap between chunks,
  pooled), TPOT per request ((E2E − TTFT)/(output tokens − 1)), E2EL; output token counts come from the
  stream's usage block.
* Output: vLLM's "Serving Benchmark Result" table, failed requests counted by reason, ``--save-result`` JSON
  (vLLM's keys), ``--plot`` PNG (latency distributions and throughput over time).

`run_benchmark(args)` runs it in-process and returns the result dict (args: an argparse Namespace, a dict of
option values, or a list of command-line strings).
"""
from __future__ import annotations


import argparse
import asyncio
import json
import math
import os
from datetime import datetime
from pathlib import Path
from typing import Any


from bench.serve_client.client import run_load
from bench.serve_client.dataset import get_samples, load_tokenizer
from bench.serve_client.report import format_table, plot_results
from bench.serve_client.stats import calculate_metrics

#: per-request arrays left out of --save-result unless --save-detailed
_DETAILED_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "generated_texts",
                    "errors", "usage_prompt_tokens", "finish_reasons", "prompts")

# ========================================================================================== arguments
def _extra_body(text: str) -> dict:
    if isinstance(text, dict):
        return text
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"--extra-body must be a JSON object: {err}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("--extra-body must be a JSON object")
    return obj


def _rate(text: str) -> float:
    v = float(text)
    if not (v > 0):
        raise argparse.ArgumentTypeError("--request-rate must be > 0 or inf")
    return v


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """The load-test client's one entry for a command line: its options on `p`, and `main` as `p`'s handler
    (`kvllm bench serve` is this parser; the server's CLI imports nothing else of bench)."""
    p.set_defaults(handler=main)
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    t.add_argument("--host", default="127.0.0.1")
    t.add_argument("--port", type=int, default=8000)
    t.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    t.add_argument("--backend", default="auto", choices=["auto", "openai", "openai-chat"],
                   help="request format; auto: chat when the endpoint contains 'chat'")
    t.add_argument("--model", default=None, help="model name (default: the first id of GET /v1/models)")
    t.add_argument("--tokenizer", default=None,
                   help="tokenizer for the dataset: 'smollm2', a .gguf, a local directory, or 'none' "
                        "(default: the model name if it resolves locally)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="sent as a Bearer token")
    t.add_argument("--header", action="append", default=[], metavar="KEY=VALUE", help="extra HTTP header")
    t.add_argument("--request-timeout", type=float, default=3600.0, help="per-request timeout (s)")
    t.add_argument("--ready-check-timeout", type=float, default=60.0,
                   help="wait up to this long for GET /v1/models to answer (0: skip)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", "--dataset-name", dest="dataset", default="random", help="random | text:FILE")
    d.add_argument("--num-prompts", type=int, default=1000)
    d.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=1024)
    d.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0)
    d.add_argument("--random-prefix-len", type=int, default=0)
    d.add_argument("--seed", type=int, default=0)
    lo = p.add_argument_group("load")
    lo.add_argument("--request-rate", type=_rate, default=float("inf"),
                    help="requests/s (Poisson arrivals); inf sends all at once")
    lo.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    lo.add_argument("--max-concurrency", type=int, default=None, help="client-side cap on requests in flight")
    lo.add_argument("--num-warmups", type=int, default=0)
    s = p.add_argument_group("sampling")
    s.add_argument("--ignore-eos", action="store_true", help="force exactly --output-len tokens")
    s.add_argument("--temperature", type=float, default=None, help="default 0 (greedy)")
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--extra-body", type=_extra_body, default=None,
                   help='JSON merged into every request, e.g. \'{"kv_compression": {"method": "kara"}}\'')
    o = p.add_argument_group("output")
    o.add_argument("--save-result", nargs="?", const="", default=None, metavar="FILE",
                   help="write the JSON result (no FILE: an automatic name in --result-dir)")
    o.add_argument("--result-dir", default=None)
    o.add_argument("--save-detailed", action="store_true", help="keep per-request arrays in the JSON")
    o.add_argument("--plot", default=None, metavar="FILE.png", help="latency distributions and throughput PNG")
    o.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    o.add_argument("--metric-percentiles", default="99")
    o.add_argument("--disable-tqdm", action="store_true")
    o.add_argument("--label", default=None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvllm bench serve", description=__doc__.split("\n\n")[0])
    add_cli_args(p)
    return p


def normalize_args(args: Any) -> argparse.Namespace:
    """Namespace from a Namespace, a dict of option values (missing ones take the defaults) or argv strings."""
    parser = build_parser()
    if isinstance(args, argparse.Namespace):
        base = vars(parser.parse_args([]))
        base.update({k: v for k, v in vars(args).items()})
        ns = argparse.Namespace(**base)
    elif isinstance(args, dict):
        ns = parser.parse_args([])
        for k, v in args.items():
            k = k.replace("-", "_")
            if not hasattr(ns, k):
                raise ValueError(f"unknown bench option {k!r}")
            setattr(ns, k, v)
    else:
        ns = parser.parse_args(list(args))
    if isinstance(ns.extra_body, str):
        ns.extra_body = _extra_body(ns.extra_body)
    if isinstance(ns.request_rate, str):
        ns.request_rate = _rate(ns.request_rate)
    ns.request_rate = float(ns.request_rate)
    headers = {}
    for h in ns.header or []:
        if isinstance(h, str):
            if "=" not in h:
                raise ValueError(f"--header must be KEY=VALUE, got {h!r}")
            k, v = h.split("=", 1)
            headers[k.strip()] = v.strip()
    ns.headers = headers
    if ns.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    return ns


# ============================================================================================== entry
def run_benchmark(args: Any) -> dict[str, Any]:
    """Run the load test and return the result dict (vLLM's keys plus per-request arrays, the failure
    reasons and the prompts). Prints the table; writes --save-result / --plot when given."""
    args = normalize_args(args)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    percentiles = [float(p) for p in str(args.metric_percentiles).split(",") if p.strip()]
    percentile_metrics = [m.strip() for m in str(args.percentile_metrics).split(",") if m.strip()]

    def samples_for(model: str):
        name = args.tokenizer if args.tokenizer is not None else model
        try:
            tokenizer = load_tokenizer(name)
        except Exception as err:
            if args.tokenizer is not None:
                raise
            print(f"note: no local tokenizer for {name!r} ({type(err).__name__}); prompts are random words and "
                  "token counts come from the server's usage")
            tokenizer = None
        return tokenizer, get_samples(args, tokenizer)

    results, duration, model, (tokenizer, samples, chat) = asyncio.run(run_load(args, base_url, samples_for))
    m = calculate_metrics(results, duration, tokenizer, percentiles)
    print(format_table(m, args, percentile_metrics, percentiles), flush=True)

    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if chat else "openai",
        "label": args.label,
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model_id": model,
        "tokenizer_id": args.tokenizer if isinstance(args.tokenizer, str) else (model if tokenizer else None),
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "extra_body": args.extra_body,
        **m,
        "input_lens": [r.prompt_len for r in results],
        "usage_prompt_tokens": [r.usage_prompt_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "chunk_times": [r.chunk_times for r in results],
        "finish_reasons": [r.finish_reason for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
        "prompts": [s.prompt for s in samples],
    }
    if args.save_result is not None:
        path = args.save_result
        if not path:
            conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
            path = f"{args.label or result['backend']}-{args.request_rate}qps{conc}-{model.split('/')[-1]}-" \
                   f"{result['date']}.json"
        if args.result_dir:
            os.makedirs(args.result_dir, exist_ok=True)
            path = os.path.join(args.result_dir, path)
        saved = {k: v for k, v in result.items() if k != "chunk_times"}
        if not args.save_detailed:
            for k in _DETAILED_FIELDS:
                saved.pop(k, None)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(saved, f, indent=2)
        print(f"saved result to {path}")
        result["result_file"] = path
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_results(result, args.plot)
        print(f"saved plot to {args.plot}")
    return result


def main(args: Any = None) -> int:
    import sys

    try:
        result = run_benchmark(args if args is not None else sys.argv[1:])
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0 if result["completed"] > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
