"""Performer: FAVOR+ attention (Choromanski, Likhosherstov, Dohan, Song, Gane, Sarlos, Hawkins, Davis,
Mohiuddin, Kaiser, Belanger, Colwell, Weller, 2021, "Rethinking Attention with Performers", ICLR 2021,
https://arxiv.org/abs/2009.14794).

softmax attention exp(q . k / sqrt(Dh)) is estimated without bias by positive orthogonal random features:
with q' = q Dh^-1/4, k' = k Dh^-1/4 and m rows w_r (blocks of orthonormal directions, chi(Dh) lengths, so each
row is marginally N(0, I)),

    phi(x) = exp(W x - |x|^2 / 2) / sqrt(m),   exp(q' . k') = E[phi(q')^T phi(k')],
    out_i  = phi(q_i)^T (sum_j phi(k_j) [v_j, 1]^T)  ->  numerator / (denominator + 1e-6).

Stabilisers (exact, they cancel in the ratio): key features are divided by their per-feature maximum over
the real keys, the query features multiplied back by it and then normalised to sum 1 per query (which also
absorbs exp(-|q'|^2/2) / sqrt(m)). Every feature's key sum is then >= 1, so the normaliser is >= 1: no
overflow, no 0/0. The maxima are constants for the gradient.

Precision under bf16 autocast: the feature maps (their exponents come from fp32 matmuls with the random
matrix), stabilisers, key sums and the normaliser are fp32 (fp16/bf16 exponentials overflow:
facebookresearch/xformers#96). The products of the [0, 1] feature maps with values and gradients
(sum_n fk_n v_n^T, fq times that, and their backward) take bf16 operands with fp32 accumulation, as SDPA
multiplies its probabilities by V: these are 8 of the 12 N x m x Dh matmuls of a training step, and fp32
matmuls run at half of bf16's rate at best and move twice the bytes (on the GPU they are TF32, since the
runner and bench set matmul precision "high"; the exponents' matmuls too). Tested against fp64: 0.5%
relative error, most of it from rounding q, k, v themselves to bf16.

Two executions of the softmax kernel (``backend``, an attribute: how it runs, never what it computes):
* **triton** (CUDA's default for unpacked rows): the kernels of ``models/_favor_triton.py`` form each tile's
  exponents and features in registers and use them at once, as flash attention does with its scores, so no
  (N x m) map is ever written: a step moves O(N Dh) bytes per head and the backward keeps q, k, v, the output and
  the (m x Dh) summaries. The PyTorch path writes each (B, H, N, m) fp32 map (537 MB at N 4096, batch 32, 4 heads,
  m 256) and reads it back several times, which makes it slower than a package computing in bf16.
* **torch** (the CPU, packed rows, or ``backend = "torch"``): ``models/_favor.py`` in PyTorch operations. On CUDA
  its backward is written by hand and recomputes the two feature maps instead of keeping them (``recompute``:
  2 x B H N m fp32 fewer saved per layer; the CPU path keeps them, faster there), and forward and backward run
  through torch.compile (``compile_core``). ``chunk_size`` (None = whole sequence) walks the sequence in chunks
  of that many positions, so the feature-map transients are O(B H chunk m) instead of O(B H N m), for a second
  key matmul in the forward (the key stabiliser needs every key before any feature is formed); the memory is
  saved with the hand-written backward only. These three serve this path alone.
Measurements of both: ``results/layer_bench.csv``.
``backend``, ``recompute`` (True | False, default True), ``compile_core`` (True | False, default True) and
``chunk_size`` (an integer >= 1, or None, the default) are attributes, not constructor options (``execution``,
models/base.py's ``execution_settings``): how the layer runs, never what it computes, so they stay out of a run's
config hash; a run sets them with ``trainer.mixer``, the benches with their variants.

Features come from a torch.Generator seeded with ``seed`` (draw j uses a seed derived from (seed, j)), so a
layer's features are reproducible and survive a checkpoint (the matrix is a buffer; seed and counters are
extra state). ``seed: null`` takes each layer's seed from torch's RNG at construction, so layers differ but
follow the run seed. In training the features are redrawn every ``redraw_every`` training forward calls
(0 = never); in eval they are frozen, so evaluation is deterministic. The heads of a layer share the matrix
(as in the paper's code). The count is host-side (a graph break under torch.compile): the mixer keeps it at the
start of its call, or, with ``schedule_outside``, the model holding it does at the start of the model's call
(lra's classifier does), so that a compiled model stays one graph.

``kernel: relu`` is LRA's default Performer ("generalized" attention with deterministic features):
phi(x) = relu(x) + 1e-3 on the raw q, k, no random features, no stabiliser; ``n_features``/``redraw_every``
are then unused (LRA ignored ``nb_features`` as well). It is the Linear Transformer's computation with another
feature map (``models.base.kernel_attention``), with the precision described above for FAVOR+.

Complexity: softmax kernel O(N m Dh) time; memory O(N Dh) with the Triton kernels, else O(N m) transient per head
(O(chunk m) with ``chunk_size``) and O(N Dh) kept for the backward;
relu kernel O(N Dh^2) time, O(N Dh) memory. Nothing N x N is ever formed.
Packed rows (``segments``): each example has its own key stabiliser (the maximum over its own keys, so its
normaliser is >= 1 as when alone, however far its exponents lie below another example's) and its own summaries,
which its queries read. One matmul per product serves the S examples of a row (S = the most in any row): values and
gradients are spread into S blocks of Dh columns, zero outside their example's (``spread``), and each position picks
its example's block of the result (``pick``); the relu kernel does the same. So the products with values or
gradients (2 forward, 4 backward) and the normaliser cost S-fold FLOPs per row, with (B, H, N, S Dh) transients and
S summaries kept; the (N x m) feature maps are computed once. Unpacked rows skip all of it (the helpers return their
input).
Padding: padded keys get features exactly 0 (their exponent is -inf) and are excluded from the key
stabiliser, so padding never contributes; padded queries get an output the encoder ignores.
Deviations from LRA: LRA's Performer used no padding mask; its ListOps run used FAVOR+ with 2 features
redrawn every call from a seed of ceil(1e7 * sum q) (here: a declared seed and schedule); the key stabiliser
there was a max over the whole batch and the gradient flowed through both maxima; attention dropout is not
applied (LRA ignored it too).
"""
from __future__ import annotations

