"""The reference point of ../shared/spec/PEERS.md: a minimal PyTorch model of the ListOps size with SDPA
attention (no dropout, no padding mask, mean pooling), timed as a full training step in bf16 autocast.

    python benchmarks/minimal_sdpa.py [--compile] [--json OUT.json]

Our runner must reach at least this model's steps/s at no more memory, with everything it adds (mask,
dropout, CLS, evaluation) included. Re-measure it on the card you compare on, in the same call.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, h: int, d_ff: int):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, d_ff), nn.GELU(), nn.Linear(d_ff, d))

    def forward(self, x):
        B, N, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, N, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)  # 3 x (B, H, N, Dh)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D))
        return x + self.mlp(self.ln2(x))


class Minimal(nn.Module):
    def __init__(self, vocab=17, n=2000, d=512, h=8, d_ff=1024, layers=4, classes=10):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(n, d))
        self.blocks = nn.ModuleList(Block(d, h, d_ff) for _ in range(layers))
        self.head = nn.Sequential(nn.Linear(d, d_ff), nn.ReLU(), nn.Linear(d_ff, classes))

    def forward(self, t):
        x = self.emb(t) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    model = Minimal().to(dev)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step_model = torch.compile(model) if args.compile else model
    x = torch.randint(1, 17, (args.batch, 2000), device=dev)
    y = torch.randint(0, 10, (args.batch,), device=dev)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(step_model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(20):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    ms = statistics.median(times) * 1e3
    out = {"model": "minimal_sdpa", "compiled": args.compile, "params": params, "ms_per_step": ms,
           "steps_per_s": 1e3 / ms, "examples_per_s": args.batch * 1e3 / ms,
           "peak_mem_mb": torch.cuda.max_memory_allocated() / 2**20, "device": torch.cuda.get_device_name()}
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
