"""The engine's own thread: requests are queued to it, outputs come back through callbacks.

Only this thread touches the engine. Other threads (the HTTP server's event loop) `submit`,
`abort` and `call` by putting commands in a queue that the thread drains between steps, so
requests join and leave the running batch at step boundaries. While nothing is running the
thread sleeps on the queue. A request whose sampling or stop rules fail (inf/NaN logits, say) is
failed alone inside the step; an exception that escapes a step (the batch's forward pass) fails
the running requests with an error, leaves the queued ones waiting, and the loop carries on.

CPU threads (`EngineLoop.build`): the server builds the engine in the engine thread itself and gives
it the process's compute threads, the other threads one each. PyTorch's CPU kernels run in
OpenMP teams, one pool of threads per thread that starts parallel work; with GNU OpenMP, once the
process holds more such threads than cores, every idle team thread stops spinning almost at once
and sleeps, and each of the hundreds of parallel regions of a decode step then waits for its team
to wake. A model loaded on the main thread and served from this one is two pools: a one-row
decode step ran markedly slower in this thread than on the main thread, and as fast once the main
thread started no team of its own (docs/benchmarks/2026-11-27-serving-vs-vllm-4-attention-kernel.md,
"The engine's OpenMP threads").
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import torch

from tessera.config.errors import TesseraError
from tessera.infer.engine.checked_request import CheckedRequest
from tessera.infer.engine.llm_engine import LLMEngine
from tessera.infer.engine.sequence import RequestOutput
from tessera.infer.engine.step_profile import note_submission
from tessera.infer.sampling.params import SamplingParams

log = logging.getLogger("tessera.infer")
OutputCallback = Callable[[RequestOutput], None]


def _use_threads(n: int) -> None:
    """This thread's PyTorch CPU ops run on `n` threads from now on. PyTorch sets a thread's OpenMP
    team size once, when the thread first asks for it, to the last `torch.set_num_threads` value of
    any thread; asking first (`get_num_threads`) makes that happen now, so that the value set next
    is this thread's whatever another thread sets later."""
    torch.get_num_threads()
    torch.set_num_threads(n)


class EngineLoop:
    def __init__(self, engine: LLMEngine | None):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tessera-engine", daemon=True)
        self.step_errors = 0

    @classmethod
    def build(cls, make_engine: Callable[[], LLMEngine], threads: int) -> EngineLoop:
        """Start the engine thread, build the engine there with `make_engine()` on `threads` CPU
        threads, and return once it serves; an exception while building is raised here. The calling
        thread is left one CPU thread (module docstring: one OpenMP pool in the process, the engine's)."""
        _use_threads(1)
        loop = cls(None)
        built: concurrent.futures.Future = concurrent.futures.Future()

        def build_then_run() -> None:
            try:
                _use_threads(threads)
                loop.engine = make_engine()
            except BaseException as e:  # handed to the caller, who raises it
                built.set_exception(e)
                return
            built.set_result(None)
            loop._run()

        loop._thread = threading.Thread(target=build_then_run, name="tessera-engine", daemon=True)
        loop._thread.start()
        built.result()
        return loop

    # ---- called from any thread ----------------------------------------------------------------
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, prompt_ids: list[int] | CheckedRequest, params: SamplingParams, adapter: str | None,
               callback: OutputCallback, images: list | None = None) -> str:
        """Queue a request (`images`: its pixel values; `LLMEngine.add_request` checks it, or queues
        it as it is when it is a `CheckedRequest`); `callback` gets every RequestOutput, in the
        engine thread."""
        request_id = f"req-{uuid.uuid4().hex}"
        callback = note_submission(request_id, callback)  # as it is unless a recorded HTTP request sent it
        self._inbox.put(("add", request_id, prompt_ids, params, adapter, callback, images))
        return request_id

    def submit_checked(self, request: CheckedRequest, callback: OutputCallback) -> str:
        """Queue a request `LLMEngine.check_request` has checked in the caller's thread: the engine
        thread queues it without checking it again."""
        return self.submit(request, request.params, request.adapter, callback)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` in the engine thread between steps (e.g. to load a LoRA adapter)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, future))
        return future

    # ---- the engine thread ---------------------------------------------------------------------
    def _deliver(self, out: RequestOutput) -> None:
        callback = self._callbacks.get(out.request_id)
        if out.finished:
            self._callbacks.pop(out.request_id, None)
        if callback is not None:
            try:
                callback(out)
            except Exception:  # a client's callback must not stop the engine
                log.exception("output callback failed for %s", out.request_id)

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, request_id, prompt_ids, params, adapter, callback, images = cmd
            try:
                self.engine.add_request(prompt_ids, params, adapter, request_id, images=images)
                self._callbacks[request_id] = callback
            except TesseraError as e:
                ids = prompt_ids.prompt_ids if isinstance(prompt_ids, CheckedRequest) else prompt_ids
                callback(RequestOutput(request_id, [], "", "", [], True, "error", len(ids), str(e)))
        elif kind == "abort":
            out = self.engine.abort(cmd[1])
            if out is not None:
                self._deliver(out)
        elif kind == "call":
            _, fn, future = cmd
            try:
                future.set_result(fn(self.engine))
            except BaseException as e:  # handed back to the caller
                future.set_exception(e)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                cmd = self._inbox.get(block=not self.engine.has_unfinished())
            except queue.Empty:
                cmd = None
            while cmd is not None:
                try:
                    self._handle(cmd)
                except Exception:  # a bad command must not end the loop
                    log.exception("engine command %s failed", cmd[0])
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._stopping.is_set() or not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:
                self.step_errors += 1
                log.error("engine step failed; failing the running requests:\n%s", traceback.format_exc())
                outputs = self.engine.fail_running(f"internal error: {type(e).__name__}: {e}")
            for out in outputs:
                self._deliver(out)
        for out in self.engine.fail_all("server shutting down"):
            self._deliver(out)
