"""Exact softmax attention for small heads (head size D up to 32; LRA's are 2, 4, 8, 16 and 32) as three Triton
kernels, forward and backward, with attention dropout drawn from a counter-based hash instead of Philox.

    out_i = sum_j  z_ij / (1 - p)  softmax_j(q_i . k_j / sqrt(D) + mask_j)  v_j

non-causal; ``keep`` (B, Nk) bool, True at a real key (a padded key's score is -inf); z_ij the dropout keep mask
(training only); queries and keys may differ in number (Nq, Nk). Inputs bf16, fp16 or fp32; out and the gradients
come out in the input dtype.

Why a kernel of its own: SDPA's fused kernels take head sizes in multiples of 8 (``pad_head_dim`` pads 4 to 8),
and FlashAttention's smallest instantiation computes with 32 head columns, so at D = 4 it reads, multiplies and (in
the backward) atomically accumulates dQ over 8 times the columns that carry data; its dropout draws Philox-4x32-10
(10 rounds of two 32-bit multiplies) for every 16 scores. Here the head is padded to DP = max(16, D) columns in
registers only (tl.dot's least K; zero columns add nothing to q . k and give zero output columns, which are not
stored), nothing is padded in memory, dQ is summed in fp32 over D columns only, and the
dropout decision costs a few integer operations per score.

* forward (grid: query tiles x heads): FlashAttention-2's online softmax over key tiles. Scores q k^T and the
  product with V are tensor-core dots (tl.dot) with fp32 accumulation; the scale 1/sqrt(D) and log2(e) are folded
  into the one FFMA that forms each exponent (exp2(s c + bias_j - m_i), c = log2(e)/sqrt(D)), so the scale costs
  nothing; the key mask and the tile's ragged end are a per-key bias (0 or -inf) added by that same FFMA. The
  softmax normaliser sums the undropped probabilities; the dropped ones are zeroed before the product with V, and
  out is divided by (1 - p) once per query. The log-sum-exp per query (natural log) is stored for the backward;
  +inf where a query sees no real key, whose output is 0 (no NaN, and its gradients are 0).
* backward, dK and dV (grid: key tiles x heads): for each query tile, P^T recomputed from the stored log-sum-exp,
  dV += (Z P / (1 - p))^T dO, dP = dO V^T, dS = P (Z dP / (1 - p) - delta), dK += dS^T Q / sqrt(D), with
  delta_i = rowsum(dO_i * O_i) computed first (in PyTorch: B H Nq D products).
  The same kernel adds each (query tile, key tile)'s share of dQ, dS K / sqrt(D), into an fp32 (B, Nq, H, D) sum by
  atomic adds of the D real columns (D / 128 adds per score), so P is recomputed once in the backward, as
  FlashAttention-2 does; dQ is that sum in the input dtype.
* backward, dQ, under torch's deterministic mode (``torch.are_deterministic_algorithms_enabled``: atomic adds land in
  no fixed order): a kernel of its own (grid: query tiles x heads), the same recomputation over key tiles,
  dQ += dS K / sqrt(D), stored once per query; the dK/dV kernel then adds nothing.

Products take tensor-core operands in the input dtype (bf16/fp16; P and dS rounded to it before their products, as
FlashAttention does) and accumulate in fp32; the exponentials, the online-softmax state, delta and every
accumulator are fp32. fp32 inputs multiply in fp32 (``input_precision="ieee"``). Under Triton's interpreter
(TRITON_INTERPRET=1, the CPU tests) the 16-bit operands are rounded to their dtype and multiplied in fp32: the same
products (the interpreter's own bf16 conversion truncates).

Why tl.dot although D is tiny: the kernels are bound by issued instructions per score, not by FLOPs. A tensor-core
dot of a (128 x 16) by (16 x 64) tile is a handful of instructions per warp, against D FFMAs per score for each
product on the CUDA cores (2D in the forward, 4D in the backward), and Triton lays a broadcast-and-sum product
(``tl.sum(q[:, None, :] * k[None, :, :], 2)``, or its D columns unrolled) out with its reduction across threads:
warp shuffles per score, or every thread loading every key; compiled for sm_90 such loops issue several times the
instructions per score of the tl.dot form.

Dropout (a departure from FlashAttention's Philox; statistically equivalent: each score is kept independently with
probability 1 - p, to within 2^-32, and the mask is a pure function of its inputs, so forward and backward agree
without storing it). All arithmetic on uint32, mod 2^32, with lowbias32 (x ^= x >> 16; x *= 0x7FEB352D;
x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16) as ``mix``:

    head  = mix(seed ^ mix(bh))             # bh = b * H + h
    row_i = mix(head ^ i)                   # once per query and tile
    y     = (row_i + j) * 0x7FEB352D        # = row_i * M1 + j * M1: one add per score
    u     = (y ^ (y >> 15)) * 0x846CA68B
    keep  = u >= round(p * 2^32)

Per score: an add, a shift, a xor, a multiply, a compare and a select. Distinct (i, j) of a row give distinct y
(a Weyl sequence); the top bits of u, which the comparison reads, depend on every bit of y. The rows' keys are
full lowbias32 hashes of (seed, head, query), so no two rows, heads or seeds share a structured pattern.
``dropout_keep_mask`` is the same function in PyTorch, for the tests. The seed is a device tensor (the caller
draws it with ``torch.randint`` each call, so seeding the run seeds it), read inside the kernels: no host sync.

Tiles (``TILES``, queries x keys, warps): forward 64 x 64, 4 warps; dK/dV 32 x 128 (each program 128 keys, 32
queries a step), 4 warps; dQ 128 x 32, 4 warps. The forward's and dQ's are the fastest of each kernel timed alone at
Pathfinder's attention shape (B 512, H 4, N 1024, D 4, dropout 0.1) over 64 to 256 queries by 32 to 128 keys at 4
and 8 warps; dK/dV's was first chosen by compiling each kernel for sm_90 at D 2 to 32 and counting
the instructions its inner loop issues per score: these are the fewest among 32 to 256 queries by 32 to 128 keys at
4 and 8 warps without spilling registers at any D. The dK/dV kernel forms the rows' dropout keys once per query a
step, so it wants many keys per query (128); larger score tiles spill, smaller ones spend more of each step on the
per-tile bookkeeping (the online softmax's maxima, the loads of the log-sum-exp and delta). One setting serves every
D: the score tiles, not the (tile x DP) operands, take the registers. No autotuning: the choice does not depend on D
or N here, and an autotuned kernel compiles every setting on first use. Any setting gives the same answer (a test
checks).

The bound. Per score (B H Nq Nk scores a layer), with DP = max(16, D):
  forward  2 tensor-core products of depth DP (q . k, then p v), 1 exp2, ~6 FP32 operations (the exponent's FFMA,
           max, subtract, sum, the rescale's share, the select of dropout), hash ~5 integer operations;
  dK, dV   5 products (S^T, dP^T, dV, dK, and dQ's share), 1 exp2, ~6 FP32 operations, hash ~5 plus the rows'
           keys (a lowbias32 pair per query of a step and thread that holds it: ~4 per score at these tiles),
           D / 128 atomic adds;
  dQ       (deterministic mode only) 3 products (S, dP, dQ), 1 exp2, ~4 FP32 operations, hash ~5, and dK/dV's
           share of dQ is not formed;
so a training step takes E = 2 exp2 per score and 7 products of depth DP, and the loops compiled for sm_90 (head
size 4, bf16, no mask; nvdisasm of Triton's cubin, instructions of the loop body over the scores a thread holds)
issue I = 16.3 + 24.0 = 40.3 instructions per score with dropout (9.0 + 12.6 = 21.6 without); in deterministic
mode E = 3, 9 products and I = 16.3 + 22.5 + 14.8 = 53.6 (9.0 + 11.4 + 8.8 = 29.2), dK/dV then forming no dQ.
A step of LRA's Pathfinder transformer (batch 512, 4 heads, N 1024, 4 layers) has S = B H N^2 layers =
512 * 4 * 1024^2 * 4 = 8.6e9 scores. On a card of n SMs at clock f its attention then takes at least
max(S I / (128 n f), S E / (16 n f), 2 S P DP / F) seconds for P products: 128 FP32/INT32 lanes an SM a clock issue
I, 16 MUFU lanes an SM a clock take E, F is the card's dense bf16 tensor rate (FLOP/s). Measured against it:
docs/performance.md.

CUDA only in use (the transformer takes it for unpacked 16-bit rows with heads off a multiple of 8, ``backend``);
the tests run the same kernels on the CPU through Triton's interpreter.
"""
from __future__ import annotations

