"""`specdec serve`: the OpenAI-compatible API on loopback over a tiny random model, continuous batching,
validation, back-pressure, cancellation, failure isolation, metrics and shutdown (the load generator
is tested in test_server_bench.py)."""

from __future__ import annotations

import gc
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
import torch

from conftest import DEVICE, tiny_folder_with_tokenizer, tiny_pair
from specdec import SpecConfig, SpecEngine
from specdec.config import SamplingParams
from specdec.drafters import build_drafter
from specdec.server.app import AppSettings, Reply, create_app, sse
from specdec.server.metrics import parse_metrics
from specdec.adaptive import PRIOR_WEIGHT, STEP_SAMPLES, Acceptance, batch_expected_tokens, blended_rates, expected_tokens
from specdec.batch import TOP_K_BOUND
from specdec.server.policy import EXPLORE_EVERY, REPRICE_EVERY, SWITCH_MARGIN, BatchCosts, SpecPolicy, measure_batch_costs
from specdec.server.scheduler import Codec, Detokenized, Event, GenerationRequest, Scheduler, SchedulerConfig
from test_step import make_drafter

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
PROMPTS = ["the cat sat on the mat", "1 + 2 = 3 , 2 + 3 = 5 , 3 + 4 =", "The Cat sat on",
           "w1 w2 w3 w1 w2 w3 w1", "( 4 * 5 ) / 2 = ?", "cat cat cat the the"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from specdec.models import load_model

    folder = tiny_folder_with_tokenizer(tmp_path_factory.mktemp("server"))
    return load_model(str(folder), dtype="float32", device=DEVICE)


def make_scheduler(model, policy: str = "on", drafter=None, costs: BatchCosts | None = None, max_batch: int = 4,
                   max_queue: int = 16) -> Scheduler:
    return Scheduler(model, drafter or build_drafter("ngram", model), Codec(model.tokenizer),
                     SpecPolicy(policy, gamma=3, threshold=2, costs=costs),
                     SchedulerConfig(max_batch=max_batch, max_queue=max_queue, context=256))


@contextmanager
def serving(scheduler: Scheduler, **settings):
    """The app on a free loopback port, in a uvicorn thread: yields (base url, uvicorn server)."""
    import uvicorn

    app = create_app(scheduler, AppSettings(model_name=MODEL, api_key=KEY, max_body_bytes=4096, **settings))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=10))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + (300 if torch.device(DEVICE).type == "cuda" else 20)  # start captures the step graphs
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join(20)


@pytest.fixture(scope="module")
def server(model):
    scheduler = make_scheduler(model)
    with serving(scheduler) as (url, _):
        yield url, scheduler


def post(url: str, path: str, body, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=AUTH, timeout=60, **kw)


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", headers=AUTH, timeout=10).text)


def wait_until(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def reference_text(model, prompt: str, max_tokens: int) -> str:
    """Plain greedy decoding of one prompt through SpecEngine (drafter none)."""
    ids = model.tokenizer(prompt)["input_ids"]
    return SpecEngine(model, "none").generate([ids], SpecConfig(max_new_tokens=max_tokens)).rows[0].text


# ---- the OpenAI client ---------------------------------------------------------------------------


def test_openai_client_completes_and_streams(server):
    from openai import OpenAI

    url, _ = server
    client = OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                          max_tokens=12, temperature=0)
    text = chat.choices[0].message.content
    assert chat.object == "chat.completion" and chat.choices[0].finish_reason == "length"
    assert text and chat.usage.completion_tokens == 12
    spec = chat.usage.model_extra["speculation"]
    assert spec["steps"] >= 1 and spec["accepted"] <= spec["drafted"]
    assert spec["mean_accepted_length"] == pytest.approx(11 / (spec["steps"] - 1))  # the prefill emits the first

    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                            max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12

    done = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=0)
    assert done.object == "text_completion" and done.usage.completion_tokens == 10
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text


def test_api_key_is_required(server):
    from openai import AuthenticationError, OpenAI

    url, _ = server
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"  # open: for load balancers


def test_sampling_with_a_seed_repeats(server):
    url, _ = server
    body = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "top_k": 20, "seed": 7}
    first, second = (post(url, "/v1/completions", body).json() for _ in range(2))
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert first["usage"]["completion_tokens"] == 16


def test_return_token_ids_gives_the_output_tokens(server, model):
    """vLLM's extension: the non-streamed choice carries the output's token ids (plain greedy decoding's);
    with stream it is refused (400), never silently dropped."""
    url, _ = server
    body = {"prompt": PROMPTS[3], "max_tokens": 20, "temperature": 0, "return_token_ids": True}
    choice = post(url, "/v1/completions", body).json()["choices"][0]
    ids = model.tokenizer(PROMPTS[3])["input_ids"]
    expected = SpecEngine(model, "none").generate([ids], SpecConfig(max_new_tokens=20)).rows[0]
    assert choice["token_ids"] == expected.token_ids and choice["text"] == expected.text
    assert "token_ids" not in post(url, "/v1/completions", {**body, "return_token_ids": False}).json()["choices"][0]
    streamed = post(url, "/v1/completions", {**body, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "return_token_ids"


def test_a_request_can_opt_out_of_speculation(server):
    url, _ = server
    body = {"prompt": PROMPTS[3], "max_tokens": 20, "temperature": 0}
    on, off = post(url, "/v1/completions", body).json(), post(url, "/v1/completions", {**body, "speculate": False}).json()
    assert on["usage"]["speculation"]["drafted"] > 0
    assert off["usage"]["speculation"]["drafted"] == 0 and off["usage"]["speculation"]["mean_accepted_length"] == 1.0
    assert off["choices"][0]["text"] == on["choices"][0]["text"]  # greedy: the same tokens either way


@pytest.mark.parametrize("extra", [{"seed": (1 << 64) - 1}, {"seed": -(1 << 63)}, {"stop": ["a", "b", "c", "d" * 256]},
                                   {"top_k": 10**30}])  # past int64: keeps every token (sampling.TOP_K_CAP)
def test_the_bounds_of_seed_stop_and_top_k_are_accepted(server, extra):
    url, _ = server
    response = post(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0.9, **extra})
    assert response.status_code == 200, response.text


def test_stop_strings_cut_the_text_streamed_or_not(server):
    url, _ = server
    body = {"prompt": PROMPTS[0], "max_tokens": 30, "temperature": 0}
    full = post(url, "/v1/completions", body).json()["choices"][0]["text"]
    stop = full.split()[5]
    assert full.find(stop) > 0
    cut = post(url, "/v1/completions", {**body, "stop": [stop, "never"]}).json()
    assert cut["choices"][0] == {**cut["choices"][0], "text": full[: full.find(stop)], "finish_reason": "stop"}
    assert cut["usage"]["completion_tokens"] < 30
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stop": stop, "stream": True}, headers=AUTH) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full[: full.find(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_events_hand_each_token_once_in_order(model):
    """Every event's token_ids are its own new tokens, fixed once handed over: the first event once held
    the row's live list, which kept growing as the request generated."""
    scheduler = make_scheduler(model)
    events: list[Event] = []
    finished = threading.Event()

    def emit(event: Event) -> None:
        events.append(event)
        if event.final:
            finished.set()

    ids = model.tokenizer(PROMPTS[1])["input_ids"]
    scheduler.start()
    try:
        scheduler.submit(GenerationRequest(ids, 20, SamplingParams(temperature=0.0), (), emit))
        assert finished.wait(60)
    finally:
        scheduler.stop()
    expected = SpecEngine(model, "none").generate([ids], SpecConfig(max_new_tokens=20)).rows[0].token_ids
    assert len(events) > 2 and len(events[0].token_ids) == 1  # the prefill's token alone
    assert [t for event in events for t in event.token_ids] == expected
    assert "".join(event.text for event in events) == model.tokenizer.decode(expected, skip_special_tokens=True)


def grow_and_compare(codec: Codec, ids: list[int], seed: int) -> None:
    """Feed ids to decode_more a few at a time (1-5, as steps emit them): its text is always a prefix of the
    whole decode, and equal to it unless the last character is unfinished."""
    import random

    rng, state, k = random.Random(seed), Detokenized(), 0
    while k < len(ids):
        k = min(len(ids), k + rng.randint(1, 5))
        text, whole = codec.decode_more(state, ids[:k]), codec.decode(ids[:k])
        assert whole.startswith(text), (k, text, whole)
        assert text == whole or whole.endswith("\ufffd"), (k, text, whole)


INCREMENTAL_TEXTS = ["Natalia sold clips to 48 of her friends in April , and then she sold half as many clips in May .",
                     "caf\u00e9 \u6771\u4eac \U0001F642 na\u00efve \u00fcber \u2014 \u00bd",  # multi-byte characters, split across tokens
                     "It ' s don 't , isn ' t it ? Yes ! I 'm sure . They 're here , we 've seen .",  # cleanup patterns
                     "  spaces   and\n\nnewlines\t tabs "]


class CleaningUp:
    """A tokenizer whose decode rewrites across tokens, as HF's clean_up_tokenization_spaces does
    (transformers 5 applies it to WordPiece tokenizers only)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids, **kwargs) -> str:
        text = self.tokenizer.decode(ids, **kwargs)
        for a, b in ((" .", "."), (" ,", ","), (" ?", "?"), (" !", "!"), (" ' ", "'"), (" n't", "n't"), (" 's", "'s")):
            text = text.replace(a, b)
        return text


def test_prompts_are_encoded_while_the_decode_thread_decodes(model):
    """The event loop encodes with a tokenizer of its own: a decode in progress on the decode thread does
    not hold up a new request's prompt (and with it every stream the event loop serves)."""
    codec = Codec(model.tokenizer)
    decoding, release = threading.Event(), threading.Event()
    real = codec.decode_ids

    def slow_decode(ids):
        decoding.set()
        release.wait(10)
        return real(ids)

    codec.decode_ids = slow_decode
    thread = threading.Thread(target=codec.decode, args=([5, 6, 7],))
    thread.start()
    try:
        assert decoding.wait(10)
        encoded = []
        encoder = threading.Thread(target=lambda: encoded.append(codec.encode_text(PROMPTS[0])))
        encoder.start()
        encoder.join(5)
        assert encoded == [model.tokenizer(PROMPTS[0])["input_ids"]]  # done while the decode still waits
    finally:
        release.set()
        thread.join()


def test_the_decode_thread_decodes_with_the_rust_tokenizer_where_it_gives_the_same_text(default_model):
    """Codec decodes with the fast tokenizer's Rust decoder (half the host time of a row's step: 31 -> 17 us
    on a 2-core CPU) only where the Python decode adds nothing: the same text as the Python decode on random
    ids (special ones among them) for the default model's tokenizer; none for a tokenizer that cleans up
    spaces (WordPiece's " ." -> ".")."""
    import random

    from specdec.server.scheduler import direct_decoder

    tokenizer = default_model.tokenizer
    direct = direct_decoder(tokenizer)
    assert direct is not None
    rng, special = random.Random(0), sorted(tokenizer.all_special_ids)
    for _ in range(200):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 12))]
        assert direct(ids) == tokenizer.decode(ids, skip_special_tokens=True), ids

    class FastCleaningUp(CleaningUp):
        backend_tokenizer = tokenizer.backend_tokenizer

        def __call__(self, text, **kwargs):
            return self.tokenizer(text, **kwargs)

    assert direct_decoder(FastCleaningUp(tokenizer)) is None and direct_decoder(CleaningUp(tokenizer)) is None


