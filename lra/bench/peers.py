"""The public PyTorch packages of the methods we implement, one attention layer each, for
``python -m lra.layer_bench --peers``: timed in the same process, on the same card, with the same loop as ours.

Protocol (results/README.md, `layer_bench.csv`): d 256, 4 heads of 64, projections included, no dropout,
no mask. Each entry builds the package's own layer with the settings its stored rows (``peers_h200_layer`` in
results/published.csv) were measured with, and is named as those rows' ``note``: a live row and a stored row
of one name are the same layer. The packages are optional (``pip install 'lra[peers]'``): a missing one turns
its rows into ``missing: ...`` rows instead of stopping the sweep; another version than the pin runs, and its
rows name the version that ran.

All are pure-Python wheels (py3-none-any) that accept torch 2.5-2.14 as installed (none moves torch). A machine
without network (the GPU machine) gets them as wheels (docs/gpu.md):

    python -m pip download --no-deps --only-binary=:all: -d .whl $(python -m lra.peers --pins)

The recurrent mixers' packages run on CUDA only and stay out of the extra (``CUDA_PINS``): mamba-ssm builds a CUDA
extension (causal-conv1d's) when installed, and flash-linear-attention's layers need a GPU and transformers. They
are installed by hand where they run (``CUDA_INSTALL``); elsewhere their rows say ``missing: ...`` with that command.
"""
from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType

from torch import nn

D_MODEL, HEADS = 256, 4
D_HEAD = D_MODEL // HEADS
INSTALL = "pip install 'lra[peers]'"

# The packages (pinned here and in pyproject's `peers` extra; tests/test_layer_bench.py checks they agree) ...
PINS = {
    "linear-attention-transformer": "0.19.1",
    "linformer": "0.2.3",
    "local-attention": "1.11.2",
    "performer-pytorch": "1.1.4",
    "reformer-pytorch": "1.4.4",
    "nystrom-attention": "0.0.14",
    "sinkhorn-transformer": "0.11.4",
}
# ... and what they pull in besides torch, as resolved on 2026-11-26 (pip install 'lra[peers]' with torch 2.13).
# Needed as wheels only where pip cannot resolve (no network). `packaging` (colt5-attention) is left out: lra's
# own dependencies (matplotlib) already bring it.
DEPENDENCIES = {
    "einops": "0.8.2",
    "axial-positional-embedding": "0.3.12",
    "product-key-memory": "0.3.0",
    "colt5-attention": "0.11.2",
    "hyper-connections": "0.4.11",
    "torch-einops-utils": "0.2.0",
}


# Packages of the recurrent mixers, pinned but CUDA-only (module docstring): the command that installs each.
CUDA_PINS = {"mamba-ssm": "2.3.2.post1", "flash-linear-attention": "0.6.0"}
CUDA_INSTALL = {
    "mamba-ssm": "pip install mamba-ssm==2.3.2.post1 causal-conv1d==1.7.0 --no-build-isolation, on a CUDA machine",
    "flash-linear-attention": "pip install flash-linear-attention==0.6.0, on a CUDA machine",
}


class MissingPeer(ImportError):
    """A package is not importable: its row says ``missing: <install hint>`` and the sweep goes on."""


class Projected(nn.Module):
    """qkv Linear -> heads -> ``attend(q, k, v)`` -> out Linear, for an attention that has no projections of its
    own (SDPA, local-attention's LocalAttention): the projections of our mixers (models.base.MultiHeadMixer,
    no biases), so that the layer costs what a whole attention layer costs."""

    def __init__(self, attend: Callable | nn.Module):
        super().__init__()
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL, bias=False)
        self.out = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.attend = attend  # a Module (LocalAttention) registers as a submodule; a function does not

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, D_HEAD).permute(2, 0, 3, 1, 4)  # 3 x (B, H, N, Dh)
        o = self.attend(q, k, v)  # (B, H, N, Dh)
        return self.out(o.transpose(1, 2).reshape(b, n, D_MODEL))  # (B, N, D)


