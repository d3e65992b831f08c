"""A small diffusion transformer whose cross-attention reads the AR stage's KV cache.

Random (seeded) weights: the picture is abstract, but it is a deterministic function
of the received KV, so a different prompt gives a different image and a corrupted
transfer would show. Classifier-free guidance combines the prompt's KV with a
negative prompt's KV.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Self-attention over image patches, cross-attention into one AR layer's KV, MLP."""

    def __init__(self, width: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.norm1, self.norm2, self.norm3 = (
            nn.LayerNorm(width),
            nn.LayerNorm(width),
            nn.LayerNorm(width),
        )
        self.qkv = nn.Linear(width, 3 * width)
        self.self_out = nn.Linear(width, width)
        self.cross_q = nn.Linear(width, heads * head_dim)
        self.cross_out = nn.Linear(heads * head_dim, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        q, kk, vv = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        h = 4
        split = lambda t: t.view(b, n, h, w // h).transpose(1, 2)  # noqa: E731
        attn = F.scaled_dot_product_attention(split(q), split(kk), split(vv))
        x = x + self.self_out(attn.transpose(1, 2).reshape(b, n, w))
        # Cross-attention: K/V are the AR stage's [seq, heads, head_dim] for this layer.
        cq = self.cross_q(self.norm2(x)).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        ck = k.transpose(0, 1).unsqueeze(0).expand(b, -1, -1, -1).to(cq.dtype)
        cv = v.transpose(0, 1).unsqueeze(0).expand(b, -1, -1, -1).to(cq.dtype)
        cross = F.scaled_dot_product_attention(cq, ck, cv)
        x = x + self.cross_out(cross.transpose(1, 2).reshape(b, n, -1))
        return x + self.mlp(self.norm3(x))


class TinyDiT(nn.Module):
    """Patchify -> blocks (one per received KV layer) -> unpatchify; predicts the noise."""

    def __init__(
        self,
        kv_layers: int,
        heads: int,
        head_dim: int,
        image: int = 32,
        patch: int = 4,
        width: int = 128,
    ) -> None:
        super().__init__()
        self.image, self.patch = image, patch
        self.embed = nn.Linear(3 * patch * patch, width)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2, width) * 0.02)
        self.time = nn.Linear(1, width)
        self.blocks = nn.ModuleList(Block(width, heads, head_dim) for _ in range(kv_layers))
        self.out = nn.Linear(width, 3 * patch * patch)

    def _patchify(self, x: torch.Tensor) -> torch.Tensor:
        p = self.patch
        b = x.shape[0]
        x = x.unfold(2, p, p).unfold(3, p, p)  # b, c, H/p, W/p, p, p
        return x.permute(0, 2, 3, 1, 4, 5).reshape(b, -1, 3 * p * p)

    def _unpatchify(self, t: torch.Tensor) -> torch.Tensor:
        p, g = self.patch, self.image // self.patch
        b = t.shape[0]
        t = t.view(b, g, g, 3, p, p).permute(0, 3, 1, 4, 2, 5)
        return t.reshape(b, 3, self.image, self.image)

    def forward(
        self, x: torch.Tensor, t: float, kv: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        h = self.embed(self._patchify(x)) + self.pos
        h = h + self.time(torch.full((1, 1, 1), t, dtype=h.dtype))
        for block, (k, v) in zip(self.blocks, kv, strict=True):
            h = block(h, k, v)
        return self._unpatchify(self.out(h))


@torch.no_grad()
def sample(
    model: TinyDiT,
    kv_pos: list[tuple[torch.Tensor, torch.Tensor]],
    kv_neg: list[tuple[torch.Tensor, torch.Tensor]] | None,
    steps: int = 8,
    guidance: float = 3.0,
    seed: int = 0,
) -> torch.Tensor:
    """x0-prediction sampling from noise with classifier-free guidance; RGB image in [0, 1].

    Each step moves the latent toward the model's clean-image prediction, so the
    final image is entirely a function of the conditioning KV (and the seed).
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 3, model.image, model.image, generator=g)
    for i in range(steps):
        t = 1.0 - i / steps
        pred = model(x, t, kv_pos)
        if kv_neg is not None:
            pred_neg = model(x, t, kv_neg)
            pred = pred_neg + guidance * (pred - pred_neg)
        pred = pred / (pred.std() + 1e-6)
        x = x + (pred - x) / (steps - i)
    x = (x - x.mean(dim=(2, 3), keepdim=True)) / (x.std(dim=(2, 3), keepdim=True) + 1e-6)
    return torch.sigmoid(x[0] * math.sqrt(2.0))


def build(kv_layers: int, heads: int, head_dim: int, seed: int = 0) -> TinyDiT:
    torch.manual_seed(seed)
    return TinyDiT(kv_layers, heads, head_dim).eval()


def save_png(img: torch.Tensor, path: str, size: int = 256) -> None:
    """Upsample smoothly to ``size`` pixels and write a PNG."""
    from PIL import Image

    up = F.interpolate(img.unsqueeze(0), size=(size, size), mode="bicubic", align_corners=False)[0]
    arr = (up.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    Image.fromarray(arr).save(path)
