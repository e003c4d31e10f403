"""`serve --frontend process`: the HTTP frontend in a process of its own (specdec/server/frontend.py),
over the tiny model's scheduler in this process: the OpenAI client, concurrent greedy requests equal to
single decodes, streaming with usage, a disconnect freeing its row, a full queue (429), health, metrics
and the admin switch answered by the engine, an ordered shutdown, and the frontend's own exit when the
engine goes away. The shared server runs two frontends on one port (`--frontends 2`)."""

from __future__ import annotations

import gc
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from specdec.drafters import build_drafter
from specdec.server.app import AppSettings
from specdec.server.bench import free_port
from specdec.server.frontend import Frontends, ServerOptions
from specdec.server.metrics import parse_metrics
from specdec.server.policy import BatchCosts, SpecPolicy
from specdec.server.scheduler import Codec, Scheduler, SchedulerConfig
from test_server import AUTH, KEY, MODEL, PROMPTS, make_scheduler, model, reference_text, wait_until  # noqa: F401

START_S = 120  # a spawned frontend imports torch, transformers and FastAPI afresh


@contextmanager
def frontend(scheduler, frontends: int = 1, **settings):
    """The scheduler served by frontend processes on a free loopback port: yields (url, Frontends)."""
    port = free_port()
    group = Frontends(scheduler, scheduler.codec.encoder,
                      AppSettings(model_name=MODEL, api_key=KEY, max_body_bytes=4096, **settings),
                      ServerOptions("127.0.0.1", port, "warning", shutdown_timeout=10, frontends=frontends))
    group.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert time.monotonic() < deadline and all(m.process.is_alive() for m in group.members), "a frontend did not start"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:  # 503 until every frontend has started
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield url, group
    finally:
        group.terminate()
        group.exit_code = group.wait()


@pytest.fixture(scope="module")
def served(model):  # noqa: F811
    scheduler = make_scheduler(model, max_queue=4,
                               costs=BatchCosts({1: {1: 1.0, 4: 2.0}, 4: {1: 2.0, 4: 4.0}}))
    with frontend(scheduler, frontends=2, admin=True) as (url, group):
        yield url, scheduler, group


def post(url: str, path: str, body) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=AUTH, timeout=60)


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", headers=AUTH, timeout=10).text)


def test_concurrent_greedy_requests_through_the_openai_client_equal_single_decodes(model, served):  # noqa: F811
    from openai import OpenAI

    url, scheduler, _ = served
    lengths = [24, 12, 30, 17]
    client = OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    with ThreadPoolExecutor(len(lengths)) as pool:
        replies = list(pool.map(lambda pn: client.completions.create(model=MODEL, prompt=pn[0], max_tokens=pn[1], temperature=0),
                                zip(PROMPTS, lengths)))
    assert [r.choices[0].text for r in replies] == [reference_text(model, p, n) for p, n in zip(PROMPTS, lengths)]
    assert sum(r.usage.model_extra["speculation"]["drafted"] for r in replies) > 0
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=9,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 9 and chunks[-2].choices[0].finish_reason == "length"
    wait_until(lambda: scheduler.num_running == 0)


def test_a_disconnect_frees_the_row_in_the_engine(served, monkeypatch):
    url, scheduler, _ = served
    cancelled = 'specdec_requests_total{status="cancelled"}'
    before = metrics(url)
    launch = scheduler.ops.launch
    monkeypatch.setattr(scheduler.ops, "launch", lambda *a: (time.sleep(0.02), launch(*a)))  # outlasts the client's reading
    body = {"prompt": PROMPTS[0], "max_tokens": 240, "temperature": 0, "stream": True}
    with httpx.Client(headers=AUTH, timeout=60) as client:
        with client.stream("POST", url + "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break
            scheduler.pause()  # hold the batch, so the request cannot finish before the frontend notices
            assert scheduler.num_running == 1
    wait_until(lambda: metrics(url)[cancelled] == before[cancelled] + 1)
    scheduler.resume()
    wait_until(lambda: scheduler.num_running == 0)
    assert scheduler.batch.free_slots() == list(range(scheduler.batch.capacity))


def test_a_full_queue_answers_429_and_bad_input_its_4xx(served):
    url, scheduler, _ = served
    scheduler.pause()  # four requests fill the queue of four; the fifth finds it full
    try:
        with ThreadPoolExecutor(4) as pool:
            first = [pool.submit(post, url, "/v1/completions", {"prompt": p, "max_tokens": 4}) for p in PROMPTS[:4]]
            wait_until(lambda: scheduler.num_waiting == 4)
            refused = post(url, "/v1/completions", {"prompt": PROMPTS[4], "max_tokens": 4})
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
            scheduler.resume()
            assert [f.result().status_code for f in first] == [200] * 4
    finally:
        scheduler.resume()
    assert post(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 0}).status_code == 422
    assert post(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 10_000}).status_code == 400
    assert httpx.get(url + "/v1/models", timeout=5).status_code == 401  # no key


