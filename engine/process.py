"""The engine in a process of its own: `ProcessEngine`, the front the HTTP server talks to when it serves with
``--engine-process`` (off by default: `kvllm serve` runs the engine loop in a thread beside the HTTP event loop,
which measured faster on 2 cores, docs/results/engine_process.md; this is how vLLM's engine core runs apart from
its API server).

Why. In one process the engine loop and the HTTP event loop share the GIL: while a handler builds a JSON chunk, the
loop waits for the GIL between two torch ops, and the OpenMP threads wait for the loop; with more cores than the
engine uses, a process of its own frees it from that. Here the child process owns the `Engine` (model, KV pool, step loop); the parent keeps only HTTP work.

Protocol: one duplex pipe of pickled tuples. Parent to child: ``("new", call, prompt, params, request_id)`` (encode
and validate in the child, answered with the token ids or the `InvalidRequestError`), ``("start", call)``,
``("drop", call)`` (made but never started), ``("abort", request_id)``, ``("call", call, name)`` (stats and
friends, CALLS), ``("shutdown",)``. Child to parent: lists of ``("out", call, RequestOutput | exception)``, ``("reply",
call, value, error)``, ``("step", tokens)`` and ``("dead", message)``, one list per wake-up of its sender thread
(one engine step's deltas travel together). A child that exits (or is killed) fails every open request with
`EngineDeadError`; a parent that exits closes the pipe, and the child stops.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import pickle
import queue
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator

from engine.engine import Engine
from engine.errors import EngineDeadError
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.threads import configure_threads

logger = logging.getLogger("kvllm")

#: RPCs the parent may make with ``("call", call, name)`` (no arguments, the answer is picklable)
CALLS = ("stats", "is_healthy", "check_invariants", "reset_stats", "capacity_log_lines")
#: seconds the parent waits for an answer before it declares the child dead (a step never takes this long)
CALL_TIMEOUT_S = 600.0


@dataclass(eq=False)
class RemoteRequest(Request):
    """The parent's view of a request made in the child: ids and params (for logging and usage), no sequences."""
    call: int = -1


def _picklable(item: Any) -> Any:
    try:
        pickle.dumps(item)
        return item
    except Exception:
        return RuntimeError(repr(item))


# -- the child ----------------------------------------------------------------------------------------------
class _StepCounter:
    def __init__(self, outq: queue.SimpleQueue):
        self.outq = outq

    def observe_step(self, num_tokens: int) -> None:
        self.outq.put(("step", num_tokens))


def _send_loop(conn, outq: queue.SimpleQueue) -> None:
    """Sends what the engine thread and the command thread queue, as one list per wake-up."""
    while True:
        batch = [outq.get()]
        while True:
            try:
                batch.append(outq.get_nowait())
            except queue.Empty:
                break
        stop = batch[-1] is None
        batch = [m for m in batch if m is not None]
        try:
            conn.send(batch)
        except Exception:  # an item that does not pickle: send each alone, the bad ones as errors
            for m in batch:
                try:
                    conn.send([m])
                except (BrokenPipeError, EOFError, OSError):
                    return
                except Exception:
                    conn.send([tuple(_picklable(x) for x in m)])
        if stop:
            return


