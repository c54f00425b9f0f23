"""On CUDA: a mixer reaches its ``layer_bench`` speed however a user calls it. The bench wraps our mixer in its own
module (``lra.bench.layer_bench.MixerCall``: a mask made once, outside the timed call, or None where the mixer
takes none) and times it with its own loop; here the same layer is called as a user's script would: the mask
built inside the module on every call (all true), the whole module through ``torch.compile`` or eager, forward +
backward under bf16 autocast, timed by CUDA events. The two medians, taken in one process on one card, must agree
within 20%: a gap means that the call pattern sent the mixer down another, slower execution than the bench's (the
performer once trained at 16 ms where its bench row said 4)."""
from __future__ import annotations

import pytest
import torch

from lra.bench.layer_bench import time_layer
from models import create_model

D_MODEL, HEADS, N, BATCH = 256, 4, 4096, 32  # the bench protocol's width and its 4K shape
# the performer, whose users once got another execution than its bench row; two more mixers with several executions
MIXERS = ["performer", "linear", "nystromformer"]


class UserLayer(torch.nn.Module):
    """A mixer as a user's module calls it: an all-true mask of the input's shape made inside every call."""

    def __init__(self, mixer: torch.nn.Module):
        super().__init__()
        self.mixer = mixer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)  # (B, N)
        return self.mixer(x, mask)  # (B, N, D)


def median_ms(layer: torch.nn.Module, warmup: int = 5, steps: int = 30) -> float:
    """The median of ``steps`` forward + backward calls (bf16 autocast, loss the mean square in fp32), each timed
    by a pair of CUDA events, after ``warmup`` calls (which compile a compiled module)."""
    x = torch.randn(BATCH, N, D_MODEL, device="cuda", requires_grad=True)  # (B, N, D)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)  # (B, N, D)
        y.float().square().mean().backward()

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(torch.tensor(times).median())


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-whole", "eager"])
@pytest.mark.parametrize("name", MIXERS)
def test_a_users_call_runs_at_the_layer_bench_speed(name, compiled):
    torch.set_float32_matmul_precision("high")  # as the runner and the benches set it
    device = torch.device("cuda")
    bench = time_layer(name, N, BATCH, device, warmup=5, steps=30, compile_layer=compiled).ms_fwd_bwd
    torch._dynamo.reset()
    torch.manual_seed(0)
    mixer = create_model(name, d_model=D_MODEL, n_heads=HEADS, d_qkv=D_MODEL, dropout=0.0, max_len=N)
    layer = UserLayer(mixer).cuda().train()
    if compiled:
        layer = torch.compile(layer)
    users = median_ms(layer)
    assert users <= 1.2 * bench, (f"{name}, {'compiled' if compiled else 'eager'}: {users:.2f} ms as a user calls "
                                  f"it, {bench:.2f} ms in layer_bench")
