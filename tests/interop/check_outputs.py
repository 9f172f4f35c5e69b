#!/usr/bin/env python3
"""Reads kiln's files with the Python ecosystem's own readers (safetensors, h5py) and recomputes the
log-probs with a separate PyTorch implementation of docs/MODEL.md §1 written here from the spec. An NVFP4
checkpoint (hf_quant_config.json) is decoded here from docs/MODEL.md §4 first.
Usage: check_outputs.py <checkpoint dir> <logprobs.safetensors> <logprobs.h5>"""
import json
import math
import os
import sys

import h5py
import torch
from safetensors.torch import load_file


E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def dequantize_nvfp4(sd):
    """Replaces every NVFP4 linear (U8 codes, F8_E4M3 block scales, F32 tensor scale) by its fp32 values."""
    count = 0
    for name in [n for n in sd if n.endswith(".weight_scale")]:
        base = name[: -len("_scale")]
        packed = sd.pop(base)
        assert packed.dtype == torch.uint8 and sd[name].dtype == torch.float8_e4m3fn, f"{base}: dtypes"
        assert sd[base + "_scale_2"].numel() == 1 and sd[name].shape[-1] * 8 == packed.shape[-1], f"{base}: shapes"
        codes = torch.stack([packed & 15, packed >> 4], -1).flatten(-2).long()  # element 0 in the low nibble
        scale = (sd.pop(name).float() * sd.pop(base + "_scale_2").float()).repeat_interleave(16, -1)
        sd[base] = E2M1[codes] * scale
        sd.pop(base.replace(".weight", ".input_scale"), None)
        count += 1
    return count


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):  # x [T, H, hd]
    hd = x.shape[-1]
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rot = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
    return x * cos + rot * sin


def forward(sd, cfg, tokens):
    t = torch.tensor(tokens)
    n, L, E, k = len(tokens), cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"]
    hq, hkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, W, period = cfg["rms_norm_eps"], cfg["sliding_window"], cfg["full_attention_period"]
    g = lambda name: sd[name].double()
    x = g("model.embed_tokens.weight")[t]
    pos = torch.arange(n)
    routing = []
    for i in range(L):
        p = f"model.layers.{i}."
        full = (L - 1 - i) % period == 0
        h = rms(x, g(p + "input_layernorm.weight"), eps)
        q = rope((h @ g(p + "self_attn.q_proj.weight").T).view(n, hq, hd), pos, cfg["rope_theta"])
        kk = rope((h @ g(p + "self_attn.k_proj.weight").T).view(n, hkv, hd), pos, cfg["rope_theta"])
        v = (h @ g(p + "self_attn.v_proj.weight").T).view(n, hkv, hd)
        kk, v = kk.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        s = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(hd)
        i_, j_ = pos[:, None], pos[None]
        mask = (j_ <= i_) & (full | (j_ > i_ - W))
        a = torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v).reshape(n, -1)
        x = x + rms(a @ g(p + "self_attn.o_proj.weight").T, g(p + "post_attention_layernorm.weight"), eps)
        h = rms(x, g(p + "pre_moe_layernorm.weight"), eps)
        probs = (h @ g(p + "mlp.router.weight").T).softmax(-1)
        top = probs.topk(k, -1).indices
        routing.append(top)
        w = probs.gather(1, top)
        w = w / w.sum(-1, keepdim=True)
        z = h @ g(p + "mlp.pooler.weight").T
        m = torch.zeros(n, z.shape[1], dtype=torch.float64)
        for tok in range(n):
            for slot in range(k):
                e = int(top[tok, slot])
                ep = p + f"mlp.experts.{e}."
                y = (torch.nn.functional.silu(g(ep + "gate_proj.weight") @ z[tok]) * (g(ep + "up_proj.weight") @ z[tok]))
                y = rms(g(ep + "down_proj.weight") @ y, g(ep + "norm.weight"), eps)
                m[tok] += w[tok, slot] * y
        x = x + rms(m @ g(p + "mlp.unpooler.weight").T, g(p + "post_moe_layernorm.weight"), eps)
    logits = rms(x, g("model.norm.weight"), eps) @ g("lm_head.weight").T
    lp = logits.log_softmax(-1)
    out = torch.full((n,), float("nan"), dtype=torch.float64)
    out[1:] = lp[:-1].gather(1, t[1:, None])[:, 0]
    return out, torch.stack(routing, 1)


def main():
    ckpt, st_path, h5_path = sys.argv[1:4]
    cfg = json.load(open(f"{ckpt}/config.json"))
    sd = load_file(f"{ckpt}/model.safetensors")
    nvfp4 = dequantize_nvfp4(sd) if os.path.exists(f"{ckpt}/hf_quant_config.json") else 0
    assert sd["model.layers.0.mlp.router.weight"].dtype == torch.float32, "router must be F32"
    st = load_file(st_path)
    with h5py.File(h5_path, "r") as f:
        h5 = {name: torch.from_numpy(f[name][()]) for name in ("tokens", "cu_seqlens", "logprobs", "routing")}
    for name in ("tokens", "cu_seqlens", "routing"):
        assert torch.equal(st[name], h5[name].to(st[name].dtype)), f"{name}: safetensors and HDF5 outputs differ"
    assert torch.allclose(st["logprobs"], h5["logprobs"], equal_nan=True)
    cu = st["cu_seqlens"].tolist()
    worst = 0.0
    for s in range(len(cu) - 1):
        toks = st["tokens"][cu[s]:cu[s + 1]].tolist()
        ref, routing = forward(sd, cfg, toks)
        got = st["logprobs"][cu[s]:cu[s + 1]].double()
        assert torch.isnan(got[0]) and torch.isnan(ref[0])
        worst = max(worst, (got[1:] - ref[1:]).abs().max().item() if len(toks) > 1 else 0.0)
        assert torch.equal(st["routing"][cu[s]:cu[s + 1]].long(), routing), f"sequence {s}: routing differs"
    what = f"NVFP4 checkpoint ({nvfp4} quantised linears decoded here)" if nvfp4 else "checkpoint"
    print(f"interop: {what}: safetensors + h5py read kiln's files; PyTorch re-implementation max |dlogprob| = {worst:.2e}")
    assert worst < 1e-4, "log-probs differ from the PyTorch re-implementation"


if __name__ == "__main__":
    main()
