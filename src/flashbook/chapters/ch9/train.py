"""A tiny causal transformer for Chapter 9's training run: the same model, the same data and the
same initial weights trained twice, once with the book's attention and once with SDPA, so the
two loss curves differ only by the attention's rounding.

The task needs attention: each sequence is a random pattern of ``period`` tokens repeated, so
after the first period every next token can be copied from ``period`` positions back.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["TinyLM", "repeat_batch", "train", "sdpa_attention"]


def sdpa_attention(q, k, v):
    """Causal SDPA on (B, H, N, d): the baseline."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class TinyLM(nn.Module):
    """Embedding -> one pre-norm block (causal self-attention through ``attention``, an MLP) ->
    logits. ``attention(q, k, v)`` takes (B, H, N, d) tensors."""

    def __init__(self, vocab: int = 16, width: int = 32, heads: int = 2, length: int = 32):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(length, width) * 0.1)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens, attention):
        B, N = tokens.shape
        x = self.embed(tokens) + self.pos[:N]
        q, k, v = self.qkv(self.norm1(x)).view(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = attention(q.contiguous(), k.contiguous(), v.contiguous())     # (B, H, N, d)
        x = x + self.proj(a.transpose(1, 2).reshape(B, N, -1))
        x = x + self.mlp(self.norm2(x))
        return self.head(x)


def repeat_batch(step: int, batch: int = 8, length: int = 32, period: int = 5, vocab: int = 16,
                 device="cpu"):
    """Seeded (tokens, targets) of one step: random patterns repeated to ``length + 1``."""
    g = torch.Generator().manual_seed(1000 + step)
    pattern = torch.randint(0, vocab, (batch, period), generator=g)
    seq = pattern.repeat(1, length // period + 2)[:, :length + 1].to(device)
    return seq[:, :-1], seq[:, 1:]


def train(attention, steps: int, *, batch: int = 8, seed: int = 0, lr: float = 1e-2,
          device="cpu", **shape) -> list[float]:
    """Train a fresh ``TinyLM`` (weights from ``seed``) for ``steps`` Adam steps on batches of
    ``batch`` sequences; the losses."""
    torch.manual_seed(seed)
    model = TinyLM(**{k: shape[k] for k in ("vocab", "heads", "length") if k in shape}).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        tokens, targets = repeat_batch(step, batch, length=model.pos.shape[0], device=device,
                                       vocab=model.head.out_features)
        logits = model(tokens, attention)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           targets.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
