"""FAVOR+ (models/performer.py states the method, its stabilisers and precision) as five Triton kernels in which
no (N x m) feature map ever reaches GPU memory: each tile of positions forms its exponents from q or k and a chunk of
the random features, takes its features, uses them in the next matmul and drops them, as flash attention does with
its scores. The PyTorch path (models/_favor.py) writes every (B, H, N, m) fp32 map to memory and reads it back
several times, which makes it slower than a package computing in bf16; here a training step moves O(N Dh) bytes
per head, and the saved state is q, k, v, the output, two numbers per query and the (m x Dh) summaries.

* keys, forward (grid: heads x splits of the sequence x feature chunks): each program walks its keys block by
  block, keeping a running per-feature maximum c and rescaling its partial summaries sum_n fk_n v_n^T and key sums
  sum_n fk_n when c grows (flash attention's online maximum, per feature instead of per query). The splits'
  partials are merged in PyTorch (a few (m x Dh) tensors per head): c is the maximum over the real keys, exactly
  the PyTorch path's stabiliser, the summaries the same sums in another order.
* queries, forward (grid: heads x query blocks): fq = softmax over features of w . q' + c, taken chunk by chunk
  with a running maximum (the features play flash attention's keys), out = fq kv / (fq ksum + eps); the normaliser
  and the log-sum-exp of the exponents are kept, so the backward forms fq chunk by chunk without a first pass.
* queries, backward (grid: heads x query blocks): dq. The softmax's backward needs sum_r fq_r d_fq_r, which is
  eps g . out exactly (g the numerator's gradient): no pass over all features first, and no cancellation.
* summaries, backward (grid: heads x splits x feature chunks): each split's partial gradients of the summaries and
  key sums, merged in PyTorch.
* keys, backward (grid: heads x key blocks): the key features recomputed with the forward's c; dk, dv.

Precision follows the PyTorch path: exponents, features, stabilisers, key sums and normaliser in fp32 (fp32 dots
at torch's fp32 matmul precision: TF32 under "high", the runner's and the benches' setting); the products with
values and gradients take bf16 operands when v is bf16, with fp32 accumulation; the output and the gradients come
out in their inputs' dtype and memory layout. Head sizes and feature counts that are not powers of two (or under
16, the least tl.dot takes) are zero-padded inside the kernels, which is exact: padded head columns add nothing to
any dot product, padded features get the exponent -inf.

CUDA only in use (the performer takes it for unpacked rows, ``backend``); under ``TRITON_INTERPRET=1`` the same
kernels run on the CPU, which is how tests/test_favor_triton.py checks them against the PyTorch path.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._favor import EPS

# globals a kernel reads must be constexpr
NEG = tl.constexpr(-1e30)  # the stabiliser of a feature no real key has reached: finite, exp(-inf - NEG) = 0, no nan
NORMALISER_FLOOR = tl.constexpr(EPS)
# Tiles: a program holds (BLOCK x CHUNK) and (CHUNK x Dh) tiles, never all m features at once. The defaults are the
# fastest of 18 settings (BLOCK 32/64/128, CHUNK 16/32/64, 4/8 warps) at 4K x 32 and 16K x 8 (bf16, Dh 64, m 256,
# forward + backward), ahead of CHUNK 32; 32-position tiles and 16-feature chunks are the slowest. ptxas (sm_90)
# spills a little at these (up to 196 bytes a thread in the keys' backward, none in the queries' kernels); the
# 32-feature chunks that spill nothing are slower. results/layer_bench.csv holds the chosen setting's rows
# (``lra performer (tiles BLOCK 64 CHUNK 64 WARPS 4)``).
BLOCK = 64  # positions per tile
CHUNK = 64  # features per tile
WARPS = 4


@triton.jit
def _rows(base, stride_n, stride_d, offs_n, offs_d, N, D):
    """A (BLOCK, DP) tile of a (N, D) matrix in fp32, zeros outside it."""
    ptrs = base + offs_n[:, None] * stride_n + offs_d[None, :] * stride_d
    return tl.load(ptrs, mask=(offs_n[:, None] < N) & (offs_d[None, :] < D), other=0.0).to(tl.float32)


@triton.jit
def _store_rows(base, stride_n, stride_d, offs_n, offs_d, N, D, x, BF16: tl.constexpr):
    """x (BLOCK, DP) into a (N, D) matrix of the pointer's dtype (under the interpreter, rounded to the nearest
    bf16 first: its own conversion truncates)."""
    if BF16 == 2:
        x = _round_bf16(x)
    tl.store(base + offs_n[:, None] * stride_n + offs_d[None, :] * stride_d, x,
             mask=(offs_n[:, None] < N) & (offs_d[None, :] < D))


@triton.jit
def _key_exponents(k, keep, wt, offs_c, M, inv_sqrt_d, F32: tl.constexpr):
    """k (BLOCK, DP) fp32, keep (BLOCK,), wt (DP, MC) -> (BLOCK, MC): w . k' - |k'|^2 / 2, -inf at padded keys
    and features."""
    e = tl.dot(k, wt, input_precision=F32) + (tl.sum(k * k, axis=1) * (-0.5 * inv_sqrt_d))[:, None]
    return tl.where(keep[:, None] & (offs_c[None, :] < M), e, float("-inf"))


@triton.jit
def _query_exponents(q, wt, c, offs_c, M, F32: tl.constexpr):
    """q (BLOCK, DP) fp32, wt (DP, MC), c (MC,) -> (BLOCK, MC): w . q' + c, -inf at padded features."""
    return tl.where(offs_c[None, :] < M, tl.dot(q, wt, input_precision=F32) + c[None, :], float("-inf"))