@pytest.mark.parametrize("cleanup", [False, True], ids=["plain", "cleaning_up"])
def test_incremental_text_equals_the_whole_decode(default_model, cleanup):
    """The server decodes a row's last few tokens per step, not its whole output; its text must be the
    whole decode's, for the default model's byte-level BPE, with multi-byte characters whose bytes span
    tokens, and with a tokenizer that rewrites across tokens (" ." -> ".": decoded whole once there)."""
    tokenizer = default_model.tokenizer
    codec = Codec(CleaningUp(tokenizer) if cleanup else tokenizer)
    for i, text in enumerate(INCREMENTAL_TEXTS):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert i != 1 or any(codec.decode([t]).endswith("\ufffd") for t in ids), "the test needs split characters"
        for seed in range(5):
            grow_and_compare(codec, ids, seed)
    assert not cleanup or codec.decode(tokenizer("a .", add_special_tokens=False)["input_ids"]) == "a."


def whole_text_cut(decode, before: list[int], new: list[int], stops: tuple[str, ...]):
    """cut_at_stop_string as it was: the whole output decoded at every step (the reference)."""
    from specdec.batch import find_stop

    if not new or find_stop(decode(before + new), stops) is None:
        return new, None
    for m in range(1, len(new) + 1):
        text = decode(before + new[:m])
        if find_stop(text, stops) is not None:
            return new[:m], text[:find_stop(text, stops)]


@pytest.mark.parametrize("cleanup", [False, True], ids=["plain", "cleaning_up"])
def test_stop_strings_are_found_from_a_window_as_from_the_whole_text(default_model, cleanup):
    """A step looks for stop strings in a window of the output's last tokens, not in the whole output
    (O(length) per row and step): it must cut where the whole decode cuts, for stop strings of multi-byte
    characters split across tokens, with leading spaces, across a rewriting tokenizer's borders, and late
    in long outputs; and a step that finds none decodes only the window."""
    from specdec.batch import STOP_REACH_MARGIN, STOP_REACH_PER_CHAR, cut_at_stop_string, find_stop

    tokenizer = default_model.tokenizer
    codec = Codec(CleaningUp(tokenizer) if cleanup else tokenizer)
    filler = " ".join([INCREMENTAL_TEXTS[3]] * 12)  # long and free of most stops below: the window is a small part of it
    ids = tokenizer(filler + " " + " ".join(INCREMENTAL_TEXTS), add_special_tokens=False)["input_ids"]
    after_filler = len(tokenizer(filler, add_special_tokens=False)["input_ids"]) - 1
    stops_tried = [("\U0001F642",), (" \u00bd",), (" don",), ("n't",), ("May .", "ü"), ("\n\n",), ("absent",),
                   (ids and codec.decode(ids[-6:]),)]
    gen = torch.Generator().manual_seed(0)
    cuts = 0
    for stops in stops_tried:
        reach = STOP_REACH_PER_CHAR * max(len(s) for s in stops) + STOP_REACH_MARGIN
        for start in (0, after_filler):
            before, at = ids[:start], start
            if find_stop(codec.decode(before), stops) is not None:
                continue  # a row holding a stop string already would have stopped
            while at < len(ids):
                new = ids[at: at + int(torch.randint(1, 5, (1,), generator=gen))]
                lengths = []

                def decode(tokens):
                    lengths.append(len(tokens))
                    return codec.decode(tokens)

                got, expected = cut_at_stop_string(decode, before, new, stops), whole_text_cut(codec.decode, before, new, stops)
                assert got == expected, (stops, start, at)
                if expected[1] is not None:
                    cuts += len(before) > reach  # found through the window of a long output
                    break
                assert max(lengths) <= min(reach, len(before)) + len(new)  # the window only, not the whole output
                before, at = before + new, at + len(new)
    assert cuts >= 5  # stop strings met late in a long output (the test can fail)


def test_incremental_text_of_a_word_level_tokenizer(model):
    codec = Codec(model.tokenizer)
    grow_and_compare(codec, model.tokenizer(" ".join(PROMPTS))["input_ids"], seed=0)

def test_a_step_hands_its_events_over_then_wakes_once(model):
    """The events of one step (or prefill chunk) for several requests go out together, followed by one call
    of the wake they share (the app's wakes its event loop once per step, not once per request)."""
    scheduler = make_scheduler(model, policy="off")
    log: list[str] = []
    finished = threading.Semaphore(0)

    def emit(event: Event) -> None:
        log.append("event")
        if event.final:
            finished.release()

    wake = lambda: log.append("wake")  # noqa: E731 -- one callable shared by both requests
    scheduler.start()
    try:
        scheduler.pause()  # both requests join the same batch
        for prompt in PROMPTS[:2]:
            ids = model.tokenizer(prompt)["input_ids"]
            scheduler.submit(GenerationRequest(ids, 10, SamplingParams(temperature=0.0), (), emit, wake))
        scheduler.resume()
        assert finished.acquire(timeout=60) and finished.acquire(timeout=60)
    finally:
        scheduler.stop()
    groups = "".join("e" if entry == "event" else "|" for entry in log).split("|")
    assert groups[-1] == "" and all(groups[:-1])  # every wake follows the events it announces
    assert max(len(g) for g in groups) == 2  # both rows' events of a step under one wake
    assert log.count("event") == 20