def _child_main(conn, model: str, kwargs: dict, threads: int | None, log_level: int) -> None:
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s %(name)s] %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    # the thread count only: this module's imports loaded torch, so the wait policy is the environment the parent
    # set before its own torch import (server/cli.py), which a spawned child inherits
    configure_threads(threads)
    try:  # built on the thread that steps it: one OpenMP pool (Engine.on_loop_thread)
        engine = Engine.on_loop_thread(model=model, **kwargs)
    except BaseException as err:  # the parent raises it (a bad setting is a ValueError there too)
        conn.send([("failed", _picklable(err))])
        conn.close()
        return
    outq: queue.SimpleQueue = queue.SimpleQueue()
    counter = _StepCounter(outq)
    engine.add_step_observer(counter)
    info = {"model_name": engine.model_name, "max_model_len": engine.max_model_len,
            "model_config": engine.model_config, "config": engine.config, "model_source": engine.model_source,
            "kv_compression_config": engine.kv_compression_config, "tokenizer": engine.tokenizer,
            "kv_cache_format": engine.kv_cache_format}
    conn.send([("ready", info)])
    sender = threading.Thread(target=_send_loop, args=(conn, outq), name="kvllm-engine-send", daemon=True)
    sender.start()
    watch = threading.Thread(target=_watch_health, args=(engine, outq), name="kvllm-engine-health", daemon=True)
    watch.start()
    pending: dict[int, Request] = {}

    def make(call: int, prompt: Any, params: Any, rid: str) -> None:
        try:
            req = engine.new_request(prompt, params, rid)
        except Exception as err:
            outq.put(("reply", call, None, _picklable(err)))
            return
        pending[call] = req
        outq.put(("reply", call, req.prompt_token_ids, None))

    grammars = ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvllm-grammar")
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                break
            kind = msg[0]
            if kind == "new":
                if getattr(msg[3], "structured_outputs", None) is not None:
                    grammars.submit(make, *msg[1:])  # its compile must not hold up the messages behind it
                else:
                    make(*msg[1:])
            elif kind == "start":
                req = pending.pop(msg[1], None)
                if req is None:
                    outq.put(("out", msg[1], EngineDeadError("unknown request (never made, or started twice)")))
                    continue
                req.sink = lambda out, call=msg[1]: outq.put(("out", call, out))
                try:
                    engine._submit(req)
                except EngineDeadError as err:
                    outq.put(("out", msg[1], err))
            elif kind == "drop":
                pending.pop(msg[1], None)
            elif kind == "abort":
                engine.abort(msg[1])
            elif kind == "call":
                _, call, name = msg
                try:
                    value = (len(pending) if name == "pending_requests" else
                             getattr(engine, name)() if name in CALLS else None)
                    outq.put(("reply", call, value, None))
                except Exception as err:
                    outq.put(("reply", call, None, _picklable(err)))
            elif kind == "shutdown":
                break
    finally:
        grammars.shutdown(wait=False, cancel_futures=True)
        engine.shutdown()
        outq.put(None)
        sender.join(timeout=10)
        conn.close()


def _watch_health(engine: Any, outq: queue.SimpleQueue) -> None:
    """Tells the parent once when the step loop died (the loop has already failed its requests)."""
    while engine.is_healthy():
        time.sleep(0.2)
    outq.put(("dead", repr(engine._dead)))