@triton.jit
def _summaries_chunk(KV, KS, bh, offs_c, offs_d, MP: tl.constexpr, DP: tl.constexpr):
    """This head's summaries (MC, DP) and key sums (MC,) of features offs_c (or their gradients)."""
    return tl.load(KV + (bh * MP + offs_c[:, None]) * DP + offs_d[None, :]), tl.load(KS + bh * MP + offs_c)


@triton.jit
def _round_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even), kept in fp32: the GPU's conversion, done on the bits."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _mm(a, b, BF16: tl.constexpr, F32: tl.constexpr):
    """a @ b accumulated in fp32, with operands in fp32 (BF16 = 0), bf16 (1), or rounded to bf16 and multiplied in
    fp32 (2: the same products, for the interpreter, whose tl.dot mishandles bf16 operands and whose conversion
    to bf16 truncates, in triton 3.9)."""
    if BF16 == 1:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    if BF16 == 2:
        return tl.dot(_round_bf16(a), _round_bf16(b), input_precision=F32)
    return tl.dot(a, b, input_precision=F32)


@triton.jit
def _random_features(W, offs_c, offs_d, D, M):
    """Rows offs_c of the (m, Dh) random matrix, transposed: (DP, MC), zeros outside it."""
    return tl.load(W + offs_c[None, :] * D + offs_d[:, None], mask=(offs_c[None, :] < M) & (offs_d[:, None] < D),
                   other=0.0)


@triton.jit
def _features_chunk(W, C, offs_c, offs_d, D, M, bh, MP: tl.constexpr):
    """Features offs_c of the random matrix (DP, MC) and of this head's stabiliser (MC,)."""
    return _random_features(W, offs_c, offs_d, D, M), tl.load(C + bh * MP + offs_c)