import contextlib
import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = tl.constexpr(1.4426950408889634)
NO_ROW = tl.constexpr(-1e30)  # the running maximum before any real key: finite, so exp2(-inf - NO_ROW) = 0, no NaN
M1 = 0x7FEB352D  # lowbias32's multipliers (Wellons, hash-prospector)
M2 = 0x846CA68B
_M1 = tl.constexpr(M1)
_M2 = tl.constexpr(M2)
MAX_HEAD = 32  # head sizes 1..MAX_HEAD: DP = max(16, next power of 2) columns in registers
# (BLOCK_M queries, BLOCK_N keys, warps) per kernel; see the module docstring for why these
TILES = {"forward": (64, 64, 4), "dkdv": (32, 128, 4), "dq": (128, 32, 4)}


# ---------------------------------------------------------------------------------------------------- the hash


@triton.jit
def _mix(x):
    """lowbias32 on uint32."""
    x ^= x >> 16
    x *= _M1
    x ^= x >> 15
    x *= _M2
    x ^= x >> 16
    return x


@triton.jit
def _row_keys(seed, bh, offs_m):
    """(BLOCK_M,) uint32: row_i * M1 for queries offs_m of head bh (the per-query half of y, formed once)."""
    head = _mix(seed ^ _mix(tl.cast(bh, tl.uint32)))
    return _mix(head ^ offs_m.to(tl.uint32)) * _M1


