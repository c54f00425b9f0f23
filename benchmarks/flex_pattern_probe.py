"""Where a block-sparse mixer's attention time goes on CUDA: one layer's attention, forward + backward, bf16.

    python benchmarks/flex_pattern_probe.py [model[:option=value,...] ...] [--shapes 4097x32,16385x8]

For each pattern (default: longformer with a global token, bigbird, bigbird with LRA's block 64) at the bench's
shapes (text backbone: 4 heads of 64; default N = 4K plus the CLS slot at batch 32) it prints, in ms (and
peak MB for the whole call):

- ``attend``: the mixer's own ``attend`` (lay out the tiles, build the BlockMask, FlexAttention) with an
  all-true (B, N) key mask, and with ``mask=None`` (one set of tiles for the batch, as the bench now runs it);
- ``kernel``: compiled ``flex_attention`` alone with that BlockMask built beforehand (and ``kernel, mask=None``
  with the BlockMask that ``mask=None`` lays out);
- ``no mask_mod``: the same tiles with a mask_mod that allows everything (wrong numbers, right work): what
  evaluating the pattern inside partial tiles costs;
- ``all full``: the same tiles, every one marked full (no mask_mod at all);
- ``kernel, no index asserts``: the kernel compiled without Inductor's bounds asserts on data-dependent indices;
- tile counts per query row (partial + full of all tiles);

and, per shape, SDPA (cuDNN) and FlexAttention without a mask as the dense references. Written to find
why ``bigbird`` (block 64: nearly every tile partial) ran at 0.2x the transformer on the H200 at 0e49651.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from models import create_model
from models.patterns import listed_tiles, tile_block_mask

H, DH = 4, 64
DEFAULT = ["longformer:global_tokens=1", "bigbird", "bigbird:block=64"]  # about a minute of compiling each


def parse(spec: str) -> tuple[str, dict]:
    name, _, opts = spec.partition(":")
    options = {}
    for item in filter(None, opts.split(",")):
        key, value = item.split("=")
        options[key] = int(value)
    return name, options


def time_ms(fn, reps: int = 10) -> tuple[float, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, torch.cuda.max_memory_allocated() / 2**20


def fwd_bwd(attend, q, k, v):
    def step():
        out = attend(q, k, v)
        out.float().square().mean().backward()
    return step


def variants(bm: BlockMask, N: int) -> dict[str, BlockMask]:
    """The same tiles with an allow-all mask_mod, and with every tile full."""
    def allow_all(b, h, q_idx, kv_idx):
        return q_idx >= 0

    partial = listed_tiles(bm.kv_num_blocks, bm.kv_indices)  # (B, 1, nt, nt)
    full = listed_tiles(bm.full_kv_num_blocks, bm.full_kv_indices)  # (B, 1, nt, nt)
    return {"kernel": bm, "no mask_mod": tile_block_mask(partial, full, N, allow_all),
            "all full": tile_block_mask(torch.zeros_like(partial), partial | full, N, allow_all)}


def main(specs: list[str], shapes: list[tuple[int, int]]) -> None:
    torch.manual_seed(0)
    flex = torch.compile(flex_attention, dynamic=False)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, H {H} x {DH}, bf16, fwd+bwd ms (peak MB)")
    for N, B in shapes:
        q, k, v = (torch.randn(B, H, N, DH, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        mask = torch.ones(B, N, dtype=torch.bool, device="cuda")
        print(f"\nN {N}, batch {B}")
        ms, mb = time_ms(fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v))
        print(f"  {'SDPA (dense)':28s} {ms:8.2f} ({mb:6.0f})")
        ms, mb = time_ms(fwd_bwd(lambda q, k, v: flex(q, k, v), q, k, v))
        print(f"  {'FlexAttention (dense)':28s} {ms:8.2f} ({mb:6.0f})")
        for spec in specs:
            name, options = parse(spec)
            mixer = create_model(name, d_model=H * DH, n_heads=H, d_qkv=H * DH, dropout=0.0, max_len=N,
                                 **options).cuda()
            row = {}
            try:
                row["attend"] = time_ms(fwd_bwd(lambda q, k, v: mixer.attend(q, k, v, mask), q, k, v))
                row["attend, mask=None"] = time_ms(fwd_bwd(lambda q, k, v: mixer.attend(q, k, v, None), q, k, v))
                bm = mixer.block_mask(mask, N, mask.device)  # as attend builds it for a (B, N) mask
                for label, block_mask in variants(bm, N).items():
                    row[label] = time_ms(fwd_bwd(lambda q, k, v: flex(q, k, v, block_mask=block_mask), q, k, v))
                # the tiles of mask=None (one (1, N) layout broadcast over the batch, no key lookup), built
                # beforehand: tells its kernel from its construction (bigbird's mask=None attend ran 7.5 ms
                # against 4.7 with an all-true mask on an H100 at fe235b3)
                bm_none = mixer.block_mask(None, N, mask.device)
                row["kernel, mask=None"] = time_ms(fwd_bwd(lambda q, k, v: flex(q, k, v, block_mask=bm_none), q, k, v))
                # Inductor guards every data-dependent index in a mask_mod (keep[b N + kv], BigBird's random
                # table) with a device-side bounds assert; this variant compiles the kernel without them
                torch._dynamo.reset()
                with torch._inductor.config.patch(assert_indirect_indexing=False):
                    unchecked = torch.compile(flex_attention, dynamic=False)
                    row["kernel, no index asserts"] = time_ms(
                        fwd_bwd(lambda q, k, v: unchecked(q, k, v, block_mask=bm), q, k, v))
                nt = bm.kv_indices.shape[-1]
                tiles = (f"{bm.kv_num_blocks.float().mean():.1f} partial + {bm.full_kv_num_blocks.float().mean():.1f}"
                         f" full of {nt}")
            except Exception as error:  # report and go on: the point is the table
                print(f"  {spec:28s} failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
                continue
            cells = "  ".join(f"{label} {ms:.2f} ({mb:.0f})" for label, (ms, mb) in row.items())
            print(f"  {spec:28s} {cells}  | tiles/row {tiles}", flush=True)
            torch._dynamo.reset()  # fresh compile caches per model, as separate bench processes would have


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="*", default=DEFAULT, help="model[:option=value,...]")
    parser.add_argument("--shapes", default="4097x32", help="NxB,... (N with the CLS slot): 4097x32,16385x8")
    args = parser.parse_args()
    main(args.specs, [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")])
