"""SDPA forward+backward time at each LRA task's attention shape (bf16, CUDA): with the all-true key mask
the encoder passes today vs no mask, with and without attention dropout, and Pathfinder's head size 4
padded to 8. Tells where the image tasks (which have no padding) lose time.

    python benchmarks/sdpa_task_shapes.py
"""
import torch
import torch.nn.functional as F

SHAPES = {  # task: (batch, heads, length, head size, attention dropout)
    "text": (32, 4, 4096, 64, 0.1),
    "image": (256, 8, 1024, 8, 0.2),
    "pathfinder": (512, 4, 1024, 4, 0.1),
    "pathfinder_d8": (512, 4, 1024, 8, 0.1),
}


def time_ms(fn, reps=10):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


for name, (b, h, n, d, p) in SHAPES.items():
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = torch.ones(b, 1, 1, n, dtype=torch.bool, device="cuda")
    for label, m, dp in [("mask+drop", mask, p), ("mask", mask, 0.0), ("none+drop", None, p), ("none", None, 0.0)]:
        def step():
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dp)
            o.sum().backward()
        try:
            torch.cuda.reset_peak_memory_stats()
            ms = time_ms(step)
            mem = torch.cuda.max_memory_allocated() / 2**20
            print(f"{name:14s} B{b} H{h} N{n} D{d} {label:10s}: {ms:8.2f} ms fwd+bwd, peak {mem:8.0f} MB", flush=True)
        except torch.OutOfMemoryError:
            print(f"{name:14s} {label:10s}: OOM", flush=True)
        torch.cuda.empty_cache()
