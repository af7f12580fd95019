"""A small decoder-only language model in plain torch, LLaMA/DeepSeek style:
RMSNorm, rotary position embeddings, SwiGLU, tied embeddings. Sizes from tiny to ~1B."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab_size: int
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 352
    max_seq_len: int = 2048
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"d_model {self.d_model} must split into {self.n_heads} heads of even size")


SIZES = {  # name -> (d_model, n_layers, n_heads, d_ff); 1b is ~1.1B parameters with a 32k vocab
    "tiny": (128, 2, 4, 352),
    "small": (384, 6, 6, 1024),
    "base": (768, 12, 12, 2048),
    "1b": (2048, 22, 16, 5632),
}


def config_for(size: str, vocab_size: int, max_seq_len: int) -> ModelConfig:
    if size not in SIZES:
        raise ValueError(f"model size must be one of {sorted(SIZES)}, got {size!r}")
    d, n, h, ff = SIZES[size]
    return ModelConfig(vocab_size=vocab_size, d_model=d, n_layers=n, n_heads=h, d_ff=ff, max_seq_len=max_seq_len)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # in fp32: bf16 loses too much in the mean of squares
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_tables(head_dim: int, max_len: int, theta: float):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(max_len).float(), inv)  # [T, hd/2]
    return freqs.cos(), freqs.sin()


def apply_rope(x, cos, sin):
    # x: [B, H, T, hd]; rotate pairs (x1, x2) of the two halves
    x1, x2 = x.chunk(2, dim=-1)
    if cos.dim() == 2:   # the table; else already taken at each sample's positions ([B, 1, T, hd/2])
        cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = c.n_heads, c.d_model // c.n_heads
        self.attn_norm, self.mlp_norm = RMSNorm(c.d_model), RMSNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model, bias=False)
        self.out = nn.Linear(c.d_model, c.d_model, bias=False)
        self.gate_up = nn.Linear(c.d_model, 2 * c.d_ff, bias=False)
        self.down = nn.Linear(c.d_ff, c.d_model, bias=False)

    def forward(self, x, cos, sin, masked=None):
        B, T, D = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if masked is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:   # Megatron's mask (True: masked out); SDPA's bool mask says where attention may go
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=~masked)
        x = x + self.out(a.transpose(1, 2).reshape(B, T, D))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)  # SwiGLU


class DecoderLM(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.d_model)
        cos, sin = rope_tables(c.d_model // c.n_heads, c.max_seq_len, c.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens, per_sample: bool = False, *, position_ids=None, attention_mask=None, loss_mask=None):
        """tokens: int64 [B, T+1] (inputs + shifted labels) -> mean cross-entropy loss; with
        per_sample, each sample's mean too ([B], for per-source losses of a mixture).

        Megatron's inputs from a batch's boundaries (feeder_client.packing.megatron_inputs):
        position_ids [B, T] (RoPE at each token's position in its document), attention_mask
        bool [B, 1, T, T] (True: masked out), loss_mask [B, T] (the loss is its weighted mean)."""
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        x = self.embed(inputs)
        cos, sin = self.cos, self.sin
        if position_ids is not None:
            cos, sin = cos[position_ids][:, None], sin[position_ids][:, None]
        for blk in self.blocks:
            x = blk(x, cos, sin, attention_mask)
        logits = F.linear(self.norm(x), self.embed.weight)  # tied embeddings
        each = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        each = each.view(labels.shape)
        weight = torch.ones_like(each) if loss_mask is None else loss_mask.to(each.dtype)
        if not per_sample:
            return (each * weight).sum() / weight.sum().clamp(min=1)
        each = (each * weight).sum(1) / weight.sum(1).clamp(min=1)
        return each.mean(), each

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
