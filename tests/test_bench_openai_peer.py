"""The `openai:URL` bench peer: its URL forms, the vLLM spec-decode metrics parser on sample text, one-line
errors (unreachable, not JSON, unknown model), and a bench run against `specdec serve` on loopback whose
outputs equal specdec plain's and whose server metrics are read."""

from __future__ import annotations

import http.server
import json
import socket
import threading

import pytest

from conftest import DEVICE, tiny_folder_with_tokenizer
from specdec.bench.peers import (OpenAIPeer, SpecDecodeCounters, parse_openai_peer, parse_spec_decode_metrics,
                                 spec_decode_delta, token_ids_of)
from specdec.bench.runner import BenchConfig
from specdec.errors import UserError

VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="x"} 40.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="x"} 10.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="other"} 999.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="x"} 1.7e+09
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="x"} 120.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="x"} 30.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="x"} 70.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="x"} 20.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="x",position="0"} 35.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="x",position="1"} 22.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="x",position="2"} 13.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="x",position="0"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="x",position="1"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="x",position="2"} 4.0
vllm:num_requests_running{engine="0",model_name="x"} 0.0
"""


# ---- the metrics parser ---------------------------------------------------------------------------


def test_parser_sums_engines_of_the_model_and_reads_positions():
    c = parse_spec_decode_metrics(VLLM_METRICS, model="x")
    assert (c.drafts, c.draft_tokens, c.accepted_tokens) == (50.0, 150.0, 90.0)
    assert c.accepted_per_position == [45.0, 28.0, 17.0]


def test_parser_without_a_model_sums_every_series_and_finds_none_in_other_text():
    assert parse_spec_decode_metrics(VLLM_METRICS).drafts == 1049.0
    assert parse_spec_decode_metrics(VLLM_METRICS, model="not-labelled").drafts == 1049.0  # no series names it
    assert parse_spec_decode_metrics("# HELP x y\nvllm:num_requests_running 0\n") is None
    assert parse_spec_decode_metrics("") is None


def test_parser_reads_specdec_serves_own_format():
    """`specdec serve` writes the counters as integers, with only a model_name label."""
    text = ('vllm:spec_decode_num_drafts_total{model_name="tiny"} 4\n'
            'vllm:spec_decode_num_draft_tokens_total{model_name="tiny"} 12\n'
            'vllm:spec_decode_num_accepted_tokens_total{model_name="tiny"} 5\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="1"} 2\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"} 3\n')
    c = parse_spec_decode_metrics(text, "tiny")
    assert (c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_position) == (4, 12, 5, [3, 2])


def test_deltas_give_the_servers_acceptance_and_mean_accepted_length():
    before = SpecDecodeCounters(10, 30, 15, [8, 5, 2])
    after = parse_spec_decode_metrics(VLLM_METRICS, "x")  # 50, 150, 90, [45, 28, 17]
    d = spec_decode_delta(before, after)
    assert (d["drafts"], d["draft_tokens"], d["accepted_tokens"]) == (40, 120, 75)
    assert d["acceptance_rate"] == pytest.approx(75 / 120)
    assert d["mean_accepted_length"] == pytest.approx(1 + 75 / 40)
    assert d["acceptance_per_position"] == pytest.approx([37 / 40, 23 / 40, 15 / 40])
    assert spec_decode_delta(None, after)["drafts"] == 50  # counters not there yet count from 0
    assert spec_decode_delta(before, None) is None
    assert spec_decode_delta(after, before)["mean_accepted_length"] is None  # went down: a restart
    idle = spec_decode_delta(before, before)
    assert idle["acceptance_rate"] is None and idle["mean_accepted_length"] is None


# ---- URLs, token ids, config ----------------------------------------------------------------------


@pytest.mark.parametrize("peer, root, model, label", [
    ("openai:http://127.0.0.1:8000", "http://127.0.0.1:8000", None, "openai:127.0.0.1:8000"),
    ("openai:http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000", None, "openai:127.0.0.1:8000"),
    ("openai:https://host/api/v1#meta/llama", "https://host/api", "meta/llama", "openai:meta/llama@host/api"),
])
def test_peer_urls(peer, root, model, label):
    e = parse_openai_peer(peer)
    assert (e.root, e.model, e.label) == (root, model, label)


@pytest.mark.parametrize("peer", ["openai:127.0.0.1:8000", "openai:", "openai:ftp://x"])
def test_bad_peer_urls_are_user_errors(peer):
    with pytest.raises(UserError, match="expected openai:http://HOST:PORT"):
        parse_openai_peer(peer)


def test_bench_config_takes_openai_peers_once():
    BenchConfig(peers=("hf", "openai:http://a:1", "openai:http://b:1"))
    with pytest.raises(UserError, match="given twice"):
        BenchConfig(peers=("openai:http://a:1", "openai:http://a:1/v1"))
    with pytest.raises(UserError, match="or openai:URL"):
        BenchConfig(peers=("vllm",))


def test_token_ids_from_either_server_form():
    assert token_ids_of({"token_ids": [3, 4]}, "return_token_ids") == [3, 4]
    assert token_ids_of({"token_ids": None}, "return_token_ids") is None
    assert token_ids_of({"logprobs": {"tokens": ["token_id:3", "token_id:41"]}}, "logprobs") == [3, 41]
    assert token_ids_of({"logprobs": {"tokens": ["the", "cat"]}}, "logprobs") is None
    assert token_ids_of({"logprobs": None}, "logprobs") is None


# ---- one-line errors ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_url_is_a_one_line_user_error():
    port = free_port()  # closed again: nothing listens there
    with pytest.raises(UserError) as e:
        OpenAIPeer(f"openai:http://127.0.0.1:{port}", timeout=5)
    assert "cannot reach" in str(e.value) and f"127.0.0.1:{port}" in str(e.value) and "\n" not in str(e.value)


def test_the_bench_command_reports_an_unreachable_server_in_one_line(tmp_path, capsys):
    from specdec.cli import main

    folder = tiny_folder_with_tokenizer(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat\n")
    port = free_port()
    capsys.readouterr()  # the tiny model's saving progress
    code = main(["bench", "--model", str(folder), "--task", str(prompts), "--drafters", "", "--raw",
                 "--peers", f"openai:http://127.0.0.1:{port}", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"specdec: error: openai:127.0.0.1:{port}: cannot reach")


class NotJson(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"<html>hello</html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_server_answering_html_is_a_one_line_user_error():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotJson)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(UserError, match="did not answer JSON") as e:
            OpenAIPeer(f"openai:http://127.0.0.1:{httpd.server_address[1]}", timeout=5)
        assert "\n" not in str(e.value)
    finally:
        httpd.shutdown()
        httpd.server_close()


class FakeVLLM(http.server.BaseHTTPRequestHandler):
    """A stand-in server: lists model x, completes with tokens 7 8 9 and gives their ids the way `gives` says
    (`return_token_ids`: choices[0].token_ids; `logprobs`: "token_id:N" tokens, refusing return_token_ids
    as a strict server would; `none`: text only); /metrics is VLLM_METRICS."""

    gives = "return_token_ids"
    bodies: list[dict] = []

    def answer(self, status: int, doc, content_type: str = "application/json"):
        body = doc.encode() if isinstance(doc, str) else json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            return self.answer(200, {"object": "list", "data": [{"id": "x"}, {"id": "y"}]})
        if self.path == "/metrics":
            return self.answer(200, VLLM_METRICS, "text/plain")
        self.answer(404, {"detail": "Not Found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        n = min(3, body["max_tokens"])
        choice = {"index": 0, "text": " seven eight nine"[: 6 * n], "logprobs": None, "finish_reason": "length"}
        if self.gives == "logprobs" and "return_token_ids" in body:
            return self.answer(400, {"error": {"message": "extra fields not permitted: return_token_ids"}})
        if self.gives == "return_token_ids" and body.get("return_token_ids"):
            choice["token_ids"] = [7, 8, 9][:n]
        if self.gives == "logprobs" and body.get("logprobs") and body.get("return_tokens_as_token_ids"):
            choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in [7, 8, 9][:n]], "token_logprobs": [0.0] * n}
        self.answer(200, {"object": "text_completion", "model": body["model"], "choices": [choice],
                          "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": 0}})

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("gives, source, ids", [("return_token_ids", "return_token_ids", [7, 8, 9]),
                                                 ("logprobs", "logprobs", [7, 8, 9]), ("none", "text", None)])
def test_token_ids_are_taken_the_way_the_server_gives_them(gives, source, ids):
    from specdec.config import SamplingParams

    handler = type("Fake", (FakeVLLM,), {"gives": gives, "bodies": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        peer = OpenAIPeer(f"openai:http://127.0.0.1:{httpd.server_address[1]}/v1")
        assert peer.model == "x"  # the first listed
        out = peer.generate([1, 2, 3], 5, SamplingParams())
        assert peer.source == source and out.token_ids == ids and out.num_tokens == 3 and out.wall_s > 0
        last = handler.bodies[-1]
        assert last["prompt"] == [1, 2, 3] and last["max_tokens"] == 5 and last["temperature"] == 0.0
        assert last["stream"] is False and last["model"] == "x"
        assert peer.spec_decode_counters().drafts == 50.0  # model x's series only
        sampled = peer.generate([1], 5, SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3))
        assert sampled.num_tokens == 3
        assert {k: handler.bodies[-1].get(k) for k in ("temperature", "top_p", "top_k", "seed", "min_p")} == \
            {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3, "min_p": None}
    finally:
        httpd.shutdown()
        httpd.server_close()


# ---- against `specdec serve` on loopback ----------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base url, model folder, api key): `specdec serve`'s app (ngram drafter, speculation on) over the
    tiny model, in a uvicorn thread on a free loopback port."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from specdec.models import load_model
    from test_server import KEY, make_scheduler, serving

    folder = tiny_folder_with_tokenizer(tmp_path_factory.mktemp("openai-peer"))
    model = load_model(str(folder), dtype="float32", device=DEVICE)
    with serving(make_scheduler(model)) as (url, _):
        yield url, folder, KEY


def test_a_named_model_the_server_does_not_serve_is_a_user_error(served):
    url, _, key = served
    with pytest.raises(UserError, match="does not serve model 'nope'.*'tiny'"):
        OpenAIPeer(f"openai:{url}/v1#nope", api_key=key)
    with pytest.raises(UserError, match="answered 401.*set OPENAI_API_KEY"):
        OpenAIPeer(f"openai:{url}", api_key="")


@pytest.fixture(scope="module")
def results(served, tmp_path_factory):
    from specdec.bench.runner import run_bench

    url, folder, key = served
    prompts = tmp_path_factory.mktemp("openai-prompts") / "prompts.jsonl"
    prompts.write_text('{"turns": ["the cat sat on the mat . the cat sat on the mat . the cat"]}\n'
                       '{"turns": ["w1 w2 w3 w1 w2 w3 w1 w2 w3 w1"]}\n')
    config = BenchConfig(task=str(prompts), limit=None, model=str(folder), drafters=(), peers=(f"openai:{url}",),
                         max_new_tokens=10, device=DEVICE, dtype="float32", chat=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPENAI_API_KEY", key)
        return run_bench(config, progress=False)


def test_the_server_peer_equals_specdec_plain_decoding(results):
    by_name = {m["name"]: m for m in results["methods"]}
    port = results["config"]["peers"][0].rpartition(":")[2]
    peer = by_name[f"openai:127.0.0.1:{port}"]
    assert peer["family"] == "openai" and peer["server"]["model"] == "tiny"
    # specdec serve returns the output's token ids on request (return_token_ids, as vLLM): compared as such
    assert peer["server"]["token_ids_from"] == "return_token_ids" and peer["lossless_compared"] == "token ids"
    assert peer["lossless"] and peer["matches_plain"] == peer["num_outputs"] == 2
    assert by_name["specdec/none"]["lossless_compared"] == "token ids"
    runs = [r for r in results["runs"] if r["method"] == peer["name"]]
    plain = {r["task_id"]: r for r in results["runs"] if r["method"] == "specdec/none"}
    for r in runs:
        assert r["token_ids"] == plain[r["task_id"]]["token_ids"] and r["text"] == plain[r["task_id"]]["text"]
        assert r["num_tokens"] == len(plain[r["task_id"]]["token_ids"]) and r["tokens_per_s"] > 0


def test_the_servers_spec_decode_metrics_are_read(results):
    peer = next(m for m in results["methods"] if m["family"] == "openai")
    spec = peer["server_spec_decode"]
    assert spec is not None and spec["drafts"] > 0 and spec["draft_tokens"] >= spec["drafts"]
    assert 0 <= spec["acceptance_rate"] <= 1 and spec["mean_accepted_length"] >= 1
    assert len(spec["acceptance_per_position"]) >= 1


def test_the_report_shows_the_server_and_its_figures(results, tmp_path):
    from specdec.bench.report import format_table, write_outputs

    table = format_table(results)
    assert "2/2 " in table and "(text)" not in table and "server-reported spec decode over the bench's requests" in table
    write_outputs(results, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "## OpenAI-compatible servers" in report and "mean accepted length" in report
    saved = json.loads((tmp_path / "results.json").read_text())
    assert next(m for m in saved["methods"] if m["family"] == "openai")["server_spec_decode"]["drafts"] > 0