@triton.jit
def _keys_forward(K, V, KEEP, W, C_OUT, KV_OUT, KS_OUT, H, N, D, M, blocks_per_split,
                  skb, skh, skn, skd, svb, svh, svn, svd, inv_sqrt_d, BLOCK: tl.constexpr, DP: tl.constexpr,
                  MP: tl.constexpr, MC: tl.constexpr, BF16: tl.constexpr, F32: tl.constexpr):
    """Grid (heads, splits, feature chunks): one split's partial stabiliser, summaries and key sums of MC features."""
    bh, split, splits = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    b, h = bh // H, bh % H
    offs_d, offs_b = tl.arange(0, DP), tl.arange(0, BLOCK)
    offs_c = tl.program_id(2) * MC + tl.arange(0, MC)
    wt = _random_features(W, offs_c, offs_d, D, M)  # (DP, MC)
    c = tl.full((MC,), NEG, tl.float32)  # running per-feature maximum
    kv = tl.zeros((MC, DP), tl.float32)  # sum_n exp(e_n - c) v_n^T
    ks = tl.zeros((MC,), tl.float32)  # sum_n exp(e_n - c)
    for i in range(0, blocks_per_split):
        offs_n = (split * blocks_per_split + i) * BLOCK + offs_b
        k = _rows(K + b * skb + h * skh, skn, skd, offs_n, offs_d, N, D)  # (BLOCK, DP)
        keep = tl.load(KEEP + b * N + offs_n, mask=offs_n < N, other=0) != 0
        e = _key_exponents(k, keep, wt, offs_c, M, inv_sqrt_d, F32)  # (BLOCK, MC)
        c_new = tl.maximum(c, tl.max(e, axis=0))
        rescale = tl.exp(c - c_new)  # (MC,): the partial sums move to the new maximum
        f = tl.exp(e - c_new[None, :])  # (BLOCK, MC), in [0, 1]
        v = _rows(V + b * svb + h * svh, svn, svd, offs_n, offs_d, N, D)  # (BLOCK, DP)
        kv = kv * rescale[:, None] + _mm(tl.trans(f), v, BF16, F32)
        ks = ks * rescale + tl.sum(f, axis=0)
        c = c_new
    part = bh * splits + split
    tl.store(C_OUT + part * MP + offs_c, c)
    tl.store(KV_OUT + (part * MP + offs_c[:, None]) * DP + offs_d[None, :], kv)
    tl.store(KS_OUT + part * MP + offs_c, ks)