def test_health_metrics_and_the_admin_calls_are_the_engines(served):
    url, scheduler, group = served
    health = httpx.get(url + "/health", timeout=5).json()
    assert health["status"] == "ok" and health["drafter"] == "ngram" and health["policy"] == scheduler.policy.name
    seen = metrics(url)
    assert seen["process_resident_memory_bytes"] > 0 and seen["process_cpu_seconds_total"] > 0
    for k in range(2):  # both frontends' memory and CPU, read by the engine whichever frontend answers
        assert seen[f'specdec_frontend_resident_memory_bytes{{frontend="{k}"}}'] > 0
        assert seen[f'specdec_frontend_cpu_seconds_total{{frontend="{k}"}}'] > 0
    assert {f'specdec_gc_collections_total{{generation="{g}"}}' for g in range(3)} <= seen.keys()
    answering = [k for k in range(2) if f'specdec_frontend_gc_collections_total{{generation="0",frontend="{k}"}}' in seen]
    assert len(answering) == 1  # the answering frontend's own collections, labelled
    switched = post(url, "/admin/spec-policy", {"policy": "off"})
    assert switched.status_code == 200 and scheduler.policy.name == "off"
    bad = post(url, "/admin/spec-policy", {"policy": "bogus"})
    assert bad.status_code == 400 and "unknown speculation policy" in bad.json()["error"]["message"]
    post(url, "/admin/spec-policy", {"policy": "on"})
    assert post(url, "/admin/forget", {}).json() == {"drafter": "ngram", "forgets": False}  # it learns nothing across requests


def test_the_frontend_process_freezes_its_heap_when_the_engine_does(model, served):  # noqa: F811
    """`specdec serve` (config.freeze_heap) freezes the frontend process's start-up heap too; a test's does not."""
    unfrozen = min(v for k, v in metrics(served[0]).items() if k.startswith("specdec_frontend_gc_frozen_objects"))
    scheduler = Scheduler(model, build_drafter("none", model), Codec(model.tokenizer), SpecPolicy("off", gamma=1),
                          SchedulerConfig(max_batch=2, context=256, freeze_heap=True))
    try:
        with frontend(scheduler) as (url, _):
            frozen = metrics(url)['specdec_frontend_gc_frozen_objects{frontend="0"}']
    finally:
        gc.unfreeze()  # what this process's engine froze (test_server.py: the serving process's own freeze)
    assert frozen > unfrozen + 1000  # the imports and the app, not a handful of objects


def test_shutdown_drains_and_stops_the_engine_and_a_lost_engine_ends_the_frontend(model):  # noqa: F811
    scheduler = make_scheduler(model)
    with frontend(scheduler) as (url, group):
        assert post(url, "/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 5}).status_code == 200
    assert group.exit_code == 0 and group.members[0].bridge.stopped and not scheduler.thread.is_alive()

    scheduler = make_scheduler(model)
    port = free_port()
    group = Frontends(scheduler, scheduler.codec.encoder, AppSettings(model_name=MODEL),
                      ServerOptions("127.0.0.1", port, "critical"))
    group.start()
    process = group.members[0]
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _healthy(url), timeout=START_S)
    scheduler.pause()  # a request in flight when the engine goes
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4}, timeout=60)
        wait_until(lambda: scheduler.num_waiting == 1)
        pipe = socket.socket(fileno=os.dup(process.conn.fileno()))
        pipe.shutdown(socket.SHUT_RDWR)  # as if the engine process had died: the frontend fails what it holds and exits
        pipe.close()
        reply = held.result()
    assert reply.status_code == 500 and "engine process has ended" in reply.json()["error"]["message"]
    process.process.join(30)
    assert process.process.exitcode is not None
    assert group.wait() == 1 and not scheduler.thread.is_alive()


def test_a_taken_port_is_one_clear_error(model):  # noqa: F811
    from specdec.errors import UserError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=f"cannot listen on 127.0.0.1:{port}"):
            Frontends(make_scheduler(model), model.tokenizer, AppSettings(model_name=MODEL),
                      ServerOptions("127.0.0.1", port, "critical"))


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_a_request_sent_before_the_engine_ends_fails_alike_whether_or_not_it_was_acknowledged():
    """The frontend's side of a lost engine, in process: a submit whose acknowledgement had not come back when
    the pipe closed resolves as accepted, and its request gets the engine's-end error event, as one already
    acknowledged does (the app then answers 500 for both; failing the submit as ShuttingDown answered 503,
    depending on which message won the race)."""
    import asyncio
    import multiprocessing

    from specdec.config import SamplingParams
    from specdec.server.frontend import ENGINE_GONE, RemoteScheduler
    from specdec.server.scheduler import GenerationRequest

    async def lose_the_engine(acknowledged: bool):
        ours, engine = multiprocessing.Pipe()
        remote = RemoteScheduler(ours, None, SchedulerConfig(), vocab_size=8)
        remote.loop = asyncio.get_running_loop()
        events = []
        request = GenerationRequest([1, 2], 4, SamplingParams(), (), emit=events.append)
        submitted = remote.submit(request)
        kind, key, _ = engine.recv()
        assert kind == "submit"
        if acknowledged:
            engine.send(("reply", key, None))
            remote.receive()
        engine.close()
        remote.receive()  # the pipe is closed: engine_gone
        await asyncio.wait_for(submitted, 1)  # no ShuttingDown
        return [e.error for e in events]

    for acknowledged in (True, False):
        assert asyncio.run(lose_the_engine(acknowledged)) == [ENGINE_GONE], acknowledged