@dataclass(frozen=True)
class Peer:
    """One public implementation: ``make(module, n)`` builds its layer from the imported ``module``."""

    model: str  # the registry mixer it is set beside
    dist: str | None  # PyPI distribution; None for the bare SDPA layer (torch itself)
    label: str  # the settings, as the stored rows' note writes them after "<dist> <version>"
    module: str  # what to import; its failure is a missing package
    make: Callable[[ModuleType, int], nn.Module]

    @property
    def pin(self) -> str | None:
        return {**PINS, **CUDA_PINS}.get(self.dist) if self.dist else None

    @property
    def cuda_only(self) -> bool:
        return self.dist in CUDA_PINS

    @property
    def install(self) -> str:
        """The command that installs the package: the extra's, or a CUDA-only package's own."""
        return CUDA_INSTALL[self.dist] if self.cuda_only else INSTALL

    def installed(self) -> str | None:
        """The version installed, None when the distribution is absent (or for SDPA, which is torch)."""
        if self.dist is None:
            return None
        try:
            return version(self.dist)
        except PackageNotFoundError:
            return None

    def name(self) -> str:
        """As in tables: "<dist> <version> <label>", the version that runs (the pin when none is installed)."""
        if self.dist is None:
            return self.label
        return f"{self.dist} {self.installed() or self.pin}{' ' + self.label if self.label else ''}"

    def provenance(self) -> dict:
        """The row's ``implementation``, ``package`` (what is installed) and ``pin`` (what the protocol names)."""
        installed = self.installed()
        return dict(implementation=self.name(), package=f"{self.dist}=={installed}" if installed else None,
                    pin=f"{self.dist}=={self.pin}" if self.dist else None)

    def build(self, n: int) -> nn.Module:
        """The layer for sequences of length ``n`` (Linformer's projection and Sinkhorn's sorter are sized by it)."""
        try:
            module = importlib.import_module(self.module)
        except ImportError as error:
            detail = f"({error})" if self.cuda_only else f"(or {self.dist}=={self.pin}; {error})"
            raise MissingPeer(f"missing: {self.install} {detail}") from error
        return self.make(module, n)


class TwoWays(nn.Module):
    """A causal layer made bidirectional as our recurrent mixers are (models/mamba.py, models/gla.py): one layer
    reads the sequence, a second reads it reversed, their outputs summed. Each direction has all its own weights
    (ours share some: mamba its x and z projection, norm and output; gla its value, gate, norm and output), so
    the pair computes more than our layer does. Layers that return a tuple (flash-linear-attention's: output,
    attentions, cache) give their first element."""

    def __init__(self, make: Callable[[], nn.Module]):
        super().__init__()
        self.forward_pass, self.reversed_pass = make(), make()

    def forward(self, x):
        def output(y):
            return y[0] if isinstance(y, tuple) else y

        return output(self.forward_pass(x)) + output(self.reversed_pass(x.flip(1))).flip(1)  # (B, N, D)


def _local(la: ModuleType, n: int) -> nn.Module:
    """LocalAttention over windows of 256 seeing the window before and after; no rotary embedding (``dim`` unset).
    ``autopad`` only acts off multiples of 256 (the tests' short inputs, whose zero padding it leaves unmasked),
    never at the protocol's lengths."""
    return Projected(la.LocalAttention(window_size=256, causal=False, look_backward=1, look_forward=1, dropout=0.0,
                                       autopad=True))


def _reformer(n_hashes: int) -> Callable[[ModuleType, int], nn.Module]:
    """LSHSelfAttention with the package's bucket size (64); it runs full attention on inputs of one bucket or less."""
    return lambda rp, n: rp.LSHSelfAttention(D_MODEL, heads=HEADS, dim_head=D_HEAD, bucket_size=64, n_hashes=n_hashes,
                                             causal=False, dropout=0.0)