@triton.jit
def _queries_forward(Q, W, C, KV, KS, OUT, DEN, LSE, H, N, D, M, sqb, sqh, sqn, sqd, sob, soh, son, sod,
                     BLOCK: tl.constexpr, DP: tl.constexpr, MP: tl.constexpr, MC: tl.constexpr,
                     BF16: tl.constexpr, F32: tl.constexpr):
    """Grid (heads, query blocks): the softmax over features taken chunk by chunk with a running maximum (flash
    attention's online softmax, the features playing the keys); out, the normaliser and the log-sum-exp."""
    bh, blk = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_d = tl.arange(0, DP)
    offs_n = blk * BLOCK + tl.arange(0, BLOCK)
    q = _rows(Q + b * sqb + h * sqh, sqn, sqd, offs_n, offs_d, N, D)  # (BLOCK, DP)
    top = tl.full((BLOCK,), NEG, tl.float32)  # running maximum of the exponents
    total = tl.zeros((BLOCK,), tl.float32)  # sum of exp(exponent - top)
    num = tl.zeros((BLOCK, DP), tl.float32)  # those weights times the summaries
    den = tl.zeros((BLOCK,), tl.float32)  # and times the key sums
    for j in range(0, MP // MC):
        offs_c = j * MC + tl.arange(0, MC)
        wt, c = _features_chunk(W, C, offs_c, offs_d, D, M, bh, MP)
        e = _query_exponents(q, wt, c, offs_c, M, F32)  # (BLOCK, MC)
        top_new = tl.maximum(top, tl.max(e, axis=1))
        rescale = tl.exp(top - top_new)
        p = tl.exp(e - top_new[:, None])  # (BLOCK, MC)
        kv, ks = _summaries_chunk(KV, KS, bh, offs_c, offs_d, MP, DP)  # (MC, DP), (MC,)
        total = total * rescale + tl.sum(p, axis=1)
        num = num * rescale[:, None] + _mm(p, kv, BF16, F32)
        den = den * rescale + tl.sum(p * ks[None, :], axis=1)
        top = top_new
    den = den / total + NORMALISER_FLOOR  # fq . ksum + eps, >= 1 where the example has real keys
    _store_rows(OUT + b * sob + h * soh, son, sod, offs_n, offs_d, N, D, num / total[:, None] / den[:, None], BF16)
    tl.store(DEN + bh * N + offs_n, den, mask=offs_n < N)
    tl.store(LSE + bh * N + offs_n, top + tl.log(total), mask=offs_n < N)


@triton.jit
def _query_grads(Q, G, OUT, DEN, LSE, b, h, bh, offs_n, offs_d, N, D, sqb, sqh, sqn, sqd, sgb, sgh, sgn, sgd,
                 sob, soh, son, sod):
    """A query block's q, d loss / d numerator g, d loss / d normaliser, and log-sum-exp of its exponents."""
    q = _rows(Q + b * sqb + h * sqh, sqn, sqd, offs_n, offs_d, N, D)
    den = tl.load(DEN + bh * N + offs_n, mask=offs_n < N, other=1.0)
    g = _rows(G + b * sgb + h * sgh, sgn, sgd, offs_n, offs_d, N, D) / den[:, None]
    g_den = -tl.sum(g * _rows(OUT + b * sob + h * soh, son, sod, offs_n, offs_d, N, D), axis=1)
    return q, g, g_den, tl.load(LSE + bh * N + offs_n, mask=offs_n < N, other=0.0)


@triton.jit
def _queries_backward(Q, G, OUT, DEN, LSE, W, C, KV, KS, DQ, H, N, D, M, sqb, sqh, sqn, sqd, sgb, sgh, sgn, sgd,
                      sob, soh, son, sod, sdb, sdh, sdn, sdd, BLOCK: tl.constexpr, DP: tl.constexpr,
                      MP: tl.constexpr, MC: tl.constexpr, BF16: tl.constexpr, F32: tl.constexpr):
    """Grid (heads, query blocks): dq, the features recomputed chunk by chunk from the log-sum-exp. Through the
    softmax over features d_e = fq (d_fq - sum_r fq_r d_fq_r), and that sum is eps g . out exactly (g the
    numerator's gradient), so no pass over all features comes first."""
    bh, blk = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_d = tl.arange(0, DP)
    offs_n = blk * BLOCK + tl.arange(0, BLOCK)
    q, g, g_den, lse = _query_grads(Q, G, OUT, DEN, LSE, b, h, bh, offs_n, offs_d, N, D, sqb, sqh, sqn, sqd,
                                    sgb, sgh, sgn, sgd, sob, soh, son, sod)
    through = -NORMALISER_FLOOR * g_den  # sum_r fq_r d_fq_r
    dq = tl.zeros((BLOCK, DP), tl.float32)
    for j in range(0, MP // MC):
        offs_c = j * MC + tl.arange(0, MC)
        wt, c = _features_chunk(W, C, offs_c, offs_d, D, M, bh, MP)
        e = _query_exponents(q, wt, c, offs_c, M, F32)  # (BLOCK, MC)
        f = tl.exp(e - lse[:, None])  # (BLOCK, MC)
        kv, ks = _summaries_chunk(KV, KS, bh, offs_c, offs_d, MP, DP)  # (MC, DP), (MC,)
        d_f = _mm(g, tl.trans(kv), BF16, F32) + g_den[:, None] * ks[None, :]
        dq += _mm(f * (d_f - through[:, None]), tl.trans(wt), BF16, F32)
    _store_rows(DQ + b * sdb + h * sdh, sdn, sdd, offs_n, offs_d, N, D, dq, BF16)


@triton.jit
def _summaries_backward(Q, G, OUT, DEN, LSE, W, C, DKV_OUT, DKS_OUT, H, N, D, M, blocks_per_split,
                        sqb, sqh, sqn, sqd, sgb, sgh, sgn, sgd, sob, soh, son, sod, BLOCK: tl.constexpr,
                        DP: tl.constexpr, MP: tl.constexpr, MC: tl.constexpr, BF16: tl.constexpr, F32: tl.constexpr):
    """Grid (heads, splits, feature chunks): one split's partial gradients of MC features' summaries and key
    sums, sum_n fq_n g_n^T and sum_n fq_n g_den_n."""
    bh, split, splits = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    b, h = bh // H, bh % H
    offs_d, offs_b = tl.arange(0, DP), tl.arange(0, BLOCK)
    offs_c = tl.program_id(2) * MC + tl.arange(0, MC)
    wt, c = _features_chunk(W, C, offs_c, offs_d, D, M, bh, MP)
    dkv = tl.zeros((MC, DP), tl.float32)
    dks = tl.zeros((MC,), tl.float32)
    for i in range(0, blocks_per_split):
        offs_n = (split * blocks_per_split + i) * BLOCK + offs_b
        q, g, g_den, lse = _query_grads(Q, G, OUT, DEN, LSE, b, h, bh, offs_n, offs_d, N, D, sqb, sqh, sqn, sqd,
                                        sgb, sgh, sgn, sgd, sob, soh, son, sod)
        e = _query_exponents(q, wt, c, offs_c, M, F32)  # (BLOCK, MC)
        f = tl.where((offs_n < N)[:, None], tl.exp(e - lse[:, None]), 0.0)  # (BLOCK, MC)
        dkv += _mm(tl.trans(f), g, BF16, F32)
        dks += tl.sum(f * g_den[:, None], axis=0)
    part = bh * splits + split
    tl.store(DKV_OUT + (part * MP + offs_c[:, None]) * DP + offs_d[None, :], dkv)
    tl.store(DKS_OUT + part * MP + offs_c, dks)


@triton.jit
def _keys_backward(K, V, KEEP, W, C, DKV, DKS, DK, DV, H, N, D, M, skb, skh, skn, skd, svb, svh, svn, svd,
                   s_dkb, s_dkh, s_dkn, s_dkd, s_dvb, s_dvh, s_dvn, s_dvd, inv_sqrt_d, BLOCK: tl.constexpr,
                   DP: tl.constexpr, MP: tl.constexpr, MC: tl.constexpr, BF16: tl.constexpr, F32: tl.constexpr):
    """Grid (heads, key blocks): dk, dv, the key features recomputed chunk by chunk with the forward's c."""
    bh, blk = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_d = tl.arange(0, DP)
    offs_n = blk * BLOCK + tl.arange(0, BLOCK)
    k = _rows(K + b * skb + h * skh, skn, skd, offs_n, offs_d, N, D)  # (BLOCK, DP)
    v = _rows(V + b * svb + h * svh, svn, svd, offs_n, offs_d, N, D)
    keep = tl.load(KEEP + b * N + offs_n, mask=offs_n < N, other=0) != 0
    dk = tl.zeros((BLOCK, DP), tl.float32)
    dv = tl.zeros((BLOCK, DP), tl.float32)
    d_e_sum = tl.zeros((BLOCK,), tl.float32)
    for j in range(0, MP // MC):
        offs_c = j * MC + tl.arange(0, MC)
        wt, c = _features_chunk(W, C, offs_c, offs_d, D, M, bh, MP)
        f = tl.exp(_key_exponents(k, keep, wt, offs_c, M, inv_sqrt_d, F32) - c[None, :])  # (BLOCK, MC)
        dkv, dks = _summaries_chunk(DKV, DKS, bh, offs_c, offs_d, MP, DP)  # (MC, DP), (MC,)
        dv += _mm(f, dkv, BF16, F32)
        d_e = (_mm(v, tl.trans(dkv), BF16, F32) + dks[None, :]) * f  # (BLOCK, MC)
        dk += _mm(d_e, tl.trans(wt), BF16, F32)
        d_e_sum += tl.sum(d_e, axis=1)
    # the exponent is w . k' - |k'|^2 / 2, so d/dk adds -(sum_r d_e_r) k / sqrt(Dh)
    _store_rows(DK + b * s_dkb + h * s_dkh, s_dkn, s_dkd, offs_n, offs_d, N, D,
                dk - d_e_sum[:, None] * k * inv_sqrt_d, BF16)
    _store_rows(DV + b * s_dvb + h * s_dvh, s_dvn, s_dvd, offs_n, offs_d, N, D, dv, BF16)


# ------------------------------------------------------------------------------------------------ launchers


def products(v: torch.Tensor) -> int:
    """``_mm``'s BF16 for values of v's dtype: bf16 operands for bf16 values (emulated under the interpreter)."""
    if v.dtype != torch.bfloat16:
        return 0
    return 2 if os.environ.get("TRITON_INTERPRET") == "1" else 1


def fp32_matmuls(q: torch.Tensor) -> str:
    """tl.dot's precision for fp32 operands, as torch's for its fp32 matmuls: TF32 on a GPU under matmul precision
    "high" or "medium" (the runner's and the benches' setting), full fp32 ("ieee") otherwise."""
    return "tf32" if q.is_cuda and torch.get_float32_matmul_precision() != "highest" else "ieee"


def padded(size: int) -> int:
    return max(16, triton.next_power_of_2(size))


def splits_of(n_blocks: int, heads: int, device: torch.device) -> tuple[int, int]:
    """How a reduction over the sequence is shared: (splits, blocks per split), enough programs to fill the GPU
    twice over when there are few heads (at 16K, batch 8 and 4 heads: 32 heads, 512 blocks)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    per_split = triton.cdiv(n_blocks, max(1, min(n_blocks, triton.cdiv(2 * sms, heads))))
    return triton.cdiv(n_blocks, per_split), per_split


def merge_maxima(c: torch.Tensor, *sums: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The splits' partials, c (BH, S, MP) with sums (BH, S, MP[, DP]) at their own maxima -> c (BH, MP) the
    maximum over all, and the sums moved to it and added, each contiguous. One split (most shapes up to 4K) is
    already merged: views (contiguous, the split axis having size 1), no launch."""
    if c.shape[1] == 1:
        return c[:, 0], *(s[:, 0] for s in sums)
    top = c.amax(1)  # (BH, MP)
    rescale = torch.exp(c - top[:, None])  # (BH, S, MP)
    return (top, *((s * rescale.view(*rescale.shape, *[1] * (s.dim() - 3))).sum(1) for s in sums))


def layout(q: torch.Tensor, v: torch.Tensor, w: torch.Tensor):
    """The launch plan shared by forward and backward: (M, DP, MP, feature chunks, position blocks, splits, blocks
    per split, the kernels' compile-time options)."""
    return plan(*q.shape, w.shape[0], q.device, products(v), fp32_matmuls(q), BLOCK, CHUNK, WARPS)


@functools.lru_cache(maxsize=256)
def plan(B: int, H: int, N: int, D: int, M: int, device: torch.device, bf16: int, f32: str, block: int, chunk: int,
         warps: int):
    """``layout`` for one shape and setting, worked out once: the host time a call spends before its launches."""
    DP, MP = padded(D), padded(M)
    mc = min(chunk, MP)
    n_blocks = triton.cdiv(N, block)
    splits, per_split = splits_of(n_blocks, B * H * (MP // mc), device)
    meta = dict(BLOCK=block, DP=DP, MP=MP, MC=mc, BF16=bf16, F32=f32, num_warps=warps)
    return M, DP, MP, MP // mc, n_blocks, splits, per_split, meta


def forward(q, k, v, keep, w):
    """q, k, v (B, H, N, Dh), keep (B, N) int8, w (m, Dh) fp32 pre-scaled by Dh^-1/4 -> out (B, H, N, Dh) in q's
    dtype and memory layout (so that the heads' outputs merge without a copy), the (B H, N) fp32 normaliser and
    log-sum-exp of the query exponents, and the stabiliser, summaries and key sums (B H, MP[, DP])."""
    B, H, N, D = q.shape
    M, DP, MP, chunks, n_blocks, splits, per_split, meta = layout(q, v, w)
    f32 = dict(device=q.device, dtype=torch.float32)
    c, kv, ks = (torch.empty(B * H, splits, MP, **f32), torch.empty(B * H, splits, MP, DP, **f32),
                 torch.empty(B * H, splits, MP, **f32))
    _keys_forward[(B * H, splits, chunks)](k, v, keep, w, c, kv, ks, H, N, D, M, per_split, *k.stride(),
                                           *v.stride(), 1 / math.sqrt(D), **meta)
    c, kv, ks = merge_maxima(c, kv, ks)  # contiguous, as the queries' kernels index them
    out, den, lse = torch.empty_like(q), torch.empty(B * H, N, **f32), torch.empty(B * H, N, **f32)
    _queries_forward[(B * H, n_blocks)](q, w, c, kv, ks, out, den, lse, H, N, D, M, *q.stride(), *out.stride(),
                                        **meta)
    return out, den, lse, c, kv, ks


def backward(grad, q, k, v, keep, w, out, den, lse, c, kv, ks):
    """The gradients of ``forward``'s out w.r.t. q, k, v, each in its input's dtype and layout. The normaliser's
    gradient comes from the output as stored (bf16 under autocast, as flash attention's backward reads O)."""
    B, H, N, D = q.shape
    M, DP, MP, chunks, n_blocks, splits, per_split, meta = layout(q, v, w)
    f32 = dict(device=q.device, dtype=torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # each in its input's layout
    strides = (*q.stride(), *grad.stride(), *out.stride())
    _queries_backward[(B * H, n_blocks)](q, grad, out, den, lse, w, c, kv, ks, dq, H, N, D, M, *strides,
                                         *dq.stride(), **meta)
    dkv, dks = torch.empty(B * H, splits, MP, DP, **f32), torch.empty(B * H, splits, MP, **f32)
    _summaries_backward[(B * H, splits, chunks)](q, grad, out, den, lse, w, c, dkv, dks, H, N, D, M, per_split,
                                                 *strides, **meta)
    if splits > 1:  # one split: already the sums, (B H, 1, MP[, DP]) viewed as (B H, MP[, DP]) below
        dkv, dks = dkv.sum(1, keepdim=True), dks.sum(1, keepdim=True)
    dkv, dks = dkv[:, 0], dks[:, 0]  # (B H, MP, DP), (B H, MP), contiguous
    _keys_backward[(B * H, n_blocks)](k, v, keep, w, c, dkv, dks, dk, dv, H, N, D, M, *k.stride(), *v.stride(),
                                      *dk.stride(), *dv.stride(), 1 / math.sqrt(D), **meta)
    return dq, dk, dv


def on_device(t: torch.Tensor):
    """Launches go to t's GPU (Triton launches on the current device; a data-parallel rank runs on its own)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@torch.library.custom_op("lra::favor_forward", mutates_args=())
def favor_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                     w: torch.Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    with on_device(q):
        return forward(q, k, v, keep, w)


@favor_forward_op.register_fake
def _(q, k, v, keep, w):
    B, H, N, D = q.shape
    DP, MP = padded(D), padded(w.shape[0])
    return (torch.empty_like(q), *(q.new_empty(*s, dtype=torch.float32) for s in
            ((B * H, N), (B * H, N), (B * H, MP), (B * H, MP, DP), (B * H, MP))))


@torch.library.custom_op("lra::favor_backward", mutates_args=())
def favor_backward_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                      w: torch.Tensor, out: torch.Tensor, den: torch.Tensor, lse: torch.Tensor, c: torch.Tensor,
                      kv: torch.Tensor, ks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with on_device(q):
        return backward(grad, q, k, v, keep, w, out, den, lse, c, kv, ks)


@favor_backward_op.register_fake
def _(grad, q, k, v, keep, w, out, den, lse, c, kv, ks):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # in their inputs' layouts, as the kernels


def _save(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)


def _backward(ctx, grad, *_):  # only out is used: the other outputs are state for the backward
    return (*favor_backward_op(grad, *ctx.saved_tensors), None, None)


favor_forward_op.register_autograd(_backward, setup_context=_save)


def favor_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                           w: torch.Tensor) -> torch.Tensor:
    """Normalised FAVOR+ attention through the kernels above: q, k, v (B, H, N, Dh), keep (B, 1, N, 1) bool, w (m,
    Dh) pre-scaled by Dh^-1/4 -> out (B, H, N, Dh), in q's dtype and layout. Registered torch ops
    (``torch.library``), so a compiled model traces through them without a break; the backward saves q, k, v, the
    output, its normaliser and log-sum-exp per query and the (m x Dh) summaries, nothing (N x m)."""
    keep = keep.reshape(keep.shape[0], keep.shape[2]).to(torch.int8)  # (B, N)
    return favor_forward_op(q, k, v, keep, w.float().contiguous())[0]
