"""The HTTP frontend in a process of its own (`serve --frontend process`, the default on CUDA).

Why: in one process the decode thread and the event loop share the GIL. At 32 clients on an H200 the
event loop writes thousands of stream chunks a second, and each of the decode thread's steps (host work:
launching, reading outcomes, detokenizing, admitting requests) waits its turn for the GIL behind it. A
request's time to first token then grew from 5.3 ms at one client to 12-13 ms at 32 (EAGLE, p50), of
which 3.6 ms was spent between its arrival and its admission, with admission possible during every step
(Scheduler.admit_during). vLLM's API server is a process apart from its engine for the same reason.

Layout. The engine process (the one `serve` started: model, Scheduler, decode thread) spawns the
frontend process (uvicorn, the app of app.py, a copy of the tokenizer to encode prompts) and talks to it
over one pipe:
- frontend -> engine: ("submit", id, Job), ("cancel", id), ("call", id, method, args);
- engine -> frontend: ("events", [(id, Event), ...]) once per hand-over (the decode thread's events of a
  step or a prefill chunk, for every request: Scheduler.hand_over wakes the bridge once), and
  ("reply", id, value), an exception for a call that raised (QueueFull, ShuttingDown, UserError).
The frontend's RemoteScheduler stands in for the Scheduler in create_app; the engine's EngineBridge runs
the calls on the real one. Detokenizing and stop strings stay in the engine, with the decode thread.
`serve --frontends N` starts N such processes (Frontends), each with its pipe and bridge, accepting from
one listening socket the engine binds; /health answers 503 ("starting") until every one has started, and
the scheduler stops once, when the first of them asks on its way out. The engine reads every frontend's
memory and CPU time from /proc for /metrics, whichever frontend answers.

Lifetime. The frontend runs in a process group of its own, so a terminal's Ctrl-C reaches the engine
only, which asks the frontend to shut down (SIGTERM: uvicorn's graceful shutdown, then the scheduler's
drain, through a `stop` call) and exits with it. If the engine dies, the frontend sees the pipe close,
fails what it holds and exits; if the frontend dies, the engine stops the scheduler and exits non-zero.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from functools import partial

from specdec.config import SamplingParams
from specdec.errors import UserError
from specdec.server.app import AppSettings, create_app
from specdec.server.metrics import frontend_usage_lines, gc_pauses
from specdec.server.scheduler import (Codec, Event, GenerationRequest, Scheduler, SchedulerConfig, ShuttingDown,
                                      freeze_heap)

log = logging.getLogger("specdec.server")
# the Scheduler methods the frontend may call
CALLS = ("health", "metrics_text", "switch_policy", "forget_requests", "stop")
ENGINE_GONE = "the engine process has ended; the server must be restarted"


@dataclass(frozen=True)
class Job:
    """A GenerationRequest as it crosses the pipe (without its callbacks)."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    speculate: bool


@dataclass(frozen=True)
class ServerOptions:
    host: str
    port: int
    log_level: str = "info"
    shutdown_timeout: float = 30.0
    frontends: int = 1  # HTTP frontend processes on the port (Frontends)


# ---- the engine process -------------------------------------------------------------------------


