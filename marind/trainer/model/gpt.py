"""A decoder-only transformer small enough to read top to bottom.

RMSNorm, rotary position embeddings, SwiGLU MLP, causal
``scaled_dot_product_attention``, tied or untied embeddings. Module names
(``layers.N.attention.wq`` ...) are the checkpoint FQNs and the targets of
the tensor-parallel plan in ``marind.trainer.parallel.mesh``. Attention reshapes with
``-1`` heads so that a tensor-parallel rank runs on its local heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from marind.trainer.config import ModelSpec
from marind.trainer.model.meta_init import init_parameters
from marind.trainer.model.moe import MoE, MoEConfig, is_moe_layer, moe_param_counts


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape: ``[model]`` of the spec with the vocabulary and sequence length resolved."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    seq_len: int
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    n_experts: int = 0            # mixture of experts (marind.trainer.model.moe); 0 = dense
    top_k: int = 2
    n_shared_experts: int = 0
    moe_every: int = 1
    moe_ffn_dim: int = 0
    capacity_factor: float = 0.0
    router_z_loss_coef: float = 0.0
    load_balance_coef: float = 0.0

    @classmethod
    def from_spec(cls, model: ModelSpec, *, seq_len: int, data_vocab_size: int) -> ModelConfig:
        """The config of ``model`` (``vocab_size`` 0 takes the data's).

        Args:
            model: the spec's ``[model]``.
            seq_len: ``data.seq_len`` (the rotary tables' length).
            data_vocab_size: the dataset's vocabulary size.

        Returns:
            The config.
        """
        return cls(vocab_size=model.vocab_size or data_vocab_size, dim=model.dim, n_layers=model.n_layers,
                   n_heads=model.n_heads, ffn_dim=model.ffn_dim, seq_len=seq_len,
                   tie_embeddings=model.tie_embeddings, norm_eps=model.norm_eps, rope_theta=model.rope_theta,
                   n_experts=model.n_experts, top_k=model.top_k, n_shared_experts=model.n_shared_experts,
                   moe_every=model.moe_every, moe_ffn_dim=model.moe_ffn_dim, capacity_factor=model.capacity_factor,
                   router_z_loss_coef=model.router_z_loss_coef, load_balance_coef=model.load_balance_coef)

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` has a MoE MLP."""
        return is_moe_layer(layer, n_experts=self.n_experts, moe_every=self.moe_every)

    def moe(self) -> MoEConfig:
        """The MoE layers' shape."""
        return MoEConfig(dim=self.dim, n_experts=self.n_experts, top_k=self.top_k,
                         moe_ffn_dim=self.moe_ffn_dim or self.ffn_dim, n_shared_experts=self.n_shared_experts,
                         capacity_factor=self.capacity_factor, router_z_loss_coef=self.router_z_loss_coef,
                         load_balance_coef=self.load_balance_coef)


def _mlp_params(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active per token) MLP parameters summed over the blocks."""
    dense = 3 * cfg.dim * cfg.ffn_dim
    n_moe = sum(cfg.is_moe(i) for i in range(cfg.n_layers))
    if not n_moe:
        return cfg.n_layers * dense, cfg.n_layers * dense
    m = cfg.moe()
    total, active = moe_param_counts(dim=m.dim, n_experts=m.n_experts, top_k=m.top_k, moe_ffn_dim=m.moe_ffn_dim,
                                     n_shared_experts=m.n_shared_experts)
    dense_layers = cfg.n_layers - n_moe
    return dense_layers * dense + n_moe * total, dense_layers * dense + n_moe * active


def param_count(cfg: ModelConfig, *, embedding: bool = True, active: bool = False) -> int:
    """Parameters of the model (closed form; matches ``sum(p.numel())``); ``active``: those one token
    uses (a MoE layer's router, ``top_k`` routed and the shared experts)."""
    mlp_total, mlp_active = _mlp_params(cfg)
    body = cfg.n_layers * (4 * cfg.dim * cfg.dim + 2 * cfg.dim) + cfg.dim + (mlp_active if active else mlp_total)
    emb = cfg.vocab_size * cfg.dim
    head = 0 if cfg.tie_embeddings else emb
    return body + head + (emb if embedding else 0)


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token: 6 x active matmul params (incl. the LM head and router) + attention scores."""
    matmul = cfg.n_layers * 4 * cfg.dim * cfg.dim + _mlp_params(cfg)[1] + cfg.vocab_size * cfg.dim
    attention = 12 * cfg.n_layers * cfg.dim * cfg.seq_len / 2  # causal: half the score matrix
    return 6.0 * matmul + attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, D); rotate pairs (even, odd) by the position angle."""
    t = x.shape[1]
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[:t, None, :], sin[:t, None, :]
    out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward: nn.Module = MoE(cfg.moe()) if cfg.is_moe(layer) else FeedForward(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    """The decoder-only transformer: embeddings, ``n_layers`` blocks, final norm, LM head.

    Built under ``torch.device("meta")`` it holds no memory and is not initialized: the
    trainer parallelizes it, materializes it (``to_empty``) and calls :meth:`init_weights`
    (``marind.trainer.build``). Built on a real device it is initialized at once with ``seed``.
    """

    def __init__(self, cfg: ModelConfig, *, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not cos.is_meta:
            self.init_weights(seed=seed)

    @torch.no_grad()
    def init_weights(self, *, seed: int) -> None:
        """Initialize every parameter (``marind.trainer.model.meta_init``: the same global weights in any
        layout) and recompute the rotary tables (after ``to_empty`` they hold garbage).

        Args:
            seed: the run's seed (``train.seed``).
        """
        init_parameters(self, n_layers=self.cfg.n_layers, seed=seed)
        cos_buf, sin_buf = self.get_buffer("rope_cos"), self.get_buffer("rope_sin")
        with torch.device(cos_buf.device):
            cos, sin = rotary_tables(self.cfg.head_dim, self.cfg.seq_len, self.cfg.rope_theta)
        cos_buf.copy_(cos)
        sin_buf.copy_(sin)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)`` of token ids ``(batch, seq)``."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        h = self.norm(h)
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in float32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
