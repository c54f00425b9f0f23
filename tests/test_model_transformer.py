"""The exact baseline: its CUDA padding path (mask folded into an extra feature) equals masked SDPA."""
import torch
import torch.nn.functional as F

from models.transformer import bias_dim_attention


def test_bias_dim_attention_equals_masked_sdpa():
    torch.manual_seed(0)
    B, H, N, Dh = 3, 2, 77, 16
    q, k, v = (torch.randn(B, H, N, Dh, dtype=torch.float64) * 3 for _ in range(3))
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, 40:] = False
    mask[2, 5:] = False
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
    got = bias_dim_attention(q, k, v, mask, dropout_p=0.0)
    torch.testing.assert_close(got, ref)
    got32 = bias_dim_attention(q.float(), k.float(), v.float(), mask, dropout_p=0.0)
    torch.testing.assert_close(got32, ref.float(), atol=5e-5, rtol=1e-4)  # fp32 rounding of O(10) scores