class EngineBridge:
    """Engine process: runs one frontend's submits, cancels and calls on the Scheduler, and sends its
    requests' events back, one message per hand-over."""

    def __init__(self, conn, group: Frontends) -> None:
        self.scheduler, self.conn, self.group = group.scheduler, conn, group
        self.sending = threading.Lock()
        self.lock = threading.Lock()  # pending and requests: the decode thread and the bridge thread
        self.pending: list[tuple[int, Event]] = []
        self.requests: dict[int, GenerationRequest] = {}
        self.ready = threading.Event()  # the frontend's app has started
        self.stopped = False  # the frontend's `stop` call has run

    def serve(self) -> None:
        """Answer the frontend until it closes the pipe."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            kind, key, *rest = message
            if kind == "ready":
                self.ready.set()
            elif kind == "submit":
                self.submit(key, *rest)
            elif kind == "cancel":
                with self.lock:
                    request = self.requests.get(key)
                if request is not None:
                    self.scheduler.cancel(request)
            elif kind == "call" and rest[0] == "stop":  # waits for the drain: meanwhile cancels go on
                threading.Thread(target=self.call, args=(key, *rest), name="specdec-stop").start()
            elif kind == "call":
                self.call(key, *rest)

    def submit(self, key: int, job: Job) -> None:
        request = GenerationRequest(job.prompt_ids, job.max_tokens, job.sampling, job.stop, emit=partial(self.put, key),
                                    wake=self.flush, speculate=job.speculate)
        with self.lock:
            self.requests[key] = request
        try:
            self.scheduler.submit(request)
        except Exception as e:  # QueueFull, ShuttingDown: the frontend answers 429 / 503
            with self.lock:
                self.requests.pop(key, None)
            self.send(("reply", key, e))
            return
        self.send(("reply", key, None))

    def call(self, key: int, method: str, args: tuple) -> None:
        if method not in CALLS:
            self.send(("reply", key, ValueError(f"unknown call {method!r}")))
            return
        try:
            if method == "stop":  # every frontend asks it on its way out; the scheduler stops once
                value = self.group.stop_scheduler(*args)
            else:
                value = getattr(self.scheduler, method)(*args)
            if method == "metrics_text":
                value += self.group.usage_text()
            if method == "health" and value["status"] == "ok" and not self.group.ready():
                value = {**value, "status": "starting"}  # 503 until every frontend serves the port
        except Exception as e:
            value = e
        if method == "stop":
            self.stopped = True
        self.send(("reply", key, value))

    def put(self, key: int, event: Event) -> None:
        """Decode thread: queue a request's event (Scheduler.hand_over)."""
        with self.lock:
            self.pending.append((key, event))
            if event.final:
                self.requests.pop(key, None)

    def flush(self) -> None:
        """Decode thread: send the events queued since the last flush, in one message."""
        with self.lock:
            events, self.pending = self.pending, []
        if events:
            self.send(("events", events))

    def send(self, message: tuple) -> None:
        with self.sending:
            try:
                self.conn.send(message)
            except OSError:  # the frontend is gone: the engine process is ending
                log.debug("could not reach the frontend", exc_info=True)


class FrontendProcess:
    """Engine process: one frontend process and the bridge thread that serves it."""

    def __init__(self, group: Frontends, tokenizer, settings: AppSettings, options: ServerOptions, index: int,
                 sock: socket.socket) -> None:
        scheduler = group.scheduler
        context = mp.get_context("spawn")  # never fork a process that holds CUDA
        self.conn, theirs = context.Pipe()
        self.bridge = EngineBridge(self.conn, group)
        self.process = context.Process(target=run_frontend, name=f"specdec-frontend-{index}", daemon=True,
                                       args=(theirs, tokenizer, settings, scheduler.config, scheduler.vocab_size, options,
                                             index, sock))
        self.theirs = theirs
        self.serving = threading.Thread(target=self.bridge.serve, name=f"specdec-bridge-{index}", daemon=True)

    def start(self) -> None:
        self.process.start()
        self.theirs.close()
        self.serving.start()

    def terminate(self) -> None:
        """Ask the frontend to shut down gracefully (it stops the scheduler through the bridge)."""
        if self.process.pid is not None and self.process.exitcode is None:
            os.kill(self.process.pid, signal.SIGTERM)

    def join(self) -> bool:
        """After the process has exited: whether it shut down in order (its `stop` call ran)."""
        self.process.join()
        self.serving.join(timeout=10)  # the pipe has closed: its reader returns
        self.conn.close()
        return self.bridge.stopped