def test_a_request_done_at_its_first_token_takes_no_step(server):
    url, _ = server
    before = metrics(url)
    reply = post(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0}).json()
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 1 and reply["usage"]["speculation"]["steps"] == 1
    after = metrics(url)
    assert after["specdec_steps_total"] == before["specdec_steps_total"]  # the prefill gave its only token
    finished = 'specdec_requests_total{status="finished"}'
    assert after[finished] == before[finished] + 1


@pytest.mark.parametrize("name", ["draft_model", "eagle", "medusa", "lookahead", "layer_skip"])
def test_every_drafter_serves_concurrent_greedy_requests_through_the_openai_client(model, tmp_path, name):
    """Every stateful drafter (ngram is the module's server) joins rows of different lengths mid-flight;
    each text equals plain decoding of its prompt alone, and the drafter really drafted."""
    from openai import OpenAI

    draft = tiny_pair(tmp_path, "llama", seed=1, logit_scale=8.0, num_hidden_layers=1)[0]
    drafter = build_drafter(name, model) if name == "layer_skip" else make_drafter(name, model, draft)
    lengths = [24, 12, 30, 17, 9]
    scheduler = make_scheduler(model, drafter=drafter)
    with serving(scheduler) as (url, _), ThreadPoolExecutor(len(lengths)) as pool:
        client = OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        replies = list(pool.map(lambda pn: client.completions.create(model=MODEL, prompt=pn[0], max_tokens=pn[1], temperature=0),
                                zip(PROMPTS, lengths)))
        wait_until(lambda: not scheduler.running)
    assert [r.choices[0].text for r in replies] == [reference_text(model, p, n) for p, n in zip(PROMPTS, lengths)]
    assert sum(r.usage.model_extra["speculation"]["drafted"] for r in replies) > 0
    if isinstance(scheduler.batch.draft, dict):  # host-side drafter state (lookahead) leaves with its rows
        assert not scheduler.batch.draft


# ---- validation and back-pressure ------------------------------------------------------------


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not valid JSON"),
    ({"model": "gpt-4", "prompt": "the cat"}, 400, "not served here"),
    ({"prompt": "the cat", "max_tokens": 0}, 422, "max_tokens"),
    ({"prompt": "the cat", "max_tokens": 100_000}, 400, "exceed the context"),
    ({"prompt": "the cat", "temperature": -0.5}, 422, "temperature"),
    ({"prompt": "the cat", "top_p": 0}, 422, "top_p"),
    ({"prompt": "the cat", "top_p": 1.5}, 422, "top_p"),
    ({"prompt": "the cat", "min_p": 1.0}, 422, "min_p"),
    ({"prompt": "the cat", "n": 2}, 400, "n must be 1"),
    ({"prompt": "   "}, 400, "empty"),
    ({"max_tokens": 4}, 422, "prompt"),
    ({"prompt": "cat " * 2000}, 413, "exceeds 4096 bytes"),
    ({"prompt": "the cat", "stop": ["a", "b", "c", "d", "e"]}, 422, "at most 4 stop strings"),
    ({"prompt": "the cat", "stop": "x" * 257}, 422, "at most 256 characters"),
    ({"prompt": "the cat", "seed": 1 << 64}, 422, "seed"),
    ({"prompt": "the cat", "seed": -(1 << 63) - 1}, 422, "seed"),
    ({"prompt": "the cat", "logprobs": 2}, 400, "logprobs are not supported"),
])
def test_invalid_requests_get_a_clear_error(server, body, status, words):
    url, _ = server
    if isinstance(body, bytes):
        response = httpx.post(url + "/v1/completions", content=body, headers={**AUTH, "Content-Type": "application/json"})
    else:
        response = post(url, "/v1/completions", body)
    assert response.status_code == status
    assert words in response.json()["error"]["message"]


def test_chat_validation(server):
    url, _ = server
    response = post(url, "/v1/chat/completions", {"messages": [], "max_tokens": 4})
    assert response.status_code == 422 and "messages" in response.json()["error"]["message"]
    response = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "the"}], "max_completion_tokens": 999})
    assert response.status_code == 400 and "context" in response.json()["error"]["message"]


def test_full_queue_answers_429(model):
    scheduler = make_scheduler(model, max_batch=1, max_queue=1)
    with serving(scheduler) as (url, _), ThreadPoolExecutor(1) as pool:
        scheduler.pause()  # nothing is admitted: the first request waits in the queue
        waiting = pool.submit(post, url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
        wait_until(lambda: scheduler.num_waiting == 1)
        refused = post(url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 4})
        assert refused.status_code == 429 and "queue is full" in refused.json()["error"]["message"]
        scheduler.resume()
        assert waiting.result().status_code == 200
        assert metrics(url)['specdec_requests_total{status="rejected"}'] == 1


# ---- continuous batching ---------------------------------------------------------------------


def test_concurrent_requests_equal_single_greedy_decodes(model, server):
    """Rows join and leave a batch of 4 mid-flight (6 requests of different lengths), with ngram
    speculation, every other request opted out of it; each text equals plain decoding of its prompt
    alone (float32, greedy)."""
    url, _ = server
    lengths = [40, 25, 33, 18, 40, 29]
    before = metrics(url)
    bodies = [{"prompt": p, "max_tokens": n, "temperature": 0, "speculate": i % 2 == 0}
              for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda body: post(url, "/v1/completions", body), bodies))
    assert [r.status_code for r in replies] == [200] * len(PROMPTS)
    assert all(r.json()["usage"]["speculation"]["drafted"] == 0 for r in replies[1::2])
    assert any(r.json()["usage"]["speculation"]["drafted"] > 0 for r in replies[::2])
    texts = [r.json()["choices"][0]["text"] for r in replies]
    assert texts == [reference_text(model, p, n) for p, n in zip(PROMPTS, lengths)]
    after = metrics(url)
    steps = after["specdec_batch_size_count"] - before["specdec_batch_size_count"]
    alone = after['specdec_batch_size_bucket{le="1"}'] - before['specdec_batch_size_bucket{le="1"}']
    assert alone < steps  # some steps really ran several rows
    assert after["specdec_accepted_tokens_total"] > before["specdec_accepted_tokens_total"]  # and speculation paid


def pipeline_steps(monkeypatch) -> None:
    """Pipeline every stepper's steps (launch a step before the last is read), as CUDA graphs do for a
    graph-safe drafter."""
    from specdec.step import Stepper

    monkeypatch.setattr(Stepper, "pipelines", lambda self, gamma: True)


def test_a_finished_rows_last_event_goes_out_before_the_step_in_flight_is_read(model, monkeypatch):
    """With steps pipelined (forced on the CPU), the step launched before the read that finishes the last
    row is still in flight when that row finishes; the request's final event (finish reason, usage) must
    go out before the scheduler waits for that step (drain), not after it: on an H200 a drafting step
    takes about 2 ms, which every request at one client would otherwise wait."""
    pipeline_steps(monkeypatch)
    scheduler = make_scheduler(model)
    events: list[Event] = []
    ids = model.tokenizer(PROMPTS[0])["input_ids"]
    scheduler.submit(GenerationRequest(ids, 12, SamplingParams(temperature=0.0), (), events.append))
    out_at_drain = []
    drain = scheduler.drain

    def drain_in_flight() -> None:
        if scheduler.launched:
            out_at_drain.append(any(event.final for event in events))
        drain()

    monkeypatch.setattr(scheduler, "drain", drain_in_flight)
    while scheduler.num_running or scheduler.waiting or scheduler.joining:
        scheduler.turn()
    scheduler.stop()
    assert out_at_drain == [True]
    assert "".join(event.text for event in events) == reference_text(model, PROMPTS[0], 12)