import os
from typing import Literal

import torch

from ._favor import FavorAttention, favor_attention, relu_attention, upcast
from .base import Count, MultiHeadMixer, compiled, segment_members, settings, takes_fused_path
from .registry import Taxonomy, register_model

try:  # imported here, not in ``attend``, so that a compiled model traces no import
    from ._favor_triton import favor_attention_triton
except ImportError:  # a torch without triton (CPU builds): the PyTorch path everywhere
    favor_attention_triton = None


def orthogonal_gaussian(m: int, d: int, generator: torch.Generator) -> torch.Tensor:
    """(m, d) rows: blocks of d orthonormal directions with chi(d) lengths (paper's ORF, 'scaling 0')."""
    blocks = torch.randn(-(-m // d), d, d, generator=generator)  # (n_blocks, d, d)
    q, r = torch.linalg.qr(blocks)  # q (n_blocks, d, d), orthonormal columns
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)  # sign fix: Haar-distributed
    rows = q.transpose(-1, -2).reshape(-1, d)[:m]  # (m, d)
    lengths = torch.randn(m, d, generator=generator).norm(dim=-1)  # (m,): chi(d), as |N(0, I)|
    return rows * lengths[:, None]  # (m, d)



@register_model
class Performer(MultiHeadMixer):
    taxonomy = Taxonomy("Choromanski et al. 2021, arXiv 2009.14794", "N", ("KR",), decode=True)
    backends = ("auto", "triton", "torch")  # the values of ``backend`` (how it runs, not what it computes)
    # how the torch path runs (the module docstring): attributes, set on a built mixer
    execution = settings(recompute=(True, False), compile_core=(True, False), chunk_size=Count(none="no chunks"))
    supports_segments = True

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_qkv: int,
        dropout: float,
        max_len: int,
        *,
        n_features: int = 256,
        kernel: Literal["softmax", "relu"] = "softmax",
        redraw_every: int = 1000,
        seed: int | None = None,
    ):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        if kernel not in ("softmax", "relu"):
            raise ValueError(f"kernel must be 'softmax' (FAVOR+) or 'relu' (LRA's generalized), got {kernel!r}")
        if n_features < 1:
            raise ValueError(f"n_features must be >= 1, got {n_features}")
        if redraw_every < 0:
            raise ValueError(f"redraw_every must be >= 0 (0 = never), got {redraw_every}")
        self.kernel, self.n_features, self.redraw_every = kernel, int(n_features), int(redraw_every)
        # null: a per-layer seed from torch's RNG (so layers differ, reproducibly under the run seed)
        self.seed = int(torch.randint(2**31, ())) if seed is None else int(seed)
        self.backend = "auto"  # softmax kernel: "triton" | "torch" (models/_favor*.py); how it runs, not what
        self.recompute = True  # the torch path on CUDA: the backward recomputes the feature maps
        self.compile_core = True  # the torch path on CUDA: its bodies through torch.compile
        self.chunk_size = None  # the torch path: positions per chunk; None = the whole sequence at once
        self.train_calls = 0  # training forward calls seen; drives the redraw schedule
        self.schedule_outside = False  # True: the model holding this mixer calls advance_schedule once per call
        self.draws = 0  # index of the current feature draw
        self.register_buffer("features", self.draw(0) if kernel == "softmax" else None)  # (m, Dh) fp32

    def draw(self, index: int) -> torch.Tensor:
        # the CPU generator keeps 32 seed bits: mix (seed, index) into them with two odd multipliers
        generator = torch.Generator().manual_seed((self.seed * 0x9E3779B1 + index * 0x85EBCA77) & 0xFFFFFFFF)
        return orthogonal_gaussian(self.n_features, self.d_head, generator)  # (m, Dh), drawn on the CPU

    @torch.compiler.disable  # host-side bookkeeping; keeps a compiled graph free of Python-int guards
    def advance_schedule(self) -> None:
        if not (self.training and self.features is not None and self.redraw_every):
            return
        if self.train_calls and self.train_calls % self.redraw_every == 0:
            self.draws += 1
            # a new tensor, not copy_(): graphs still awaiting backward keep the features they used
            self.features = self.draw(self.draws).to(self.features)
        self.train_calls += 1

    def get_extra_state(self) -> dict:
        return {"seed": self.seed, "train_calls": self.train_calls, "draws": self.draws}

    def set_extra_state(self, state: dict) -> None:
        self.seed, self.train_calls, self.draws = (int(state[k]) for k in ("seed", "train_calls", "draws"))

    def takes_triton(self, q: torch.Tensor, member: torch.Tensor | None) -> bool:
        """Whether the softmax kernel runs the Triton kernels (``backend``): on CUDA under "auto", for unpacked rows
        (packed rows, with their per-example sums, take the PyTorch path)."""
        if self.backend == "triton":
            if member is not None:
                raise ValueError("backend='triton' takes unpacked rows only; packed rows (segments) run the PyTorch "
                                 "path: set backend='auto' or 'torch'")
            if favor_attention_triton is None:
                raise ModuleNotFoundError("backend='triton' needs the triton package (it comes with CUDA builds of "
                                          "torch): pip install triton, or set backend='torch'")
            if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError("backend='triton' runs on CUDA, or on the CPU under Triton's interpreter "
                                 "(TRITON_INTERPRET=1 before triton is imported); here set backend='torch'")
        return takes_fused_path(self, "triton",
                                q.is_cuda and member is None and favor_attention_triton is not None)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        # first: at most one graph break a call, at its start; none in eval or without redraws (the schedule returns
        # at once), nor where the model holding this mixer advances the schedule itself (``schedule_outside``)
        if not self.schedule_outside:
            self.advance_schedule()
        return super().forward(x, mask, segments)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               segments: torch.Tensor | None = None) -> torch.Tensor:
        keep = mask[:, None, :, None]  # (B, 1, N, 1)
        member = None if segments is None else segment_members(segments)  # (B, 1, N, S)
        fused = self.compile_core and q.is_cuda
        if self.kernel == "relu":
            with torch.autocast(device_type=q.device.type, enabled=False):
                return (compiled(relu_attention) if fused else relu_attention)(q, k, v, keep, member).to(q.dtype)
        w = upcast(self.features).to(upcast(q).dtype) * self.d_head**-0.25  # (m, Dh): folds in q' = q Dh^-1/4
        if self.takes_triton(q, member):  # no (N x m) map in memory: the fastest and leanest on a GPU
            return favor_attention_triton(q, k, v, keep, w)  # (B, H, N, Dh), q's dtype
        if self.recompute and q.is_cuda:  # hand-written backward, features recomputed: lean GPU memory
            return FavorAttention.apply(q, k, v, keep, w, fused, member, self.chunk_size).to(q.dtype)  # (B, H, N, Dh)
        with torch.autocast(device_type=q.device.type, enabled=False):  # autograd keeps both feature maps
            core = compiled(favor_attention) if fused else favor_attention
            return core(q, k, v, keep, w, member, self.chunk_size).to(q.dtype)  # (B, H, N, Dh)
