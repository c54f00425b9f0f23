"""Which SDPA kernel runs, and how fast, for LRA ListOps attention shapes (mask, dropout, odd lengths)."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

B, H, D = 32, 8, 64
for N in (2000, 2001, 2008):
    q, k, v = [torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    mask = torch.ones(B, 1, 1, N, dtype=torch.bool, device="cuda")
    mask[:, :, :, N // 2:] = torch.rand(B, 1, 1, N - N // 2, device="cuda") > 0.5
    for p in (0.0, 0.1):
        for m_name, m in (("nomask", None), ("mask", mask)):
            for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, None):
                def f():
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p)
                    o.backward(torch.ones_like(o))
                try:
                    if be is None:
                        ms = do_bench(f, return_mode="median")
                    else:
                        with sdpa_kernel(be):
                            ms = do_bench(f, return_mode="median")
                    print(f"N={N} p={p} {m_name:6s} {str(be):35s} {ms:.3f} ms")
                except RuntimeError:
                    print(f"N={N} p={p} {m_name:6s} {str(be):35s} unsupported")
