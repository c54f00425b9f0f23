"""On CUDA: the block-sparse models' FlexAttention path equals their dense-mask path (outputs and
gradients), with and without padding and with no mask at all, at lengths that are and are not multiples of
the block, for the defaults and for the settings that leave tiles partial (LRA's 64-blocks, a global token)."""
import torch

from models import create_model

SPECS = [("local", {}), ("sparse", {}), ("longformer", {}), ("longformer", {"global_tokens": 1}), ("bigbird", {}),
         ("bigbird", {"block": 64})]


def run(model, x, mask, backend):
    model.backend = backend
    model.zero_grad()
    x = x.clone().requires_grad_()
    y = model(x, mask)
    (y if mask is None else y * mask[..., None]).square().mean().backward()
    return y.detach(), x.grad, model.qkv.weight.grad.clone()


worst = 0.0
for name, options in SPECS:
    for n, padding in [(1152, "none"), (1025, "none"), (1025, "holes"), (1025, "mask=None")]:
        torch.manual_seed(0)
        m = create_model(name, d_model=64, n_heads=2, d_qkv=64, dropout=0.0, max_len=2048, **options).cuda()
        x = torch.randn(3, n, 64, device="cuda")
        mask = torch.ones(3, n, dtype=torch.bool, device="cuda")
        if padding == "holes":
            mask[1, 600:] = False
            mask[2, ::3] = False
        if padding == "mask=None":
            mask = None
        flex, dense = run(m, x, mask, "flex"), run(m, x, mask, "dense")
        errs = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(flex, dense)]
        worst = max(worst, *errs)
        label = name + "".join(f" {k}={v}" for k, v in options.items())
        print(f"{label:26s} N={n} padding={padding:9s}: rel. err. out/dx/dW = " + " ".join(f"{e:.1e}" for e in errs))
print(f"worst relative error flex vs dense: {worst:.1e} -> {'OK' if worst < 1e-4 else 'MISMATCH'}")