# -- the parent ---------------------------------------------------------------------------------------------
class _Call:
    __slots__ = ("event", "value", "error")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class ProcessEngine:
    """`Engine`'s serving surface (new_request, stream, abort, stats, is_healthy, shutdown, ...) with the engine in
    a child process (module docstring). ``threads``: the child's torch threads (None: every core)."""

    def __init__(self, model: str = "smollm2", threads: int | None = None, **kwargs: Any):
        ctx = mp.get_context("spawn")  # no fork of a process that has loaded torch and its thread pools
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_child_main, name="kvllm-engine-core",
                                 args=(child, model, kwargs, threads, logging.getLogger().getEffectiveLevel()))
        self._proc.start()
        child.close()
        self._calls: dict[int, _Call] = {}
        self._live: dict[int, tuple[RemoteRequest, Any]] = {}  # started requests: (request, sink)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._dead: str | None = None
        self._step_observers: tuple[weakref.ref, ...] = ()
        first = self._recv_first()
        if first[0] == "failed":
            self._proc.join(timeout=10)
            raise first[1]
        info = first[1]
        self.model_name, self.max_model_len = info["model_name"], info["max_model_len"]
        self.model_config, self.config, self.model_source = info["model_config"], info["config"], info["model_source"]
        self.kv_compression_config, self.tokenizer = info["kv_compression_config"], info["tokenizer"]
        self.kv_cache_format = info["kv_cache_format"]
        self._reader = threading.Thread(target=self._read_loop, name="kvllm-engine-recv", daemon=True)
        self._reader.start()

    def _recv_first(self) -> tuple:
        try:
            return self._conn.recv()[0]
        except (EOFError, OSError):
            self._proc.join(timeout=10)
            raise RuntimeError(f"the engine process exited while starting (exit code {self._proc.exitcode}); "
                               f"see its log above") from None

    # -- the pipe --------------------------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine process is not running: {self._dead}")
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (BrokenPipeError, EOFError, OSError) as err:
            self._die(f"the pipe to the engine process broke: {err!r}")
            raise EngineDeadError(f"the engine process is not running: {self._dead}") from None

    def _read_loop(self) -> None:
        while True:
            try:
                batch = self._conn.recv()
            except (EOFError, OSError):
                code = self._proc.exitcode if not self._proc.is_alive() else None
                self._die(f"the engine process exited (exit code {code})")
                return
            for msg in batch:
                self._dispatch(msg)

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "out":
            _, call, out = msg
            with self._lock:
                entry = self._live.get(call)
                ended = isinstance(out, BaseException) or out.finished
                if entry is not None and ended:
                    del self._live[call]
            if entry is None:
                return
            req, sink = entry
            if isinstance(out, BaseException):
                req.error = out
            elif out.finished:
                req.final = out
            sink(out)
            if ended:
                req.done.set()
        elif kind == "reply":
            _, call, value, error = msg
            with self._lock:
                slot = self._calls.pop(call, None)
            if slot is not None:
                slot.value, slot.error = value, error
                slot.event.set()
        elif kind == "step":
            for ref in self._step_observers:
                obs = ref()
                if obs is not None:
                    try:
                        obs.observe_step(msg[1])
                    except Exception:
                        logger.debug("step observer failed", exc_info=True)
        elif kind == "dead":
            self._die(f"the engine loop died: {msg[1]}")

    def _die(self, why: str) -> None:
        """Unhealthy for good: every open request and call ends with EngineDeadError."""
        with self._lock:
            if self._dead is None:
                self._dead = why
            live, self._live = list(self._live.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        err = EngineDeadError(why)
        for req, sink in live:
            req.error = err
            try:
                sink(err)
            except Exception:
                logger.debug("could not deliver an error to %s", req.request_id, exc_info=True)
            req.done.set()
        for slot in calls:
            slot.error = err
            slot.event.set()

    def _call(self, msg_head: str, *rest: Any, call: int | None = None) -> Any:
        """Send ``(msg_head, call, *rest)`` and wait for the child's answer (its error is raised here)."""
        call = next(self._ids) if call is None else call
        slot = _Call()
        with self._lock:
            self._calls[call] = slot
        self._send((msg_head, call, *rest))
        if not slot.event.wait(CALL_TIMEOUT_S):
            self._die(f"no answer from the engine process in {CALL_TIMEOUT_S:.0f} s")
        if slot.error is not None:
            raise slot.error
        return slot.value

    # -- Engine's surface ------------------------------------------------------------------------------------
    def new_request(self, prompt: Any, params: Any = None, request_id: str | None = None) -> RemoteRequest:
        """Encode and validate in the engine process (its `InvalidRequestError` is raised here)."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        call = next(self._ids)
        ids = self._call("new", prompt, params, rid, call=call)
        req = RemoteRequest(rid, prompt if isinstance(prompt, str) else None, ids,
                            params if params is not None else SamplingParams(), [], time.monotonic(), call=call)
        # a request made but never started (another prompt of its HTTP request failed, a 503) is dropped there too
        weakref.finalize(req, self._drop, call, req.done)
        return req

    def _drop(self, call: int, done: threading.Event) -> None:
        with self._lock:
            started = call in self._live or done.is_set()
        if not started and self._dead is None:
            try:
                self._send(("drop", call))
            except EngineDeadError:
                pass

    async def stream(self, prompt: Any, sampling_params: Any = None,
                     request_id: str | None = None) -> AsyncIterator[Any]:
        """Async generator of delta outputs, as `Engine.stream`; closing it early aborts the request."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        req = prompt if isinstance(prompt, RemoteRequest) else self.new_request(prompt, sampling_params, request_id)

        def sink(out: Any) -> None:  # runs on the reader thread
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, out)
            except RuntimeError:  # the consumer's event loop is gone
                self.abort(req.request_id)

        with self._lock:
            self._live[req.call] = (req, sink)
        try:
            self._send(("start", req.call))
        except EngineDeadError:
            with self._lock:
                self._live.pop(req.call, None)
            raise
        try:
            while True:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    return
        finally:
            if not req.done.is_set():
                self.abort(req.request_id)

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except EngineDeadError:
            pass

    def add_step_observer(self, observer: Any) -> None:
        alive = tuple(r for r in self._step_observers if r() is not None)
        self._step_observers = alive + (weakref.ref(observer),)

    def is_healthy(self) -> bool:
        return self._dead is None and self._proc.is_alive()

    def stats(self) -> Any:
        return self._call("call", "stats")

    def reset_stats(self) -> None:
        self._call("call", "reset_stats")

    def check_invariants(self) -> None:
        self._call("call", "check_invariants")

    def capacity_log_lines(self) -> list[str]:
        return self._call("call", "capacity_log_lines")

    def pending_requests(self) -> int:
        """Requests made in the child (`new_request`) and neither started nor dropped yet."""
        return self._call("call", "pending_requests")

    def start(self) -> None:
        """The child's loop runs from the start (kept for `Engine`'s surface)."""

    def shutdown(self) -> None:
        """Stop the child (its loop, its tensor-parallel workers) and wait for it (idempotent)."""
        if self._proc.is_alive() and self._dead is None:
            try:
                self._send(("shutdown",))
            except EngineDeadError:
                pass
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)
        self._die("the engine was shut down")
        self._conn.close()
