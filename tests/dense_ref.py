"""An independent dense reference for one decoder layer, reading upstream (transformers) key names.

Shares no code with draftgraph.models: its own RMSNorm, rotate-half RoPE and causal softmax attention
over a single sequence, so drafter tests check our weight mapping and wiring, not our code against itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos[:, None].float() * inv[None]
    emb = torch.cat([ang, ang], -1)[:, None, :]  # [T, 1, D]
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * emb.cos() + rot * emb.sin()


def layer(x_attn_in, residual, w, p, cfg, pos):
    """One decoder layer: residual + attn(x_attn_in); then + mlp(post_norm(.)). `p` is the key prefix."""
    t = x_attn_in.shape[0]
    nh, nkv, hd = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q = (x_attn_in @ w[p + "self_attn.q_proj.weight"].t()).view(t, nh, hd)
    k = (x_attn_in @ w[p + "self_attn.k_proj.weight"].t()).view(t, nkv, hd)
    v = (x_attn_in @ w[p + "self_attn.v_proj.weight"].t()).view(t, nkv, hd)
    q, k = rope(q, pos, cfg["theta"]), rope(k, pos, cfg["theta"])
    k = k.repeat_interleave(nh // nkv, 1)
    v = v.repeat_interleave(nh // nkv, 1)
    att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    h = residual + att.transpose(0, 1).reshape(t, nh * hd) @ w[p + "self_attn.o_proj.weight"].t()
    m = rms(h, w[p + "post_attention_layernorm.weight"], cfg["eps"])
    mlp = F.silu(m @ w[p + "mlp.gate_proj.weight"].t()) * (m @ w[p + "mlp.up_proj.weight"].t())
    return h + mlp @ w[p + "mlp.down_proj.weight"].t()


def random_layer(prefix, hidden, inter, heads, kv_heads, head_dim, in_features=None, input_norm=True, gen=None):
    in_features = in_features or hidden
    r = lambda *s: torch.randn(*s, generator=gen) * 0.08
    w = {
        prefix + "self_attn.q_proj.weight": r(heads * head_dim, in_features),
        prefix + "self_attn.k_proj.weight": r(kv_heads * head_dim, in_features),
        prefix + "self_attn.v_proj.weight": r(kv_heads * head_dim, in_features),
        prefix + "self_attn.o_proj.weight": r(hidden, heads * head_dim),
        prefix + "mlp.gate_proj.weight": r(inter, hidden),
        prefix + "mlp.up_proj.weight": r(inter, hidden),
        prefix + "mlp.down_proj.weight": r(hidden, inter),
        prefix + "post_attention_layernorm.weight": 1 + r(hidden),
    }
    if input_norm:
        w[prefix + "input_layernorm.weight"] = 1 + r(hidden)
    return w