class Frontends:
    """Engine process: the frontend processes (ServerOptions.frontends of them) over one Scheduler. They
    accept connections from one listening socket, bound here (as uvicorn's workers share theirs), so the
    port is taken or refused before any frontend starts, and an idle frontend takes the next connection
    before a busy one. Several pay only where one process's event loop (every request's HTTP, JSON and
    stream chunks) nears a whole core: on an H200 at 32 clients one used about 0.5-0.65 of a core and two
    changed nothing (docs/design.md, "Several frontends"); `bench-serve` reports their CPU per level."""

    def __init__(self, scheduler: Scheduler, tokenizer, settings: AppSettings, options: ServerOptions) -> None:
        self.scheduler = scheduler
        self.stopping = threading.Lock()
        self.scheduler_stopped = False
        self.sock = listen(options.host, options.port)
        self.members = [FrontendProcess(self, tokenizer, settings, options, k, self.sock)
                        for k in range(options.frontends)]

    def start(self) -> None:
        """Start the decode thread (capturing its graphs first), then the frontends and their bridges."""
        self.scheduler.start()
        for member in self.members:
            member.start()

    def ready(self) -> bool:
        """Every frontend's app has started (before, /health answers 503 "starting")."""
        return all(member.bridge.ready.is_set() for member in self.members)

    def stop_scheduler(self, drain_s: float = 0.0) -> None:
        """Drain and stop the scheduler, once, whichever frontend asks first (the others wait for it)."""
        with self.stopping:
            if not self.scheduler_stopped:
                self.scheduler.stop(drain_s)
                self.scheduler_stopped = True

    def usage_text(self) -> str:
        """The frontend processes' memory and CPU, for /metrics (read here: any frontend may answer a scrape)."""
        lines = frontend_usage_lines([member.process.pid for member in self.members])
        return "\n".join(lines) + "\n" if lines else ""

    def terminate(self) -> None:
        for member in self.members:
            member.terminate()

    def wait(self) -> int:
        """Until every frontend has exited. One that ends unexpectedly ends the others and the scheduler. The
        server's exit code: 0 after an ordered shutdown (uvicorn re-raises the signal it shut down on, so a
        frontend's own code is the signal's), else 1."""
        pending = {member.process.sentinel: member for member in self.members}
        failed = False
        while pending:
            for sentinel in mp_connection.wait(list(pending)):
                member = pending.pop(sentinel)
                if not member.join() and not failed:
                    failed = True
                    log.error(f"a frontend process ended unexpectedly (exit code {member.process.exitcode}); stopping")
                    for other in pending.values():
                        other.terminate()
        self.sock.close()
        if failed:
            self.stop_scheduler()
        return 1 if failed else 0


def serve_with_frontend(scheduler: Scheduler, tokenizer, settings: AppSettings, options: ServerOptions) -> int:
    """`specdec serve --frontend process`: serve until a signal, then shut down in order; the exit code."""
    frontends = Frontends(scheduler, tokenizer, settings, options)
    frontends.start()  # a Ctrl-C while it captures the step graphs interrupts it as any command
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: frontends.terminate())
    return frontends.wait()


# ---- the frontend process -----------------------------------------------------------------------


