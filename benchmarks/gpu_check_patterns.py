"""On CUDA: the block-sparse models' FlexAttention path equals their dense-mask path (outputs and
gradients), with and without padding, at lengths that are and are not multiples of the block."""
import torch

from models import create_model


def run(model, x, mask, backend):
    model.backend = backend
    model.zero_grad()
    x = x.clone().requires_grad_()
    y = model(x, mask)
    (y * mask[..., None]).square().mean().backward()
    return y.detach(), x.grad, model.qkv.weight.grad.clone()


worst = 0.0
for name in ["local", "sparse", "longformer", "bigbird"]:
    for n, holes in [(1152, False), (1025, False), (1025, True)]:
        torch.manual_seed(0)
        m = create_model(name, d_model=64, n_heads=2, d_qkv=64, dropout=0.0, max_len=2048).cuda()
        x = torch.randn(3, n, 64, device="cuda")
        mask = torch.ones(3, n, dtype=torch.bool, device="cuda")
        if holes:
            mask[1, 600:] = False
            mask[2, ::3] = False
        flex, dense = run(m, x, mask, "flex"), run(m, x, mask, "dense")
        errs = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(flex, dense)]
        worst = max(worst, *errs)
        print(f"{name:10s} N={n} padding={holes}: rel. err. out/dx/dW = " + " ".join(f"{e:.1e}" for e in errs))
print(f"worst relative error flex vs dense: {worst:.1e} -> {'OK' if worst < 1e-4 else 'MISMATCH'}")
