"""Routing Transformer (models/routing.py): clustered attention against dense references, and the centroids'
online k-means (EMA update, padding, eval, checkpoints). CPU, small sizes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import create_model
from models.routing import SELF_LOGIT
from tests.mixer_checks import assert_appended_padding_changes_nothing, lengths_mask

D, H = 32, 2


def build(max_len: int, seed: int = 0, **options):
    torch.manual_seed(seed)
    return create_model("routing", d_model=D, n_heads=H, d_qkv=D, dropout=0.0, max_len=max_len, **options).eval()




def dense_attention(model, x, mask, allowed):
    """Softmax attention over the shared, layer-normed q = k with an explicit (B, H, N, N) mask of allowed pairs:
    self only when no other key is allowed (its logit gets SELF_LOGIT), never a padded key."""
    B, N, _ = x.shape
    r, v = model.routing_vectors(x)  # (B, H, N, Dh)
    dots = r @ r.transpose(-1, -2) * r.shape[-1] ** -0.5  # (B, H, N, N)
    allowed = allowed & mask[:, None, None, :]
    dots = dots.masked_fill(~allowed, float("-inf"))
    dots = torch.where(torch.eye(N, dtype=torch.bool), dots.diagonal(dim1=-2, dim2=-1)[..., None] + SELF_LOGIT, dots)
    o = torch.softmax(dots, -1) @ v  # (B, H, N, Dh)
    return model.out(o.transpose(1, 2).reshape(B, N, -1))  # (B, N, D)


def test_one_cluster_is_full_shared_qk_attention():
    model = build(max_len=80, n_clusters=1)
    x = torch.randn(2, 71, D)
    mask = lengths_mask([71, 50], 71)
    everything = torch.ones(2, H, 71, 71, dtype=torch.bool)
    expected = dense_attention(model, x, mask, everything)
    torch.testing.assert_close(model(x, mask)[mask], expected[mask], atol=1e-5, rtol=1e-4)  # padded rows: ignored


def test_a_lone_token_attends_to_itself():
    model = build(max_len=16, n_clusters=1)
    x = torch.randn(1, 5, D)
    v = model.routing_vectors(x)[1]  # (1, H, 5, Dh)
    expected = model.out(v[:, :, 0].reshape(1, -1))  # its own value, every head
    torch.testing.assert_close(model(x, lengths_mask([1], 5))[0, 0], expected[0], atol=1e-5, rtol=1e-4)


def window_reference_mask(model, x, mask):
    """The routing rule written from its definition: sort each head's positions by (cluster, position), number the
    sorted slots, cut them into chunks of ``model.chunk``; i may attend to j iff they share a cluster and their
    chunks are at most one apart."""
    cluster = model.assign(model.routing_vectors(x)[0], mask)  # (B, H, N)
    B, _, N = cluster.shape
    allowed = torch.zeros(B, H, N, N, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            order = sorted(range(N), key=lambda i: (int(cluster[b, h, i]), i))
            chunk = torch.empty(N, dtype=torch.long)
            for slot, i in enumerate(order):
                chunk[i] = slot // model.chunk
            same = cluster[b, h][:, None] == cluster[b, h][None, :]
            near = (chunk[:, None] - chunk[None, :]).abs() <= 1
            allowed[b, h] = same & near
    return allowed, cluster


def test_tokens_attend_within_their_cluster_in_neighbouring_chunks():
    model = build(max_len=64, n_clusters=4)  # chunks of 16 slots
    x = torch.randn(2, 60, D)
    mask = lengths_mask([60, 45], 60)
    allowed, cluster = window_reference_mask(model, x, mask)
    sizes = torch.stack([torch.bincount(c, minlength=5)[:4] for c in cluster.flatten(0, 1)])  # (B*H, K)
    assert sizes.max() > model.chunk + 1 and (sizes <= model.chunk + 1).any()  # both regimes occur
    # a cluster of at most chunk + 1 tokens is seen whole by its members: routing attention exactly
    for b in range(2):
        for h in range(H):
            for k in range(4):
                members = (cluster[b, h] == k) & mask[b]
                if members.sum() <= model.chunk + 1:
                    assert allowed[b, h][members][:, members].all()
    expected = dense_attention(model, x, mask, allowed)
    torch.testing.assert_close(model(x, mask)[mask], expected[mask], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("options", [{"n_clusters": 4}, {"n_clusters": 1}, {}])
def test_appended_or_changed_padding_leaves_real_outputs_unchanged(options):
    model = build(max_len=128, **options)
    assert_appended_padding_changes_nothing(model, [40, 27], 40, 29, D)


def expected_centroids(model, old, x, mask):
    """The EMA step from its definition: each centroid with assigned real tokens moves to
    normalise(decay * old + (1 - decay) * mean of their unit routing vectors); the others stay."""
    r = model.routing_vectors(x)[0].detach()  # (B, H, N, Dh)
    cluster = model.assign(r, mask)  # (B, H, N), with the centroids before the step
    u = F.normalize(r, dim=-1)
    new = old.clone()
    for h in range(H):
        for k in range(model.n_clusters):
            members = (cluster[:, h] == k) & mask  # (B, N): real tokens routed to k
            if members.any():
                mean = u[:, h][members].mean(0)  # (Dh,)
                new[h, k] = F.normalize(model.decay * old[h, k] + (1 - model.decay) * mean, dim=0)
    return new, cluster


def test_training_moves_centroids_toward_their_tokens_mean_and_ignores_padding():
    model = build(max_len=64, n_clusters=4, decay=0.9)
    x = torch.randn(2, 50, D)
    mask = lengths_mask([50, 31], 50)
    old = model.centroids.clone()
    expected, cluster = expected_centroids(model, old, x, mask)
    assert (cluster[~mask[:, None].expand_as(cluster)] == 4).all()  # padding sits in the extra cluster
    model.train()
    model(x, mask)
    torch.testing.assert_close(model.centroids, expected, atol=1e-6, rtol=1e-5)
    assert not torch.equal(model.centroids, old)
    u = F.normalize(model.routing_vectors(x)[0].detach(), dim=-1)
    for h in range(H):
        for k in range(4):
            members = (cluster[:, h] == k) & mask
            if members.any():  # closer to the mean direction than before
                mean = F.normalize(u[:, h][members].mean(0), dim=0)
                assert model.centroids[h, k] @ mean >= old[h, k] @ mean - 1e-6

    # the same step with more padding, full of junk: the same centroids
    model.centroids.copy_(old)
    x_junk = torch.cat([x, torch.randn(2, 14, D) * 10], dim=1)
    x_junk[1, 31:50] = torch.randn(19, D) * 10
    model(x_junk, lengths_mask([50, 31], 64))
    torch.testing.assert_close(model.centroids, expected, atol=1e-6, rtol=1e-5)


def test_decay_zero_replaces_centroids_by_the_mean_direction():
    model = build(max_len=64, n_clusters=4, decay=0.0)
    x = torch.randn(1, 40, D)
    mask = lengths_mask([40], 40)
    old = model.centroids.clone()
    cluster = model.assign(model.routing_vectors(x)[0], mask)
    u = F.normalize(model.routing_vectors(x)[0].detach(), dim=-1)
    model.train()(x, mask)
    for h in range(H):
        for k in range(4):
            members = cluster[0, h] == k
            want = F.normalize(u[0, h][members].mean(0), dim=0) if members.any() else old[h, k]
            torch.testing.assert_close(model.centroids[h, k], want, atol=1e-6, rtol=1e-5)


def test_eval_leaves_centroids_alone():
    model = build(max_len=64, n_clusters=4)
    old = model.centroids.clone()
    with torch.no_grad():
        model(torch.randn(2, 50, D), lengths_mask([50, 20], 50))
    assert torch.equal(model.centroids, old)


def test_centroids_are_checkpointed_and_drawn_from_the_seed():
    a, b, c = build(max_len=64, seed=3), build(max_len=64, seed=3), build(max_len=64, seed=4)
    assert torch.equal(a.centroids, b.centroids) and not torch.equal(a.centroids, c.centroids)
    assert "centroids" in a.state_dict()
    torch.testing.assert_close(a.centroids.norm(dim=-1), torch.ones(H, a.n_clusters))  # unit vectors
    a.train()(torch.randn(2, 50, D), lengths_mask([50, 20], 50))
    c.load_state_dict(a.state_dict())  # a resumed run continues from the saved centroids
    assert torch.equal(c.centroids, a.centroids) and not torch.equal(c.centroids, b.centroids)


@pytest.mark.gpu
def test_cuda_matches_cpu():
    """The same computation on CUDA (fused SDPA kernels, head size padded to a multiple of 8) as on CPU."""
    model = build(max_len=128, n_clusters=6)
    x = torch.randn(2, 100, D)
    mask = lengths_mask([100, 70], 100)
    expected = model(x, mask)
    got = model.cuda()(x.cuda(), mask.cuda()).cpu()
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-4, rtol=1e-3)