class RemoteScheduler:
    """Frontend process: what create_app uses of a Scheduler, answered by the engine process. Calls that
    need the engine's answer return futures (app.answer awaits them)."""

    def __init__(self, conn, codec: Codec, config: SchedulerConfig, vocab_size: int, index: int = 0) -> None:
        self.conn, self.codec, self.config, self.vocab_size = conn, codec, config, vocab_size
        self.index = index  # which of the server's frontends (Frontends)
        self.keys = itertools.count()
        self.jobs: dict[int, GenerationRequest] = {}  # key -> request, until its last event
        self.key_of: dict[int, int] = {}  # id(request) -> key
        self.replies: dict[int, asyncio.Future] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.lost: str | None = None
        self.on_lost = lambda: None  # the frontend process's shutdown (run_frontend)

    def start(self) -> None:
        """On the event loop (the app's lifespan): read the engine's messages as they come, and say this
        frontend is ready."""
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.conn.fileno(), self.receive)
        self.conn.send(("ready", self.index))

    def stop(self, drain_s: float = 0.0) -> None:
        """From a worker thread (the app's lifespan): the engine drains and stops its scheduler."""
        if self.lost is None:
            asyncio.run_coroutine_threadsafe(self.ask("stop", drain_s), self.loop).result()

    async def ask(self, method: str, *args):
        return await self.call(method, *args)

    def submit(self, request: GenerationRequest) -> asyncio.Future:
        key = next(self.keys)
        self.jobs[key], self.key_of[id(request)] = request, key
        job = Job(request.prompt_ids, request.max_tokens, request.sampling, request.stop, request.speculate)
        return self.send(("submit", key, job), key)

    def cancel(self, request: GenerationRequest) -> None:
        key = self.key_of.get(id(request))
        if key is not None and self.lost is None:
            request.cancelled = True
            self.conn.send(("cancel", key))

    def health(self) -> asyncio.Future:
        if self.lost is not None:
            return self.settled({"status": "error", "error": self.lost})
        return self.call("health")

    def metrics_text(self, model_name: str) -> asyncio.Future:
        """The engine's metrics (with every frontend's memory and CPU) and this process's garbage collections."""
        async def both() -> str:
            text = await self.call("metrics_text", model_name)
            mine = gc_pauses().render("specdec_frontend", "this HTTP frontend process", f'frontend="{self.index}"')
            return text + "\n".join(mine) + "\n"
        return asyncio.ensure_future(both())

    def switch_policy(self, name: str, threshold: int | None = None) -> asyncio.Future:
        return self.call("switch_policy", name, threshold)

    def forget_requests(self) -> asyncio.Future:
        return self.call("forget_requests")

    def call(self, method: str, *args) -> asyncio.Future:
        key = next(self.keys)
        return self.send(("call", key, method, args), key)

    def send(self, message: tuple, key: int) -> asyncio.Future:
        future = self.loop.create_future()
        if self.lost is not None:
            future.set_exception(ShuttingDown(self.lost))
            return future
        self.replies[key] = future
        self.conn.send(message)
        return future

    def settled(self, value) -> asyncio.Future:
        future = self.loop.create_future()
        future.set_result(value)
        return future

    def receive(self) -> None:
        """Event loop: hand out every message waiting on the pipe."""
        try:
            while self.conn.poll():
                kind, body, *rest = self.conn.recv()
                if kind == "events":
                    self.deliver(body)
                else:
                    self.settle(body, rest[0])
        except (EOFError, OSError):
            self.engine_gone()

    def deliver(self, events: list[tuple[int, Event]]) -> None:
        wakes: dict = {}
        for key, event in events:
            request = self.jobs.get(key)
            if request is None:
                continue
            request.emit(event)
            if request.wake is not None:
                wakes[request.wake] = None
            if event.final:
                request.done = True
                del self.jobs[key]
                self.key_of.pop(id(request), None)
        for wake in wakes:
            wake()

    def settle(self, key: int, value) -> None:
        future = self.replies.pop(key, None)
        if future is None or future.done():
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
            if key in self.jobs:  # a refused submit: its request never ran
                self.key_of.pop(id(self.jobs.pop(key)), None)
        else:
            future.set_result(value)

    def engine_gone(self) -> None:
        """The pipe closed: fail every request and pending answer, and shut this process down. A request sent
        to the engine ends by its error event (500) whether or not the engine's acknowledgement of it had come
        back: its submit's answer is settled as accepted, not failed as ShuttingDown (503), which raced the
        acknowledgement (a loaded 2-core CI machine saw 503)."""
        if self.lost is not None:
            return
        self.lost = ENGINE_GONE
        log.critical(self.lost)
        self.loop.remove_reader(self.conn.fileno())
        for key, request in self.jobs.items():
            request.emit(Event(error=self.lost))
            if request.wake is not None:
                request.wake()
            submitted = self.replies.pop(key, None)
            if submitted is not None and not submitted.done():
                submitted.set_result(None)  # as the engine answers an accepted submit (EngineBridge.submit)
        self.jobs.clear()
        for future in self.replies.values():
            if not future.done():
                future.set_exception(ShuttingDown(self.lost))
        self.replies.clear()
        self.on_lost()


def run_frontend(conn, tokenizer, settings: AppSettings, config: SchedulerConfig, vocab_size: int,
                 options: ServerOptions, index: int, sock: socket.socket) -> None:
    """The frontend process: uvicorn serving the app over a RemoteScheduler until SIGTERM or the engine's end."""
    os.setpgrp()  # a terminal's Ctrl-C goes to the engine, which shuts this process down in order
    log_to_stderr(options.log_level)
    gc_pauses()  # counted from here (specdec_frontend_gc_*)
    scheduler = RemoteScheduler(conn, Codec(tokenizer), config, vocab_size, index)
    server = http_server(create_app(scheduler, settings), options)
    if config.freeze_heap:  # as the engine's process does once its graphs are captured (scheduler.freeze_heap)
        freeze_heap()
    scheduler.on_lost = lambda: setattr(server, "should_exit", True)
    server.run(sockets=[sock])


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket on host:port, shared by its frontend processes (a UserError where the
    address cannot be bound: taken, or not this machine's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restart over TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.listen(2048)
    return sock


def http_server(app, options: ServerOptions):
    """uvicorn serving `app` (in either frontend: this process's or the engine's own thread)."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level,
                                         access_log=False, timeout_graceful_shutdown=options.shutdown_timeout))


def log_to_stderr(level: str) -> None:
    """specdec's server notes (graph captures, errors) on stderr, at uvicorn's --log-level."""
    say = logging.StreamHandler(sys.stderr)
    say.setFormatter(logging.Formatter("specdec: %(message)s"))
    logging.getLogger("specdec").addHandler(say)
    logging.getLogger("specdec").setLevel({"TRACE": "DEBUG"}.get(level.upper(), level.upper()))