@triton.jit
def _kept(row_m1, col_m1, thresh):
    """Keep decisions from the rows' row_i * M1 and the keys' j * M1, broadcast against each other."""
    y = row_m1 + col_m1
    return ((y ^ (y >> 15)) * _M2) >= thresh


# ---------------------------------------------------------------------------------------------------- helpers


@triton.jit
def _round_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even), kept in fp32: the GPU's conversion, done on the bits."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _mm(a, b, OP: tl.constexpr):
    """a @ b accumulated in fp32, operands as OP says: 0 fp32; 1 bf16 and 2 fp16 (tensor cores); 3 bf16 and 4 fp16
    emulated for the interpreter (rounded to the dtype, multiplied in fp32)."""
    if OP == 1:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif OP == 2:
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    elif OP == 3:
        return tl.dot(_round_bf16(a.to(tl.float32)), _round_bf16(b.to(tl.float32)), input_precision="ieee")
    elif OP == 4:
        return tl.dot(a.to(tl.float16).to(tl.float32), b.to(tl.float16).to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _tile(base, stride_n, stride_d, offs_n, offs_d, N, D):
    """A (BLOCK, len(offs_d)) tile of a (N, D) matrix in its own dtype, zeros outside it."""
    return tl.load(base + offs_n[:, None] * stride_n + offs_d[None, :] * stride_d,
                   mask=(offs_n[:, None] < N) & (offs_d[None, :] < D), other=0.0)


@triton.jit
def _widened(x, DP: tl.constexpr):
    """(BLOCK, DL) -> (BLOCK, DP) in registers, zeros interleaved until DP columns: column d lands at d DP / DL.
    Operands widened alike keep their dot products, and a product's output columns are read back by ``_narrowed``."""
    for _ in tl.static_range(5):
        if x.shape[1] < DP:
            x = tl.interleave(x, tl.zeros_like(x))
    return x


@triton.jit
def _narrowed(x, DL: tl.constexpr):
    """(BLOCK, DP) -> (BLOCK, DL): the columns ``_widened`` placed, at d DP / DL."""
    for _ in tl.static_range(5):
        if x.shape[1] > DL:
            x, _odd = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
    return x


@triton.jit
def _store(base, stride_n, stride_d, offs_n, offs_d, N, D, x, OP: tl.constexpr):
    """fp32 x (BLOCK, len(offs_d)) into a (N, D) matrix of the pointer's dtype (under the interpreter, rounded to the
    nearest bf16 first: its own conversion truncates)."""
    if OP == 3:
        x = _round_bf16(x)
    tl.store(base + offs_n[:, None] * stride_n + offs_d[None, :] * stride_d, x.to(base.dtype.element_ty),
             mask=(offs_n[:, None] < N) & (offs_d[None, :] < D))


@triton.jit
def _key_bias(KEEP, b, offs_n, NK, HAS_MASK: tl.constexpr):
    """(BLOCK_N,) fp32: 0 at a real key, -inf at a padded one or past the end."""
    real = offs_n < NK
    if HAS_MASK:
        real &= tl.load(KEEP + b * NK + offs_n, mask=offs_n < NK, other=0) != 0
    return tl.where(real, 0.0, float("-inf"))


# ---------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _forward(Q, K, V, KEEP, SEED, OUTPUT, LSE, H, NQ, NK, n_tiles,
             sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
             c, thresh, inv_keep, D: tl.constexpr, DL: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, OP: tl.constexpr):
    """Grid (query tiles x heads,): out and the log-sum-exp of a query tile, online softmax over key tiles. Tiles
    are loaded at their DL = next_pow2(D) real columns (a row's D values lie together: few, wide loads) and widened
    in registers (``_widened``). The backward kernels load theirs padded to DP instead: widening the many tiles of
    their products would shuffle registers more than it saves in loads."""
    pid = tl.program_id(0)
    bh, tile = pid // n_tiles, pid % n_tiles
    b, h = bh // H, bh % H
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DL)
    q = _widened(_tile(Q + b * sqb + h * sqh, sqn, sqd, offs_m, offs_d, NQ, D), DP)  # (BLOCK_M, DP)
    K += b * skb + h * skh
    V += b * svb + h * svh
    m = tl.full((BLOCK_M,), NO_ROW, tl.float32)  # running maximum of the exponents (log2 units)
    total = tl.zeros((BLOCK_M,), tl.float32)  # sum of exp2(exponent - m), undropped
    acc = tl.zeros((BLOCK_M, DP), tl.float32)  # sum of kept exp2(exponent - m) v
    if DROPOUT:
        rows = _row_keys(tl.load(SEED).to(tl.uint32), bh, offs_m)
    for start in range(0, NK, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = _widened(_tile(K, skn, skd, offs_n, offs_d, NK, D), DP)  # (BLOCK_N, DP)
        v = _widened(_tile(V, svn, svd, offs_n, offs_d, NK, D), DP)
        t = _mm(q, tl.trans(k), OP) * c + _key_bias(KEEP, b, offs_n, NK, HAS_MASK)[None, :]  # (BLOCK_M, BLOCK_N)
        m_new = tl.maximum(m, tl.max(t, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(t - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        if DROPOUT:
            p = tl.where(_kept(rows[:, None], offs_n.to(tl.uint32)[None, :] * _M1, thresh), p, 0.0)
        acc = acc * alpha[:, None] + _mm(p, v, OP)
        m = m_new
    seen = total > 0.0  # False: no real key at all
    total = tl.where(seen, total, 1.0)
    o = acc * tl.where(seen, inv_keep / total, 0.0)[:, None]
    _store(OUTPUT + b * sob + h * soh, son, sod, offs_m, offs_d, NQ, D, _narrowed(o, DL), OP)  # (BLOCK_M, DL)
    lse = tl.where(seen, (m + tl.log2(total)) / LOG2E, float("inf"))  # natural log of sum_j exp(s_ij)
    tl.store(LSE + bh * NQ + offs_m, lse, mask=offs_m < NQ)


@triton.jit
def _backward_dkdv(Q, K, V, KEEP, SEED, DO, LSE, DELTA, DK, DV, DQ, H, NQ, NK, n_tiles,
                   sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sgb, sgh, sgn, sgd,
                   s_dkb, s_dkh, s_dkn, s_dkd, s_dvb, s_dvh, s_dvn, s_dvd, c, scale, thresh, inv_keep,
                   D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, OP: tl.constexpr, FUSED_DQ: tl.constexpr):
    """Grid (key tiles x heads,): dK, dV of a key tile over all query tiles, in the transposed orientation (keys
    along the tiles' first axis), so that both are plain products; with FUSED_DQ also each query tile's share of dQ,
    atomically added into DQ, a (B, Nq, H, D) fp32 sum."""
    pid = tl.program_id(0)
    bh, tile = pid // n_tiles, pid % n_tiles
    b, h = bh // H, bh % H
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, DP)
    k = _tile(K + b * skb + h * skh, skn, skd, offs_n, offs_d, NK, D)  # (BLOCK_N, DP)
    v = _tile(V + b * svb + h * svh, svn, svd, offs_n, offs_d, NK, D)
    bias = _key_bias(KEEP, b, offs_n, NK, HAS_MASK)  # (BLOCK_N,)
    Q += b * sqb + h * sqh
    DO += b * sgb + h * sgh
    dk = tl.zeros((BLOCK_N, DP), tl.float32)
    dv = tl.zeros((BLOCK_N, DP), tl.float32)
    if DROPOUT:
        seed = tl.load(SEED).to(tl.uint32)
        cols = offs_n.to(tl.uint32) * _M1
    for start in range(0, NQ, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        q = _tile(Q, sqn, sqd, offs_m, offs_d, NQ, D)  # (BLOCK_M, DP)
        do = _tile(DO, sgn, sgd, offs_m, offs_d, NQ, D)
        lse = tl.load(LSE + bh * NQ + offs_m, mask=offs_m < NQ, other=float("inf")) * LOG2E  # (BLOCK_M,)
        delta = tl.load(DELTA + bh * NQ + offs_m, mask=offs_m < NQ, other=0.0)
        p = tl.exp2(_mm(k, tl.trans(q), OP) * c + bias[:, None] - lse[None, :])  # (BLOCK_N, BLOCK_M): P^T
        dp = _mm(v, tl.trans(do), OP)  # dP^T
        if DROPOUT:
            kept = _kept(cols[:, None], _row_keys(seed, bh, offs_m)[None, :], thresh)
            dv += _mm(tl.where(kept, p, 0.0), do, OP)
            dp = tl.where(kept, dp, 0.0) * inv_keep
        else:
            dv += _mm(p, do, OP)
        ds = p * (dp - delta[None, :])  # (BLOCK_N, BLOCK_M): dS^T
        dk += _mm(ds, q, OP)
        if FUSED_DQ:  # this key tile's share of dQ = dS K / sqrt(D), added into the fp32 sum of all key tiles'
            tl.atomic_add(DQ + ((b * NQ + offs_m)[:, None] * H + h) * D + offs_d[None, :],
                          _mm(tl.trans(ds), k, OP) * scale,
                          mask=(offs_m[:, None] < NQ) & (offs_d[None, :] < D), sem="relaxed")
    _store(DK + b * s_dkb + h * s_dkh, s_dkn, s_dkd, offs_n, offs_d, NK, D, dk * scale, OP)
    _store(DV + b * s_dvb + h * s_dvh, s_dvn, s_dvd, offs_n, offs_d, NK, D, dv * inv_keep, OP)


@triton.jit
def _backward_dq(Q, K, V, KEEP, SEED, DO, LSE, DELTA, DQ, H, NQ, NK, n_tiles,
                 sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sgb, sgh, sgn, sgd,
                 s_dqb, s_dqh, s_dqn, s_dqd, c, scale, thresh, inv_keep,
                 D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, OP: tl.constexpr):
    """Grid (query tiles x heads,): dQ of a query tile over all key tiles."""
    pid = tl.program_id(0)
    bh, tile = pid // n_tiles, pid % n_tiles
    b, h = bh // H, bh % H
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DP)
    q = _tile(Q + b * sqb + h * sqh, sqn, sqd, offs_m, offs_d, NQ, D)  # (BLOCK_M, DP)
    do = _tile(DO + b * sgb + h * sgh, sgn, sgd, offs_m, offs_d, NQ, D)
    lse = tl.load(LSE + bh * NQ + offs_m, mask=offs_m < NQ, other=float("inf")) * LOG2E
    delta = tl.load(DELTA + bh * NQ + offs_m, mask=offs_m < NQ, other=0.0)
    K += b * skb + h * skh
    V += b * svb + h * svh
    dq = tl.zeros((BLOCK_M, DP), tl.float32)
    if DROPOUT:
        rows = _row_keys(tl.load(SEED).to(tl.uint32), bh, offs_m)
    for start in range(0, NK, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = _tile(K, skn, skd, offs_n, offs_d, NK, D)  # (BLOCK_N, DP)
        v = _tile(V, svn, svd, offs_n, offs_d, NK, D)
        bias = _key_bias(KEEP, b, offs_n, NK, HAS_MASK)
        p = tl.exp2(_mm(q, tl.trans(k), OP) * c + bias[None, :] - lse[:, None])  # (BLOCK_M, BLOCK_N)
        dp = _mm(do, tl.trans(v), OP)
        if DROPOUT:
            dp = tl.where(_kept(rows[:, None], offs_n.to(tl.uint32)[None, :] * _M1, thresh), dp, 0.0) * inv_keep
        dq += _mm(p * (dp - delta[:, None]), k, OP)
    _store(DQ + b * s_dqb + h * s_dqh, s_dqn, s_dqd, offs_m, offs_d, NQ, D, dq * scale, OP)


@triton.jit
def _keep_mask(SEED, OUT, bh, NQ, NK, thresh, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (query tiles, key tiles): the kernels' keep decisions of head bh as int8, for the tests."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = _row_keys(tl.load(SEED).to(tl.uint32), bh, offs_m)
    kept = _kept(rows[:, None], offs_n.to(tl.uint32)[None, :] * _M1, thresh)
    tl.store(OUT + offs_m[:, None] * NK + offs_n[None, :], kept.to(tl.int8),
             mask=(offs_m[:, None] < NQ) & (offs_n[None, :] < NK))


# ---------------------------------------------------------------------------------------------------- launchers


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def operands(dtype: torch.dtype) -> int:
    """``_mm``'s OP for inputs of ``dtype``."""
    code = {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 0)
    return code + 2 if code and interpreted() else code


def threshold(p: float) -> int:
    """The uint32 a draw must reach to be kept: round(p 2^32), so P(keep) = 1 - p to within 2^-32."""
    return min(round(p * 2**32), 2**32 - 1)


def settings(q: Tensor, dropout_p: float, keep: Tensor | None) -> dict:
    D = q.shape[-1]
    return dict(D=D, DP=max(16, triton.next_power_of_2(D)), HAS_MASK=keep is not None, DROPOUT=dropout_p > 0,
                OP=operands(q.dtype))


def scalars(D: int, dropout_p: float) -> tuple[float, float, int, float]:
    """(c, scale, thresh, inv_keep): the exponent's factor log2(e)/sqrt(D), 1/sqrt(D), the dropout threshold and
    1/(1 - p)."""
    scale = D ** -0.5
    return scale * math.log2(math.e), scale, threshold(dropout_p), 1.0 / (1.0 - dropout_p)


def heads_last(B: int, N: int, H: int, D: int, like: Tensor) -> Tensor:
    """An empty (B, H, N, D) view of a (B, N, H, D) tensor: the heads' outputs merge into (B, N, H D) without a copy."""
    return like.new_empty(B, N, H, D).transpose(1, 2)


def check(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, dropout_p: float) -> None:
    B, H, _, D = q.shape
    if k.shape != v.shape or k.shape[:2] != (B, H) or k.shape[3] != D:
        raise ValueError(f"small_head_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not "
                         "(B, H, Nq, D), (B, H, Nk, D) twice")
    if not 1 <= D <= MAX_HEAD:
        raise ValueError(f"small_head_attention takes head sizes 1..{MAX_HEAD}, got {D}")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"small_head_attention: q, k, v of one dtype among fp32, bf16, fp16, got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")
    if keep is not None and tuple(keep.shape) != (B, k.shape[2]):
        raise ValueError(f"small_head_attention: keep must be (B, Nk) = {(B, k.shape[2])}, got {tuple(keep.shape)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"small_head_attention: dropout_p must be in [0, 1), got {dropout_p}")


def forward(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, seed: Tensor | None,
            dropout_p: float) -> tuple[Tensor, Tensor]:
    """q (B, H, Nq, D), k, v (B, H, Nk, D), keep (B, Nk) int8 or None, seed (1,) int64 -> out (B, H, Nq, D) in q's
    dtype (a view of (B, Nq, H, D)) and the (B H, Nq) fp32 log-sum-exp of the scaled scores."""
    B, H, NQ, D = q.shape
    NK = k.shape[2]
    meta = settings(q, dropout_p, keep)
    c, _, thresh, inv_keep = scalars(D, dropout_p)
    block_m, block_n, warps = TILES["forward"]
    out, lse = heads_last(B, NQ, H, D, q), q.new_empty(B * H, NQ, dtype=torch.float32)
    n_tiles = triton.cdiv(NQ, block_m)
    _forward[(n_tiles * B * H,)](q, k, v, lse if keep is None else keep, lse if seed is None else seed, out, lse,
                                 H, NQ, NK, n_tiles, *q.stride(), *k.stride(), *v.stride(), *out.stride(), c, thresh,
                                 inv_keep, DL=triton.next_power_of_2(D), BLOCK_M=block_m, BLOCK_N=block_n,
                                 num_warps=warps, **meta)
    return out, lse


def backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, seed: Tensor | None,
             out: Tensor, lse: Tensor, dropout_p: float) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of ``forward``'s out w.r.t. q, k, v, each in its input's dtype. delta = rowsum(dO * O) comes
    from the output as stored (in the input dtype, as FlashAttention's backward reads O)."""
    B, H, NQ, D = q.shape
    NK = k.shape[2]
    meta = settings(q, dropout_p, keep)
    c, scale, thresh, inv_keep = scalars(D, dropout_p)
    delta = (grad.float() * out.float()).sum(-1).reshape(B * H, NQ)  # (B H, Nq) fp32
    keep, seed = delta if keep is None else keep, delta if seed is None else seed  # pointers never read
    dk, dv = heads_last(B, NK, H, D, k), heads_last(B, NK, H, D, v)
    common = (*q.stride(), *k.stride(), *v.stride(), *grad.stride())
    fused = not torch.are_deterministic_algorithms_enabled()  # atomic adds land in no fixed order
    # fused: the fp32 (B, Nq, H, D) sum the dK/dV kernel adds into; else the dQ kernel's output
    dq = q.new_zeros(B, NQ, H, D, dtype=torch.float32) if fused else heads_last(B, NQ, H, D, q)
    block_m, block_n, warps = TILES["dkdv"]
    n_tiles = triton.cdiv(NK, block_n)
    _backward_dkdv[(n_tiles * B * H,)](q, k, v, keep, seed, grad, lse, delta, dk, dv, dq, H, NQ, NK, n_tiles,
                                       *common, *dk.stride(), *dv.stride(), c, scale, thresh, inv_keep,
                                       BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, FUSED_DQ=fused, **meta)
    if fused:
        return dq.to(q.dtype).transpose(1, 2), dk, dv  # (B, H, Nq, D) view of (B, Nq, H, D)
    block_m, block_n, warps = TILES["dq"]
    n_tiles = triton.cdiv(NQ, block_m)
    _backward_dq[(n_tiles * B * H,)](q, k, v, keep, seed, grad, lse, delta, dq, H, NQ, NK, n_tiles, *common,
                                     *dq.stride(), c, scale, thresh, inv_keep, BLOCK_M=block_m, BLOCK_N=block_n,
                                     num_warps=warps, **meta)
    return dq, dk, dv


def on_device(t: Tensor):
    """Launches go to t's GPU (Triton launches on the current device; a data-parallel rank runs on its own)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@torch.library.custom_op("lra::small_head_forward", mutates_args=())
def small_head_forward_op(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, seed: Tensor | None,
                          dropout_p: float) -> tuple[Tensor, Tensor]:
    with on_device(q):
        return forward(q, k, v, keep, seed, dropout_p)


@small_head_forward_op.register_fake
def _(q, k, v, keep, seed, dropout_p):
    B, H, NQ, D = q.shape
    return heads_last(B, NQ, H, D, q), q.new_empty(B * H, NQ, dtype=torch.float32)


@torch.library.custom_op("lra::small_head_backward", mutates_args=())
def small_head_backward_op(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None,
                           seed: Tensor | None, out: Tensor, lse: Tensor,
                           dropout_p: float) -> tuple[Tensor, Tensor, Tensor]:
    with on_device(q):
        return backward(grad, q, k, v, keep, seed, out, lse, dropout_p)


@small_head_backward_op.register_fake
def _(grad, q, k, v, keep, seed, out, lse, dropout_p):
    B, H, NQ, D = q.shape
    NK = k.shape[2]
    return heads_last(B, NQ, H, D, q), heads_last(B, NK, H, D, k), heads_last(B, NK, H, D, v)


def _save(ctx, inputs, output):
    q, k, v, keep, seed, dropout_p = inputs
    ctx.save_for_backward(q, k, v, keep, seed, *output)
    ctx.dropout_p = dropout_p


def _backward(ctx, grad, _):  # only out is differentiated: the log-sum-exp is state for the backward
    q, k, v, keep, seed, out, lse = ctx.saved_tensors
    return (*small_head_backward_op(grad, q, k, v, keep, seed, out, lse, ctx.dropout_p), None, None, None)


small_head_forward_op.register_autograd(_backward, setup_context=_save)


def small_head_attention(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None = None, dropout_p: float = 0.0,
                         seed: Tensor | int | None = None) -> Tensor:
    """softmax(q k^T / sqrt(D) + mask) v with attention dropout ``dropout_p``: q (B, H, Nq, D), k, v (B, H, Nk, D)
    of one dtype (fp32, bf16, fp16; any strides), D <= 32, keep (B, Nk) bool (True = a real key) or None -> (B, H, Nq,
    D) in q's dtype, a view of a (B, Nq, H, D) tensor. ``seed`` (an int, or a (1,) integer tensor on q's device):
    the dropout hash's; None draws one from torch's RNG on q's device (no host sync). A registered torch op
    (``torch.library``): autograd and torch.compile go through it."""
    check(q, k, v, keep, dropout_p)
    if dropout_p > 0 and seed is None:
        seed = torch.randint(2**32, (1,), device=q.device)
    elif isinstance(seed, int):
        seed = torch.tensor([seed & 0xFFFFFFFF], device=q.device)
    if keep is not None:
        keep = keep.to(torch.int8).contiguous()
    return small_head_forward_op(q, k, v, keep, seed if dropout_p > 0 else None, float(dropout_p))[0]


# ---------------------------------------------------------------------------------------------------- reference


def _mul32(x: Tensor, m: int) -> Tensor:
    """x * m mod 2^32 for int64 x in [0, 2^32), without int64 overflow (16-bit halves of m)."""
    return (x * (m & 0xFFFF) + (((x * (m >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


def mix(x: Tensor) -> Tensor:
    """lowbias32 on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, M1)
    x = x ^ (x >> 15)
    x = _mul32(x, M2)
    return x ^ (x >> 16)


def dropout_draws(seed: int, bh: int, n_q: int, n_k: int) -> Tensor:
    """(n_q, n_k) int64: the uint32 u of every score of head bh (the module docstring's hash), in PyTorch."""
    head = mix(torch.tensor(seed & 0xFFFFFFFF) ^ mix(torch.tensor(bh)))
    rows = mix(head ^ torch.arange(n_q))  # (n_q,)
    y = (rows[:, None] + torch.arange(n_k)[None, :]) & 0xFFFFFFFF
    y = _mul32(y, M1)
    return _mul32(y ^ (y >> 15), M2)


def dropout_keep_mask(seed: int, bh: int, n_q: int, n_k: int, p: float) -> Tensor:
    """(n_q, n_k) bool: which scores of head bh (= b * H + h) the kernels keep at dropout probability p."""
    return dropout_draws(seed, bh, n_q, n_k) >= threshold(p)


def kernel_keep_mask(seed: int, bh: int, n_q: int, n_k: int, p: float, device: torch.device | str = "cpu") -> Tensor:
    """The same mask computed by the kernels' own Triton functions (``_row_keys``, ``_kept``), for the tests."""
    out = torch.empty(n_q, n_k, dtype=torch.int8, device=device)
    seed_t = torch.tensor([seed & 0xFFFFFFFF], device=device)
    _keep_mask[(triton.cdiv(n_q, 32), triton.cdiv(n_k, 32))](seed_t, out, bh, n_q, n_k, threshold(p), BLOCK_M=32,
                                                            BLOCK_N=32)
    return out.bool()
