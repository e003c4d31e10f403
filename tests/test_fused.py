"""fused.run_compiled: a function torch.compile cannot take (an error, or more shapes than the recompile limit)
runs eagerly from then on, said once."""

from __future__ import annotations

import torch

from specdec.models import fused


class OnCuda:
    """Stands for a CUDA tensor (run_compiled compiles only for those) on a machine without one."""

    is_cuda = True

    def __init__(self, value: int) -> None:
        self.value = value


def double(x: OnCuda) -> int:
    return 2 * x.value


def test_a_function_past_the_recompile_limit_runs_eagerly(monkeypatch, capsys):
    def refuse(fn):
        def compiled(*args):
            raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile_limit reached with fullgraph=True")
        return compiled

    monkeypatch.setattr(fused, "compiled", refuse)
    monkeypatch.setattr(fused, "EAGER", set())
    assert fused.run_compiled(double, OnCuda(3)) == 6 and double in fused.EAGER
    assert fused.run_compiled(double, OnCuda(4)) == 8
    assert capsys.readouterr().err.count("double could not be compiled (FailOnRecompileLimitHit)") == 1