def test_a_pipelined_step_that_finishes_rows_while_the_bucket_shrinks(model, tmp_path, monkeypatch, caplog):
    """With steps pipelined (as under CUDA graphs; forced here on the CPU), the read of the step in flight
    before a smaller bucket's step may finish rows: the next step must be planned on the rows left. Rows
    in slots 0, 1, 2 take one token per step (policy off); slot 2 finishes one step before slot 0, so the
    bucket shrinks from 4 to 2 while the step that finishes slot 0 is in flight. The step was planned on
    the slots from before that read, failed on slot 0 and fell back to row by row."""
    pipeline_steps(monkeypatch)
    draft = tiny_pair(tmp_path, "llama", seed=1, logit_scale=8.0, num_hidden_layers=1)[0]
    scheduler = make_scheduler(model, policy="off", drafter=make_drafter("draft_model", model, draft))
    lengths = [9, 30, 8]
    outputs = {i: [] for i in range(len(lengths))}
    finished = threading.Semaphore(0)

    def emit_to(i: int):
        def emit(event: Event) -> None:
            outputs[i].extend(event.token_ids)
            if event.final:
                finished.release()
        return emit

    scheduler.start()
    try:
        scheduler.pause()  # all three join one batch, in slots 0, 1, 2
        for i, n in enumerate(lengths):
            ids = model.tokenizer(PROMPTS[i])["input_ids"]
            scheduler.submit(GenerationRequest(ids, n, SamplingParams(temperature=0.0), (), emit_to(i)))
        scheduler.resume()
        assert all(finished.acquire(timeout=60) for _ in lengths)
    finally:
        scheduler.stop()
    assert "step failed" not in caplog.text
    expected = SpecEngine(model, "none").generate([model.tokenizer(p)["input_ids"] for p in PROMPTS[:3]],
                                                  SpecConfig(max_new_tokens=30))
    assert [outputs[i] for i in outputs] == [row.token_ids[:n] for row, n in zip(expected.rows, lengths)]


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="the waits are CUDA's")
@pytest.mark.parametrize("drafter", ["none", "eagle", "medusa", "suffix"])
def test_the_decode_loop_waits_for_the_device_only_to_read(model, drafter, caplog):
    """specdec/transfer.py: a host value written into a device tensor through indexing waits for every
    queued kernel, so with a step in flight the host would stall for the rest of it. Under torch's sync
    debug mode, where such a wait raises, rows join in groups, finish at different steps, opt out of
    speculation, sample and end at a stop string while the pipelined batch runs: no turn fails. Rows are
    admitted while a step is in flight, into slots that rows of that step just left: the greedy ones
    still equal plain decoding (a step's outcome goes only to the rows it ran)."""
    scheduler = make_scheduler(model, drafter=make_drafter(drafter, model, None), max_batch=4)
    errors, finished, tokens = [], threading.Semaphore(0), {}

    def emit_to(i: int):
        def emit(event: Event) -> None:
            tokens.setdefault(i, []).extend(event.token_ids)
            if event.error is not None:
                errors.append(event.error)
            if event.final:
                finished.release()
        return emit

    prompts = [model.tokenizer(PROMPTS[i % 3])["input_ids"] for i in range(9)]
    jobs = [GenerationRequest(prompts[i], 8 + 5 * i, SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i),
                              ("e",) if i == 5 else (), emit_to(i), speculate=i % 3 != 2) for i in range(9)]
    scheduler.start()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for job in jobs:
            scheduler.submit(job)
        assert all(finished.acquire(timeout=120) for _ in jobs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        scheduler.stop()
    logged = [caplog.handler.format(r) for r in caplog.records if r.name.startswith("specdec")]
    assert not errors and not logged, (errors, logged)
    plain = SpecEngine(model, "none").generate(prompts[:3], SpecConfig(max_new_tokens=48)).rows
    for i in range(0, 9, 2):  # the greedy ones (none has a stop string)
        assert tokens[i] == plain[i % 3].token_ids[: len(tokens[i])] and len(tokens[i]) in (8 + 5 * i, len(plain[i % 3].token_ids))


def test_disconnect_cancels_the_request_and_frees_its_row(server):
    url, scheduler = server
    before = metrics(url)
    body = {"prompt": PROMPTS[0], "max_tokens": 240, "temperature": 0, "stream": True}
    with httpx.Client(headers=AUTH, timeout=60) as client:
        with client.stream("POST", url + "/v1/completions", json=body) as response:
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data: {")
                if chunks == 2:
                    break
            scheduler.pause()  # hold the batch, so the request cannot finish before the server notices
            assert scheduler.num_running == 1
        # leaving the block closed the connection mid-stream
    cancelled = 'specdec_requests_total{status="cancelled"}'
    wait_until(lambda: metrics(url)[cancelled] == before[cancelled] + 1)
    scheduler.resume()
    wait_until(lambda: scheduler.num_running == 0)
    after = metrics(url)
    assert after["specdec_requests_running"] == 0 and not scheduler.batch.active.any()
    assert scheduler.batch.free_slots() == list(range(scheduler.batch.capacity))
    assert after['specdec_requests_total{status="finished"}'] == before['specdec_requests_total{status="finished"}']
    assert after["specdec_generation_tokens_total"] - before["specdec_generation_tokens_total"] < 240


def test_a_client_gone_before_its_turn_leaves_the_queue(server):
    url, scheduler = server
    cancelled = 'specdec_requests_total{status="cancelled"}'
    before = metrics(url)
    scheduler.pause()  # the request waits in the queue
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8}, headers=AUTH, timeout=0.5)
    assert scheduler.num_waiting == 1
    wait_until(lambda: metrics(url)[cancelled] == before[cancelled] + 1)  # non-streaming: found by polling
    scheduler.resume()
    wait_until(lambda: scheduler.num_waiting == 0 and scheduler.num_running == 0)
    assert metrics(url)["specdec_generation_tokens_total"] == before["specdec_generation_tokens_total"]


class PoisonedDrafter:
    """ngram, except that it raises while an active row's prompt holds the token POISON."""

    name = "ngram"
    graphable = False  # reads the rows back to decide

    def __init__(self, inner, poison: int) -> None:
        self.inner, self.poison = inner, poison

    def __getattr__(self, name):  # shape, attach, join, commit: ngram's
        return getattr(self.inner, name)

    def propose(self, batch, gamma, u):
        active = batch.active.tolist()
        if any(self.poison in row.request.prompt for slot, row in batch.rows.items() if active[slot]):
            raise RuntimeError("poisoned row")
        return self.inner.propose(batch, gamma, u)


def test_a_failing_request_fails_alone(model):
    poison = model.tokenizer("mat")["input_ids"][0]
    scheduler = make_scheduler(model, drafter=PoisonedDrafter(build_drafter("ngram", model), poison))
    with serving(scheduler) as (url, _), ThreadPoolExecutor(2) as pool:
        scheduler.pause()  # both join the same batch
        bad = pool.submit(post, url, "/v1/completions", {"prompt": "the cat sat on the mat", "max_tokens": 20, "temperature": 0})
        good = pool.submit(post, url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0})
        wait_until(lambda: scheduler.num_waiting == 2)
        scheduler.resume()
        assert bad.result().status_code == 500 and "poisoned row" in bad.result().json()["error"]["message"]
        assert good.result().status_code == 200
        assert good.result().json()["choices"][0]["text"] == reference_text(model, PROMPTS[1], 20)
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
        assert metrics(url)['specdec_requests_total{status="failed"}'] == 1


def test_a_lost_device_fails_what_it_holds_and_answers_503(model, monkeypatch):
    """A sticky device error (CUDA: an illegal address poisons every later call) must not leave a server
    that answers every request with a 500 forever: the requests it holds fail with the reason, new ones
    get 503 "device_lost" and /health answers 503 with the reason, so an orchestrator restarts it."""
    import specdec.server.scheduler as scheduler_module

    poison = model.tokenizer("mat")["input_ids"][0]
    scheduler = make_scheduler(model, drafter=PoisonedDrafter(build_drafter("ngram", model), poison))
    lost = "CUDA error: an illegal memory access was encountered"
    monkeypatch.setattr(scheduler_module, "device_problem", lambda device: lost)
    with serving(scheduler) as (url, _):
        bad = post(url, "/v1/completions", {"prompt": "the cat sat on the mat", "max_tokens": 20, "temperature": 0})
        assert bad.status_code == 500 and lost in bad.json()["error"]["message"]
        again = post(url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 5})
        assert again.status_code == 503 and again.json()["error"]["code"] == "device_lost"
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "error" and lost in health.json()["error"]
    monkeypatch.setattr(scheduler_module, "device_problem", lambda device: None)  # an error of one row stays its own
    scheduler = make_scheduler(model, drafter=PoisonedDrafter(build_drafter("ngram", model), poison))
    with serving(scheduler) as (url, _):
        assert post(url, "/v1/completions", {"prompt": "the cat sat on the mat", "max_tokens": 5}).status_code == 500
        assert post(url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 5}).status_code == 200
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"


