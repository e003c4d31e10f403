"""Tensor parallelism on the CPU over gloo: two torchrun processes each hold half of a tiny Llama
(specdec/models/tensor_parallel.py) and decode with every drafter, greedily and with a seeded sampler.

- Both ranks emit the same tokens (each computes every step bitwise alike: the drafters are replicated).
- On a model whose logits are NOT sharpened (near-ties at most steps), greedy speculation at tp 2 equals
  plain greedy decoding at tp 2 token for token, as at tp 1.
- tp 2 gives the tokens tp 1 gives, greedy and sampled (fp32). Their logits are not bitwise equal (the
  ranks' partial sums add in another order than one rank's), so this equality is checked, not implied.
  The `quantized` drafter quantises each rank's shard with its own scales, so its drafts, and therefore
  its sampled tokens, may differ between tp 1 and tp 2 (sampling is exact in distribution only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import build_hf, save_hf

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import tp_worker  # noqa: E402


def run_ranks(tmp: Path, target: Path, draft: Path, world: int) -> list[dict]:
    prefix = tmp / f"{target.name}-tp{world}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(HERE / "tp_worker.py"), str(target), str(draft), str(prefix)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(world)]


def run_single(tmp: Path, target: Path, draft: Path) -> dict:
    prefix = tmp / f"{target.name}-tp1"
    done = subprocess.run([sys.executable, str(HERE / "tp_worker.py"), str(target), str(draft), str(prefix)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "WORLD_SIZE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(Path(f"{prefix}.rank0.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    draft = save_hf(build_hf("llama", seed=1, num_hidden_layers=1), tmp / "draft")
    out = {}
    for name, model in (("flat", build_hf("llama", seed=0, num_hidden_layers=3)), ("sharp", build_hf("llama", seed=0, logit_scale=8.0))):
        folder = save_hf(model, tmp / name)
        out[name] = run_single(tmp, folder, draft), run_ranks(tmp, folder, draft, 2)
    return out


@pytest.mark.parametrize("model", ["flat", "sharp"])
def test_ranks_emit_the_same_tokens(runs, model):
    _, (rank0, rank1) = runs[model]
    assert rank0 == rank1


@pytest.mark.parametrize("name", tp_worker.DRAFTERS)
def test_greedy_speculation_at_tp2_equals_plain_at_tp2_with_near_ties(runs, name):
    _, (rank0, _) = runs["flat"]
    assert rank0[name]["greedy"] == rank0["none"]["greedy"]


@pytest.mark.parametrize("model", ["flat", "sharp"])
@pytest.mark.parametrize("name", tp_worker.DRAFTERS)
def test_tp2_gives_the_tokens_of_tp1(runs, model, name):
    single, (rank0, _) = runs[model]
    assert rank0[name]["greedy"] == single[name]["greedy"]
    if name != "quantized":
        assert rank0[name]["sampled"] == single[name]["sampled"]


def test_tp2_rounds_differently_from_tp1(runs):
    """Power: the tp 2 forward is not bitwise the tp 1 forward, so the equalities above are measured."""
    single, (rank0, _) = runs["flat"]
    a, b = torch.tensor(single["logits"]), torch.tensor(rank0["logits"])
    assert not torch.equal(a, b)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the command line


def specdec(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=600,
                          env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})


@pytest.fixture(scope="module")
def worded(tmp_path_factory) -> Path:
    from conftest import tiny_folder_with_tokenizer

    return tiny_folder_with_tokenizer(tmp_path_factory.mktemp("tp-cli"))


def test_generate_tp2_launches_its_ranks_and_matches_tp1(worded, tmp_path):
    args = ["generate", "the cat sat on the mat", "--model", str(worded), "--max-new-tokens", "12", "--drafter", "suffix",
            "--raw", "--check-lossless", "--json"]
    two, one = specdec(*args, "--tp", "2", cwd=tmp_path), specdec(*args, cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = json.loads(two.stdout.strip().splitlines()[-1]), json.loads(one.stdout.strip().splitlines()[-1])
    assert two.stdout.count('"token_ids"') == 1  # only rank 0 printed
    assert (a["tp"], b["tp"], a["lossless"]) == (2, 1, True)
    assert a["token_ids"] == b["token_ids"]


def test_bench_tp2_with_the_cost_policy(worded, tmp_path):
    """The cost policy times steps, which differ per rank: rank 0's gamma choices are broadcast, or the ranks
    would verify blocks of different sizes and their collectives would hang."""
    done = specdec("bench", "--model", str(worded), "--limit", "2", "--drafters", "ngram", "--gammas", "2",
                   "--policies", "cost", "--peers", "hf", "--max-new-tokens", "12", "--tp", "2", "--out", str(tmp_path / "b"),
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    assert results["environment"]["tp"] == 2
    assert any(n.startswith("hf: skipped") for n in results["notes"])
    assert "tensor-parallel over 2 ranks" in done.stdout  # the table's header says so
    assert all(m["lossless"] for m in results["methods"])


def test_tp_errors_are_one_line(worded, tmp_path):
    heads = specdec("generate", "hi", "--model", str(worded), "--tp", "3", cwd=tmp_path)  # 4 heads, 2 KV heads
    assert heads.returncode == 2 and heads.stderr.strip().splitlines() == [
        "specdec: error: tensor parallelism over 3 ranks needs the attention heads divisible by 3, got 4"]
    zero = specdec("generate", "hi", "--model", str(worded), "--tp", "0", cwd=tmp_path)
    assert zero.returncode == 2 and zero.stderr.strip() == "specdec: error: --tp must be >= 1, got 0"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def serve_answers(model: Path, tp: int, cwd: Path, bodies: list[dict]) -> list[str]:
    """Start `specdec serve` (tp ranks), send `bodies` to /v1/completions concurrently, then have the drafter
    forget (POST /admin/forget: every rank's, or their drafts would part) and send them again, stop it: the
    texts of both waves."""
    import signal
    import time
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    pytest.importorskip("uvicorn")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    server = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--model", str(model), "--port", str(port),
                               "--drafter", "suffix", "--spec-policy", "on", "--max-batch", "4", "--tp", str(tp),
                               "--enable-admin", "--log-level", "warning"],
                              cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, server.stderr.read()[-2000:] if server.poll() else "no answer"
                time.sleep(0.3)
        url = f"http://127.0.0.1:{port}/v1/completions"
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda body: post(url, {"model": str(model), **body}), bodies))
            assert post(f"http://127.0.0.1:{port}/admin/forget", {})["forgets"]
            answers += list(pool.map(lambda body: post(url, {"model": str(model), **body}), bodies))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    assert server.returncode in (0, 143, -15), server.stderr.read()[-2000:]  # uvicorn re-raises the SIGTERM it drained on
    return [a["choices"][0]["text"] for a in answers]


def test_serve_tp2_answers_concurrent_requests_as_tp1(worded, tmp_path):
    """Rank 0 serves and the follower replays its batch operations: concurrent greedy and seeded requests
    (rows joining and leaving a shared batch) come out as from a one-process server. A fixed gamma (policy
    `on`): a seeded row's text depends on its gamma schedule, which the cost policy picks from step times."""
    bodies = [{"prompt": "the cat sat on the mat", "max_tokens": 20, "temperature": 0},
              {"prompt": "the mat", "max_tokens": 12, "temperature": 0},
              {"prompt": "cat cat sat", "max_tokens": 16, "temperature": 1.0, "seed": 3},
              {"prompt": "on the", "max_tokens": 24, "temperature": 0}]
    assert serve_answers(worded, 2, tmp_path, bodies) == serve_answers(worded, 1, tmp_path, bodies)
