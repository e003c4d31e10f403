"""CUDA: a graph captured while another thread synchronises with the device (the server's StepWatch,
waiting for a step's outcome) is captured whole (graphs.capturing).

In torch's default capture mode ("global") the same capture is invalidated (checked on an H200: the
`torch.cuda.graph(graph)` variant raised "operation failed due to a previous error during capture"),
so this test fails if `capturing` loses its mode. On any device: overlapping captures keep the
garbage collector off until the last one ends. That variant is not kept in the suite: a capture that
fails part-way may leave the process's shared capture stream and pools unfit for the tests after it."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from conftest import DEVICE
from specdec.graphs import capturing

needs_cuda = pytest.mark.skipif(torch.device(DEVICE).type != "cuda", reason="CUDA graphs need a GPU")


def capture_beside_a_waiting_thread(capture) -> torch.Tensor:
    """Capture y = x * 2 + 1 while another thread keeps synchronising on a recorded event, then replay."""
    x = torch.arange(8, dtype=torch.float32, device=DEVICE)
    done = torch.cuda.Event()
    done.record()
    capture_started, stop = threading.Event(), threading.Event()

    def watch() -> None:
        capture_started.wait()
        while not stop.is_set():
            try:
                done.synchronize()
            except RuntimeError:  # "not permitted when stream is capturing": the default mode's complaint
                pass

    thread = threading.Thread(target=watch)
    thread.start()
    graph = torch.cuda.CUDAGraph()
    try:
        with capture(graph):
            y = x * 2
            capture_started.set()
            time.sleep(0.05)  # the watching thread synchronises meanwhile
            y = y + 1
    finally:
        stop.set()
        capture_started.set()
        thread.join()
    graph.replay()
    torch.cuda.synchronize()
    return y


@needs_cuda
def test_a_capture_beside_a_synchronising_thread_is_whole():
    y = capture_beside_a_waiting_thread(lambda graph: capturing(graph, torch.cuda.graph_pool_handle()))
    assert torch.equal(y.cpu(), torch.arange(8, dtype=torch.float32) * 2 + 1)



def test_overlapping_collection_pauses_keep_the_collector_off_until_the_last_ends():
    """Two threads' captures overlap: the first to end must not turn the collector back on under the other."""
    from specdec.graphs import collection_paused

    assert gc.isenabled()
    first, second = collection_paused(), collection_paused()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not gc.isenabled()  # the second pause still holds
    second.__exit__(None, None, None)
    assert gc.isenabled()


@needs_cuda
def test_a_graphed_call_reads_its_held_tensors_in_place_and_copies_the_others_in():
    """GraphedCalls: the held tensor's contents change between calls (read where it lies), the copied one is a
    new tensor each call, the scalar picks the graph; each call equals the function run eagerly."""
    from specdec.graphs import GraphedCalls

    def fn(held, new, k):
        return held[:, :k] * 10 + new

    graphed = GraphedCalls(fn, copied=(1,))
    held = torch.zeros(3, 8, dtype=torch.long, device=DEVICE)
    for call in range(12):
        held.fill_(call)
        new = torch.full((3, 1), 100 * call, dtype=torch.long, device=DEVICE)
        k = 2 + call % 2
        assert torch.equal(graphed(held, new, k).cpu(), fn(held, new, k).cpu()), call
    other = torch.ones(3, 8, dtype=torch.long, device=DEVICE)  # another address: a graph of its own
    assert torch.equal(graphed(other, new, 2).cpu(), fn(other, new, 2).cpu())
    assert len(graphed.graphs) == 3


@needs_cuda
def test_suffix_drafts_ahead_alike_from_its_graph_and_eagerly_on_the_host():
    """drafters.suffix.draft_from_packed as the suffix drafter replays it on a CUDA graph's batch (one graph per
    width and gamma), against the same function run eagerly on the CPU: guesses that hold, partly hold or not,
    rows gaining tokens between calls (a step in flight's), limits below the draft, short drafts filled by lookup or not."""
    import random

    from specdec.drafters.suffix import SuffixConfig, SuffixDrafter, draft_from_packed

    rng = random.Random(0)
    graphed = SuffixDrafter(SuffixConfig()).graphed
    B, S = 6, 48
    tokens = torch.zeros(B, S, dtype=torch.long, device=DEVICE)
    length = torch.zeros(B, dtype=torch.long, device=DEVICE)
    drafted = 0
    for call in range(40):
        k, G = rng.choice([(2, 8), (4, 8), (4, 16)])
        rows, lengths, packed = [], [], torch.zeros(B, G + 3, dtype=torch.long)
        for b in range(B):
            text = [rng.randrange(4) for _ in range(rng.randrange(4, 24))]
            guess = [rng.randrange(4) for _ in range(rng.randrange(0, G + 1))]
            off = rng.randrange(0, 5)
            now = text + (guess[:off] if rng.random() < 0.7 else [rng.randrange(4) for _ in range(off)])
            rows.append(now + [0] * (S - len(now)))
            lengths.append(len(now))
            packed[b, : len(guess)] = torch.tensor(guess, dtype=torch.long)
            packed[b, G:] = torch.tensor([len(text), len(guess), rng.randrange(1, k + 1)])
        tokens.copy_(torch.tensor(rows))  # in place: the batch's tensors keep their addresses
        length.copy_(torch.tensor(lengths))
        args = (k, min(k, 8), call % 2, 3, 1)  # fill on alternate calls: a graph per width, gamma and fill
        drafts, num = graphed(tokens, length, packed.to(DEVICE), *args)
        expected_drafts, expected_num = draft_from_packed(tokens.cpu(), length.cpu(), packed, *args)
        assert torch.equal(num.cpu(), expected_num), call
        for b in range(B):
            n = int(expected_num[b])
            assert drafts[b, :n].cpu().tolist() == expected_drafts[b, :n].tolist(), (call, b)
            drafted += n
    assert len(graphed.graphs) == 6 and drafted > 100, (len(graphed.graphs), drafted)