@pytest.mark.parametrize("chat", [True, False])
def test_text_events_from_the_template_equal_the_rendered_chunks(chat):
    reply = Reply(chat, 'a "model" \x00specdec-text\x00')  # a name holding the template's marker too
    for text in ["", "plain", ' "quoted" \\ back', "new\nline\ttab", "héllo ✓ 😀", "\x00specdec-text\x00"]:
        for first in (True, False):
            assert reply.text_event(text, first) == sse(reply.chunk(text, None, first))


# ---- metrics ---------------------------------------------------------------------------------


def test_an_idle_decode_thread_counts_its_idle_time_as_it_goes(server):
    """/metrics counts the decode thread's idle spell while it lasts: a bench level's scrape after a long idle
    spell once found the whole spell, started before the level, counted in it (57-69 % idle at 32 clients)."""
    url, scheduler = server
    deadline = time.monotonic() + 30
    while (scheduler.num_running or scheduler.num_waiting) and time.monotonic() < deadline:
        time.sleep(0.05)  # a request of an earlier test (a cancelled one) may still hold its row
    idle = 'specdec_decode_thread_seconds_total{part="idle"}'
    before = metrics(url)
    time.sleep(0.3)
    after = metrics(url)
    assert 0.25 <= after[idle] - before[idle] <= 5, (before[idle], after[idle])


