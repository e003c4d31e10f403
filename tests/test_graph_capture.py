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