PEERS: list[Peer] = [
    Peer("transformer", None, "SDPA exact (cuDNN flash)", "torch.nn.functional",  # SDPA picks its kernel per device
         lambda f, n: Projected(f.scaled_dot_product_attention)),
    Peer("linear", "linear-attention-transformer", "", "linear_attention_transformer.linear_attention_transformer",
         lambda lat, n: lat.SelfAttention(D_MODEL, HEADS, dim_head=D_HEAD, causal=False, dropout=0.0)),
    Peer("linformer", "linformer", "(k 256)", "linformer",
         lambda lf, n: lf.LinformerSelfAttention(D_MODEL, seq_len=n, k=256, heads=HEADS, dim_head=D_HEAD,
                                                 share_kv=False, dropout=0.0)),
    Peer("local", "local-attention", "(window 256)", "local_attention", _local),
    Peer("performer", "performer-pytorch", "(256 features)", "performer_pytorch",
         lambda pp, n: pp.SelfAttention(dim=D_MODEL, heads=HEADS, dim_head=D_HEAD, nb_features=256, causal=False,
                                        dropout=0.0)),
    Peer("reformer", "reformer-pytorch", "(1 hash)", "reformer_pytorch", _reformer(1)),
    Peer("reformer", "reformer-pytorch", "(4 hashes)", "reformer_pytorch", _reformer(4)),
    Peer("nystromformer", "nystrom-attention", "(128 landmarks)", "nystrom_attention",
         lambda na, n: na.NystromAttention(D_MODEL, dim_head=D_HEAD, heads=HEADS, num_landmarks=128, dropout=0.0)),
    # fails under bf16 autocast on CUDA (a scatter's dtype mismatch, as its results/layer_bench.csv rows say): its
    # rows then say error, ours still run
    Peer("sinkhorn", "sinkhorn-transformer", "(bucket 64)", "sinkhorn_transformer",
         lambda st, n: st.SinkhornSelfAttention(D_MODEL, bucket_size=64, max_seq_len=n, heads=HEADS, dim_head=D_HEAD,
                                                dropout=0.0, attn_dropout=0.0)),
    # CUDA only (CUDA_PINS), each at our mixer's settings (conf/model/<name>.yaml, d_qkv = D_MODEL), both directions.
    # mamba-ssm's Mamba2: d_state 64, expand 2, our heads (headdim 2 D_MODEL / HEADS), its fused conv + scan path.
    Peer("mamba", "mamba-ssm", "(Mamba2, d_state 64, headdim 128, two directions)", "mamba_ssm.modules.mamba2",
         lambda ms, n: TwoWays(lambda: ms.Mamba2(D_MODEL, d_state=64, d_conv=4, expand=2, headdim=2 * D_MODEL // HEADS,
                                                 ngroups=1))),
    # flash-linear-attention's GatedLinearAttention: keys 0.5 x, values 1 x the width, gate rank 16, tau 16, chunk_gla.
    Peer("gla", "flash-linear-attention", "(GatedLinearAttention, two directions)", "fla.layers.gla",
         lambda fla, n: TwoWays(lambda: fla.GatedLinearAttention(mode="chunk", hidden_size=D_MODEL, num_heads=HEADS,
                                                                  expand_k=0.5, expand_v=1.0))),
]


BASELINE = PEERS[0]  # the bare SDPA layer: every row, ours and theirs, is read against it


def for_models(models: list[str]) -> list[Peer]:
    """The entries set beside ``models``, and always the SDPA baseline."""
    return [p for p in PEERS if p is BASELINE or p.model in models]


def pins() -> list[str]:
    """Every wheel a machine without network needs, as pip requirements."""
    return [f"{dist}=={v}" for dist, v in {**PINS, **DEPENDENCIES}.items()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lra.peers", description=__doc__.splitlines()[0])
    parser.add_argument("--pins", action="store_true", help="print the pinned wheels (packages + dependencies)")
    args = parser.parse_args(argv)
    if args.pins:
        print(" ".join(pins()))
        return
    for peer in PEERS:
        installed = peer.provenance()["package"] or ("torch" if peer is BASELINE else f"missing: {peer.install}")
        print(f"{peer.model:14s} {peer.name():45s} {installed}")


if __name__ == "__main__":
    main()