def test_metrics_counters_move(server):
    url, _ = server
    before = metrics(url)
    t = time.perf_counter()
    reply = post(url, "/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 20, "temperature": 0}).json()
    reply_seconds = time.perf_counter() - t
    after = metrics(url)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert moved('specdec_requests_total{status="finished"}') == 1
    assert moved("specdec_generation_tokens_total") == 20 == reply["usage"]["completion_tokens"]
    assert moved("specdec_prompt_tokens_total") == reply["usage"]["prompt_tokens"]
    assert moved("specdec_steps_total") == reply["usage"]["speculation"]["steps"] - 1  # prefill is not a batch step
    assert moved("specdec_drafted_tokens_total") == reply["usage"]["speculation"]["drafted"] > 0
    assert moved("specdec_accepted_tokens_total") == reply["usage"]["speculation"]["accepted"]
    assert moved('specdec_drafted_per_position_total{position="1"}') > 0
    assert moved("specdec_time_to_first_token_seconds_count") == 1
    assert moved("specdec_inter_token_latency_seconds_count") == 19
    assert after["specdec_requests_running"] == 0 and after["specdec_requests_waiting"] == 0
    assert after["specdec_tokens_per_second"] > 0 and after["process_resident_memory_bytes"] > 0
    thread = {part: moved(f'specdec_decode_thread_seconds_total{{part="{part}"}}') for part in ("prefill", "wait", "host")}
    assert thread["prefill"] > 0 and thread["host"] > 0 and thread["wait"] >= 0, thread  # (a CPU step waits for nothing)
    assert sum(thread.values()) <= reply_seconds, thread  # no part counted twice
    vllm = f'{{model_name="{MODEL}"}}'  # vLLM's names, for dashboards built for vLLM
    assert moved(f"vllm:spec_decode_num_draft_tokens_total{vllm}") == moved("specdec_drafted_tokens_total")
    assert moved(f"vllm:spec_decode_num_accepted_tokens_total{vllm}") == moved("specdec_accepted_tokens_total")
    assert 0 < moved(f"vllm:spec_decode_num_drafts_total{vllm}") <= moved("specdec_steps_total")  # one row: one draft a step at most
    first = f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{MODEL}",position="0"}}'
    assert first in after and moved(first) == moved('specdec_accepted_per_position_total{position="1"}')



def test_garbage_collections_are_counted_by_generation(server):
    """A collection stops every thread of the serving process, the decode loop's too: /metrics counts them."""
    url, _ = server
    before = metrics(url)
    gc.collect(1)  # the server runs in this process
    after = metrics(url)
    for name in ("collections", "seconds"):
        key = f'specdec_gc_{name}_total{{generation="1"}}'
        assert after[key] > before[key], name


def test_a_serving_process_freezes_its_heap_after_the_first_captures(model):
    """`specdec serve` (config.freeze_heap) moves what start-up built out of the collector's reach; a test's
    scheduler does not (frozen garbage in a cycle is never freed)."""
    for freeze in (False, True):
        scheduler = Scheduler(model, build_drafter("none", model), Codec(model.tokenizer), SpecPolicy("off", gamma=1),
                              SchedulerConfig(max_batch=2, context=256, freeze_heap=freeze))
        before = gc.get_freeze_count()  # not 0 everywhere: on an H200 (torch 2.11) something had frozen 375 objects
        try:
            with serving(scheduler):
                assert (gc.get_freeze_count() > before) == freeze
        finally:
            if freeze:
                gc.unfreeze()

# ---- speculation policies --------------------------------------------------------------------


def linear_costs() -> BatchCosts:
    """Memory-bound at batch 1 (k tokens cost about one), compute-bound at 32 (cost grows with B x k)."""
    return BatchCosts({1: {1: 1.0, 2: 1.02, 3: 1.04, 4: 1.06}, 32: {k: 32.0 * k for k in (1, 2, 3, 4)}})


def rows_accepting(kept: int, n: int) -> Acceptance:
    """n rows that, offered 3 drafts a step, kept `kept` of them 100 times."""
    rows = Acceptance.empty(n, 3)
    for _ in range(100):
        rows.observe(list(range(n)), [3] * n, [kept] * n)
    return rows


def test_cost_policy_speculates_alone_and_stops_in_a_full_batch():
    def first_choice(rows: Acceptance) -> int:
        return SpecPolicy("cost", gamma=3, costs=linear_costs()).choose(rows)

    assert first_choice(rows_accepting(3, 1)) == 3
    assert first_choice(rows_accepting(1, 1)) == 1  # the second draft is always rejected: draft one
    assert first_choice(rows_accepting(1, 32)) == 0  # compute-bound: a draft token costs a full token
    assert first_choice(rows_accepting(0, 1)) == 0  # nothing is ever accepted: drafting cannot pay


def test_a_batch_prices_every_gamma_in_one_pass():
    """`cost` sums each row's expected tokens at every gamma; rows whose rates stop early add nothing past them."""
    rows = np.array([[0.9, 0.5, 0.2, 0.0], [0.3, 0.0, 0.0, 0.0], [0.0] * 4, [1.0, 1.0, 1.0, 1.0]])
    assert batch_expected_tokens(rows, 3) == pytest.approx([4, 4 + 0.9 + 0.3 + 1, 6.2 + 0.45 + 1, 7.65 + 0.09 + 1])
    assert batch_expected_tokens(rows, 3) == pytest.approx([sum(expected_tokens(list(r), g) for r in rows) for g in range(4)])
    assert list(batch_expected_tokens(np.zeros((0, 2)), 2)) == [0.0, 0.0, 0.0]


def test_cost_policy_leaves_its_choice_only_for_a_clearly_faster_gamma():
    """Estimates are medians of a few noisy steps: a gamma estimated less than SWITCH_MARGIN faster does not
    move the choice; one clearly faster does."""
    policy = SpecPolicy("cost", gamma=3, costs=linear_costs())
    assert policy.choose(rows_accepting(3, 1)) == 3 and policy.moved == "switch"  # from gamma 0, where a bucket starts
    rows = rows_accepting(1, 1)  # gamma 1 now wins, by under the margin (1.06 against 1.02 seconds)
    alphas = blended_rates(rows, policy.overall)
    faster = policy.tokens_per_s(alphas, 1, 1) / policy.tokens_per_s(alphas, 3, 1)
    assert 1 < faster < 1 + SWITCH_MARGIN
    assert [policy.choose(rows) for _ in range(8)] == [3] * 8 and policy.moved is None
    for _ in range(STEP_SAMPLES):  # gamma-3 steps measured at twice their prediction, gamma-1 ones at it
        policy.observe_step_time(1, 3, 2 * policy.predicted_step_s(1, 3))
        policy.observe_step_time(1, 1, policy.predicted_step_s(1, 1))
    assert policy.choose(rows) == 1 and policy.moved == "switch"


def test_cost_policy_returns_to_plain_as_soon_as_drafting_stops_paying():
    """Leaving plain decoding needs the margin; returning to it needs none: a drafting gamma measured even
    2 % slower than plain is left at once, and from plain a gamma 2 % faster is not taken."""
    policy = SpecPolicy("cost", gamma=3, costs=linear_costs())
    rows = rows_accepting(3, 1)
    assert policy.choose(rows) == 3 and policy.moved == "switch"
    alphas = blended_rates(rows, policy.overall)
    tokens = batch_expected_tokens(alphas, 3)  # [4]: expected tokens at gamma 0..3
    for _ in range(STEP_SAMPLES):  # gamma 3: 1.02x plain's seconds a token; gamma 1 and 2 dearer still
        policy.observe_step_time(1, 0, 1.0)
        policy.observe_step_time(1, 3, 1.02 * tokens[3])
        for g in (1, 2):
            policy.observe_step_time(1, g, 2.0 * tokens[g])
    assert policy.choose(rows) == 0 and policy.moved == "switch"
    for _ in range(STEP_SAMPLES):  # now gamma 3 is 2 % faster a token than plain: within the margin
        policy.observe_step_time(1, 3, tokens[3] / 1.02)
    assert [policy.choose(rows) for _ in range(8)] == [0] * 8 and policy.moved is None


def test_cost_policy_explores_after_a_run_of_gamma_0():
    """A draft cost that looks prohibitive (a slow first step, say) would keep `cost` at gamma 0 forever;
    after EXPLORE_EVERY steps at 0 one step drafts anyway, so the estimates are measured again."""
    policy = SpecPolicy("cost", gamma=3, costs=linear_costs())
    policy.draft_s_per_row, policy.draft_samples = 100.0, 1
    chosen = [policy.choose(rows_accepting(3, 1)) for _ in range(8 * EXPLORE_EVERY)]
    # an exploration runs STEP_SAMPLES steps; each that changed nothing doubles the wait for the next
    starts = [EXPLORE_EVERY - 1, EXPLORE_EVERY - 1 + STEP_SAMPLES + 2 * EXPLORE_EVERY - 1]
    starts.append(starts[-1] + STEP_SAMPLES + 4 * EXPLORE_EVERY - 1)
    assert [i for i, g in enumerate(chosen) if g] == [i + k for i in starts for k in range(STEP_SAMPLES)]
    assert chosen[EXPLORE_EVERY - 1] == 3  # the best gamma > 0
    fresh, moves = SpecPolicy("cost", gamma=3, costs=linear_costs(), draft_s_per_row=100.0, draft_samples=1), []
    for _ in range(EXPLORE_EVERY + STEP_SAMPLES):
        fresh.choose(rows_accepting(3, 1))
        moves.append(fresh.moved)
    assert [(i, m) for i, m in enumerate(moves) if m] == [(EXPLORE_EVERY - 1, "probe")]  # its other steps: no move
    policy.draft_s_per_row = 0.0  # drafting pays again: the policy drafts once it prices the gammas again
    chosen = [policy.choose(rows_accepting(3, 1)) for _ in range(REPRICE_EVERY + 1)]
    assert chosen[-1] == 3 and chosen.count(3) <= REPRICE_EVERY  # and the wait starts over
    policy.draft_s_per_row = 100.0  # and dear again at once: the move did not hold, and the wait before it stands
    chosen = [policy.choose(rows_accepting(3, 1)) for _ in range(8 * EXPLORE_EVERY)]
    assert [i for i, g in enumerate(chosen) if g][:1] == [8 * EXPLORE_EVERY - 1]


def test_cost_policy_counts_a_switch_it_undoes_as_an_exploration_that_changed_nothing():
    """A probe's lucky steps move `cost` to gamma 1; its next steps are dear and it returns to plain. That
    is an exploration that changed nothing: the next one waits twice EXPLORE_EVERY, as after a probe that
    moved nothing, instead of starting over at EXPLORE_EVERY."""
    policy = SpecPolicy("cost", gamma=1, costs=linear_costs())
    rows = Acceptance(np.full((1, 3), 100.0), np.array([[50.0, 0.0, 0.0]]))  # 1.5 tokens a drafting step
    for _ in range(STEP_SAMPLES):
        policy.observe_step_time(1, 0, 1.0)
        policy.observe_step_time(1, 1, 1.8)  # 1.5 tokens in 1.8 plain steps: plain wins
    chosen = []
    for drafting_s in [1.8] * (EXPLORE_EVERY - 1) + [1.2] * STEP_SAMPLES + [1.8] * (4 * EXPLORE_EVERY):  # a lucky probe
        g = policy.choose(rows)
        policy.observe_step_time(1, g, drafting_s if g else 1.0)
        chosen.append(g)
    starts = [i for i, g in enumerate(chosen) if g and not (i and chosen[i - 1])]  # runs of drafting steps
    assert starts[0] == EXPLORE_EVERY - 1 and chosen[starts[0] + STEP_SAMPLES] == 1  # moved by the lucky probe
    back = chosen.index(0, starts[0] + STEP_SAMPLES)  # and back to plain once gamma 1 measured dear
    assert back - starts[0] < EXPLORE_EVERY // 2
    assert starts[1] - back == 2 * EXPLORE_EVERY - 1  # the wait the probe had doubled, not a fresh one


def test_cost_policy_at_gamma_0_prices_again_when_the_rows_change():
    """At gamma 0 `cost` prices the gammas again every REPRICE_EVERY steps, or at once when the rows' counts
    change (a request joined or left): pricing every plain step left it 1 % behind `off` on a CPU."""
    policy = SpecPolicy("cost", gamma=3, costs=linear_costs())
    assert policy.choose(rows_accepting(0, 1)) == 0  # nothing accepted: plain
    policy.draft_s_per_row, policy.draft_samples = 100.0, 1
    assert policy.choose(rows_accepting(3, 1)) == 0  # the rows changed: priced, and drafting is too dear
    policy.draft_s_per_row = 0.0
    assert [policy.choose(rows_accepting(3, 1)) for _ in range(REPRICE_EVERY + 1)] == [0] * REPRICE_EVERY + [3]
    policy = SpecPolicy("cost", gamma=3, costs=linear_costs())
    assert policy.choose(rows_accepting(0, 1)) == 0
    assert policy.choose(rows_accepting(3, 1)) == 3  # a row that accepts everything joined: drafts at once


def test_cost_policy_keeps_each_buckets_exploration_wait():
    """A batch that drains between bursts passes through small buckets where drafting pays. The full
    bucket's wait must not restart there: one shared record explored the full bucket every
    EXPLORE_EVERY steps (a CPU lost 3-6 % to `off` at 4-16 clients). Here 32 slots never pay (their steps
    are measured dear), and each burst of EXPLORE_EVERY full steps is followed by a lone row that drafts."""
    costs = BatchCosts({1: {1: 1.0, 2: 1.02, 3: 1.04, 4: 1.06}, 32: {k: 32.0 + k for k in (1, 2, 3, 4)}})
    policy = SpecPolicy("cost", gamma=3, costs=costs)
    for _ in range(STEP_SAMPLES):
        policy.observe_step_time(32, 0, 33.0)
        for g in (1, 2, 3):
            policy.observe_step_time(32, g, 33.0 * 2.1)  # 2.1 plain steps for 2 tokens: 2 and 3 could pay
    full, lone = rows_accepting(1, 32), rows_accepting(3, 1)
    drafted = 0
    for _ in range(8):
        for _ in range(EXPLORE_EVERY):
            g = policy.choose(full, slots=32)
            policy.observe_step_time(32, g, 33.0 * (2.1 if g else 1.0))
            drafted += g > 0
        assert policy.choose(lone, slots=1) == 3
    # waits of 64, 128 and 256 steps fit in 8 x 64: three explorations, not eight
    assert drafted == 3 * STEP_SAMPLES


def test_cost_policy_explores_only_what_its_forward_times_could_make_win():
    """Exploring re-measures a shape's steps, not acceptance: where the verify forward alone (as measured at
    start) loses at the rows' acceptance, exploring only costs. Four rows on a 2-core CPU (the default
    model): a gamma-2 step verifies 3 tokens a row at 2.1 plain forwards, and rows accepting 40 % of
    drafts keep 1.56 of them. Perfect acceptance could pay there, which is all `could_pay` asks."""
    policy = SpecPolicy("cost", gamma=3, costs=BatchCosts({4: {1: 1.0, 2: 1.87, 3: 2.13, 4: 2.93}}))
    for _ in range(STEP_SAMPLES):
        policy.observe_step_time(4, 0, 1.2)
    rows = Acceptance(np.full((4, 3), 100.0), np.full((4, 3), 40.0))
    assert all(policy.could_pay(4, g) for g in (1, 2, 3))
    assert [policy.choose(rows, slots=4) for _ in range(8 * EXPLORE_EVERY)] == [0] * (8 * EXPLORE_EVERY)
    alphas = rows_accepting(3, 4).rates(np.full(3, 0.5), PRIOR_WEIGHT)
    assert policy.worth_exploring(alphas, 4, 2, 0)  # rows that keep every draft: gamma 2 could win


def test_cost_policy_never_explores_a_shape_measured_too_dear_to_pay():
    """Where a drafting step was measured at g + 1 plain steps or more, or its verify forward costs g + 1
    plain forwards (a full batch on a CPU), not even perfect acceptance pays: exploring it only costs. A
    cheaper gamma is still explored."""
    policy = SpecPolicy("cost", gamma=3, costs=linear_costs())
    policy.draft_s_per_row, policy.draft_samples = 100.0, 1
    for _ in range(STEP_SAMPLES):
        policy.observe_step_time(1, 0, 1.0)
        for g in (2, 3):
            policy.observe_step_time(1, g, g + 1.0)
    assert not policy.could_pay(1, 3) and not policy.could_pay(1, 2) and policy.could_pay(1, 1)  # 1: unmeasured
    chosen = [policy.choose(rows_accepting(3, 1)) for _ in range(EXPLORE_EVERY + STEP_SAMPLES)]
    assert [(i, g) for i, g in enumerate(chosen) if g] == [(EXPLORE_EVERY - 1 + k, 1) for k in range(STEP_SAMPLES)]
    for _ in range(STEP_SAMPLES):
        policy.observe_step_time(1, 1, 2.5)
    assert [policy.choose(rows_accepting(3, 1)) for _ in range(8 * EXPLORE_EVERY)] == [0] * (8 * EXPLORE_EVERY)
    # compute-bound (32 rows of linear_costs: k tokens cost k forwards): nothing is explored, measured or not
    assert not any(policy.could_pay(32, g) for g in (1, 2, 3))
    assert [policy.choose(rows_accepting(3, 32)) for _ in range(2 * EXPLORE_EVERY)] == [0] * (2 * EXPLORE_EVERY)


def test_cost_policy_decides_from_measured_step_times():
    """Predicted from forward times, speculating pays alone; measured whole steps can say otherwise."""
    policy = SpecPolicy("cost", gamma=3, costs=linear_costs())
    rows = rows_accepting(3, 1)
    for _ in range(STEP_SAMPLES):
        policy.observe_step_time(1, 0, 2.0)  # every step takes twice its forward (host work, say)
    assert policy.steps.overhead[1] == pytest.approx(2.0)
    assert policy.step_seconds(1, 2) == pytest.approx(2 * policy.predicted_step_s(1, 2))  # unmeasured: scaled
    assert policy.choose(rows) == 3  # the same overhead everywhere changes nothing
    for _ in range(STEP_SAMPLES):
        policy.observe_step_time(1, 3, 20.0)  # but drafting steps are slow in practice
    assert policy.step_seconds(1, 3) == 20.0  # measured
    assert policy.choose(rows) == 0


def test_cost_policy_measures_a_shape_again_after_a_slow_start():
    """Gamma 3's first steps ran slow (a stall), so `cost` settled on gamma 1; a measured shape is only
    measured again when chosen, so without exploring from gamma 1 it would stay there. Exploring drops
    gamma 3's old times and runs STEP_SAMPLES steps of it, and the policy returns to it once they are
    measured."""
    policy = SpecPolicy("cost", gamma=3, costs=linear_costs())
    rows = rows_accepting(3, 1)
    for _ in range(STEP_SAMPLES):
        policy.observe_step_time(1, 0, 1.0)
        policy.observe_step_time(1, 1, 1.1)
        policy.observe_step_time(1, 2, 5.0)
        policy.observe_step_time(1, 3, 3.5)  # slow start: 3.5 plain steps for at most 4 tokens
    chosen = [policy.choose(rows) for _ in range(EXPLORE_EVERY)]
    assert chosen[:-1] == [1] * (EXPLORE_EVERY - 1) and chosen[-1] == 3  # explored: the best other gamma
    assert policy.steps.measured(1, 3) is None  # its old times are gone: measured afresh by the exploration
    policy.observe_step_time(1, 3, 1.2)
    for _ in range(STEP_SAMPLES - 1):
        assert policy.choose(rows) == 3
        policy.observe_step_time(1, 3, 1.2)  # what a step of gamma 3 really costs
    assert policy.steps.measured(1, 3) == pytest.approx(1.2) and policy.choose(rows) == 3


def test_cost_policy_prices_a_step_by_the_slots_it_computes():
    """One row left in a bucket of 32 slots: the captured step still computes 32 rows, compute-bound in
    linear_costs, so drafting does not pay there though it would for a lone row in a bucket of 1; the
    times measured for a bucket serve every row count in it."""
    policy = SpecPolicy("cost", gamma=3, costs=linear_costs())
    assert policy.choose(rows_accepting(3, 1)) == 3 and policy.choose(rows_accepting(3, 1), slots=32) == 0
    for _ in range(STEP_SAMPLES):
        policy.observe_step_time(32, 0, 40.0)
        policy.observe_step_time(32, 3, 41.0)  # measured: drafting costs next to nothing in this bucket
    assert policy.choose(rows_accepting(3, 20), slots=32) == 3 and policy.choose(rows_accepting(3, 5), slots=32) == 3


@pytest.mark.skipif(torch.device(DEVICE).type == "cuda", reason="a CPU step runs in its launch; a graphed one replays "
                    "without run_phases, and a pipelined one is timed from the last read (Stepper.read)")
def test_cost_policy_times_the_whole_step_launch_included(model, monkeypatch):
    """On the CPU a step runs inside its launch: the step time the cost policy learns from must include it
    (it once started the clock after the launch, and learned ~0.1 ms steps that took 50 ms)."""
    from specdec.step import Stepper

    scheduler = make_scheduler(model, policy="cost", costs=linear_costs())
    seen: list[float] = []
    observe, run_phases = scheduler.policy.observe_step_time, Stepper.run_phases

    def slow_phases(*args, **kwargs):
        time.sleep(0.03)
        return run_phases(*args, **kwargs)

    scheduler.policy.observe_step_time = lambda B, g, seconds: (seen.append(seconds), observe(B, g, seconds))
    monkeypatch.setattr(Stepper, "run_phases", slow_phases)
    finished = threading.Event()
    ids = model.tokenizer(PROMPTS[1])["input_ids"]
    scheduler.start()
    try:
        scheduler.submit(GenerationRequest(ids, 6, SamplingParams(temperature=0.0), (),
                                           lambda event: event.final and finished.set()))
        assert finished.wait(60)
    finally:
        scheduler.stop()
    assert seen and min(seen) >= 0.03


@pytest.mark.skipif(torch.device(DEVICE).type == "cuda", reason="a CPU step runs in its launch (run_phases)")
def test_a_step_timed_across_a_compile_teaches_the_servers_cost_policy_nothing(model, monkeypatch):
    """Each step here counts as one during which torch compiled a graph (StepReport.compiled): the cost
    policy learns neither its time nor its drafting time, while the steps still run and hand tokens out.
    Without the flag the same steps are learnt (test_cost_policy_times_the_whole_step_launch_included)."""
    from torch._dynamo.utils import counters

    from specdec.step import Stepper

    scheduler = make_scheduler(model, policy="cost", costs=linear_costs())
    learnt, drafted, run_phases = [], [], Stepper.run_phases
    observe_time, observe = scheduler.policy.observe_step_time, scheduler.policy.observe_step

    def compiling_phases(*args, **kwargs):
        counters["stats"]["unique_graphs"] += 1
        return run_phases(*args, **kwargs)

    monkeypatch.setattr(Stepper, "run_phases", compiling_phases)
    scheduler.policy.observe_step_time = lambda B, g, seconds: (learnt.append(seconds), observe_time(B, g, seconds))
    scheduler.policy.observe_step = lambda budgets, accepted, draft_s: (drafted.append(draft_s),
                                                                        observe(budgets, accepted, draft_s))
    events = []
    ids = model.tokenizer(PROMPTS[1])["input_ids"]
    scheduler.submit(GenerationRequest(ids, 12, SamplingParams(temperature=0.0), (), events.append))
    while scheduler.num_running or scheduler.waiting or scheduler.joining:
        scheduler.turn()
    scheduler.stop()
    assert events and events[-1].final and drafted  # steps ran and were counted
    assert not learnt and set(drafted) == {None} and scheduler.policy.draft_samples == 0


def test_a_step_cut_to_what_was_drafted_offers_only_the_width_it_verified(model):
    """A host drafter's chain step is cut to what its rows drafted (step.narrow), down to a plain step where
    none drafted. Acceptance counts only the slots such a step verified: counting the cut ones as rejected
    made `cost` price `suffix` (and n-grams on the CPU) by drafts they never made."""
    scheduler = make_scheduler(model, policy="on", drafter=build_drafter("suffix", model))
    ran, offered = [], []
    read, observe = scheduler.ops.read, scheduler.policy.observe_step
    # a step whose rows all finished before it was read (drafting ahead on a GPU) counts nowhere
    scheduler.ops.read = lambda n: (report := read(n), report.rows and ran.append(report.gamma))[0]
    scheduler.policy.observe_step = lambda budgets, accepted, draft_s: (offered.append(max(budgets)),
                                                                        observe(budgets, accepted, draft_s))
    ids = model.tokenizer(PROMPTS[1])["input_ids"]
    scheduler.submit(GenerationRequest(ids, 24, SamplingParams(temperature=0.0), (), lambda event: None))
    while scheduler.num_running or scheduler.waiting or scheduler.joining:
        scheduler.turn()
    scheduler.stop()
    assert len(ran) == len(offered) and any(g < scheduler.policy.gamma for g in ran)  # some steps were cut
    assert all(o <= g for o, g in zip(offered, ran))  # less only where the row's room ran out


def test_each_policy_names_the_gammas_it_may_choose():
    assert SpecPolicy("off", gamma=3).gammas() == [0]
    assert SpecPolicy("on", gamma=3).gammas() == [0, 3]
    assert SpecPolicy("batch-threshold", gamma=3).gammas() == [0, 3]
    assert SpecPolicy("cost", gamma=3, costs=linear_costs()).gammas() == [0, 1, 2, 3]


@pytest.mark.skipif(torch.device(DEVICE).type != "cuda", reason="CUDA graphs")
def test_the_server_captures_its_policys_step_shapes_before_serving(model):
    """`cost` moves between gammas; a shape captured mid-serving stalls every row, so the decode thread
    captures each bucket's steps at every gamma the policy may choose first, and again after a switch."""
    scheduler = make_scheduler(model, policy="cost", costs=linear_costs())
    scheduler.start()  # returns once the decode thread has captured
    try:
        assert scheduler.captured_for == ("cost", 3)
        for n in scheduler.ops.buckets():
            keys = set(scheduler.ops.stepper(n).captured)
            assert {(g, s, 0) for g in range(4) for s in (False, True)} | {(g, True, TOP_K_BOUND) for g in range(4)} <= keys, n
    finally:
        scheduler.stop()


def test_cost_policy_predicts_a_tree_step_by_its_nodes():
    """Before a shape is measured, a step of a tree drafter is predicted from the forward over its nodes."""
    chain = SpecPolicy("cost", gamma=3, costs=linear_costs())
    tree = SpecPolicy("cost", gamma=3, costs=linear_costs(), widths={0: 0, 1: 2, 2: 3, 3: 3})
    assert chain.predicted_step_s(32, 1) == pytest.approx(64.0)  # 32 rows x 2 tokens
    assert tree.predicted_step_s(32, 1) == pytest.approx(96.0)  # 32 rows x 3 tokens
    assert tree.predicted_step_s(32, 0) == chain.predicted_step_s(32, 0)

def test_fixed_policies():
    rows = Acceptance.empty(3, 3)
    assert SpecPolicy("off", gamma=3).choose(rows) == 0
    assert SpecPolicy("on", gamma=3).choose(rows) == 3
    assert SpecPolicy("batch-threshold", gamma=3, threshold=3).choose(rows) == 3
    assert SpecPolicy("batch-threshold", gamma=3, threshold=2).choose(rows) == 0


def test_measured_costs_cover_the_grid(model):
    costs = measure_batch_costs(model, [1, 4], [1, 3], context=16, repeats=1)
    assert set(costs.seconds) == {1, 4} and all(set(ks) == {1, 3} for ks in costs.seconds.values())
    assert costs.forward_s(2, 2) > 0


# ---- shutdown, CLI and the load generator -----------------------------------------------------


def test_graceful_shutdown_finishes_in_flight_requests(model):
    scheduler = make_scheduler(model)
    with serving(scheduler) as (url, server):
        body = {"prompt": PROMPTS[0], "max_tokens": 120, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            server.should_exit = True  # shut down mid-stream
            rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert not scheduler.thread.is_alive()


def test_serve_cli_errors_are_one_line(capsys, monkeypatch):
    import specdec.server.cli as server_cli
    from specdec.cli import main

    assert main(["serve", "--drafter", "eagles"]) == 2
    assert "unknown drafter 'eagles'" in capsys.readouterr().err
    assert main(["serve", "--spec-policy", "sometimes"]) == 2
    assert "unknown speculation policy" in capsys.readouterr().err
    assert main(["serve", "--gamma", "0"]) == 2
    assert "gamma must be >= 1, got 0" in capsys.readouterr().err
    assert main(["serve", "--frontends", "2", "--frontend", "thread"]) == 2
    assert "--frontends N > 1 starts frontend processes" in capsys.readouterr().err
    real = server_cli.importlib.util.find_spec
    monkeypatch.setattr(server_cli.importlib.util, "find_spec", lambda name: None if name == "fastapi" else real(name))
    assert main(["serve"]) == 2
    assert "pip install 'specdec[serve]'" in capsys.readouterr().err


def test_serve_drafts_an_eagle_trees_whole_depth_on_a_gpu_by_default():
    from types import SimpleNamespace

    from specdec.server.cli import DEFAULT_GAMMA, default_gamma

    eagle = SimpleNamespace(tree=SimpleNamespace(depth=5))
    assert default_gamma("eagle", eagle, torch.device("cuda")) == default_gamma("eagle3", eagle, torch.device("cuda")) == 5
    assert default_gamma("eagle", eagle, torch.device("cpu")) == DEFAULT_GAMMA == 4  # its CPU chain pays shallow
    assert default_gamma("ngram", None, torch.device("cuda")) == DEFAULT_GAMMA


def test_importing_specdec_does_not_import_the_server_stack():
    code = "import sys, specdec, specdec.cli; specdec.cli.build_parser(); print('fastapi' in sys.modules, 'uvicorn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_min_p_reaches_the_sampler():
    from specdec.server.app import SamplingFields, sampling_params

    assert sampling_params(SamplingFields(temperature=0.8, min_p=0.05)).min_p == 0.05
    assert sampling_params(SamplingFields()).min_p == 0.0
