#!/usr/bin/env python3
"""One latent-MoE layer of the plain-PyTorch peer (torch_peer.py's config PEER_CFG, default full1)
without the embedding and head: forward + backward on 8 sequences x 1024 tokens, eager, the
baseline for `kiln bench train configs/muse-full-layer.yaml`. Prints one JSON line.
Usage: peer_layer.py PEER_DIR"""
import json, os, sys, time
import torch

sys.path.insert(0, sys.argv[1])
os.environ.setdefault("PEER_CFG", "full1")
import torch_peer as P  # noqa: E402
from muse_torch import Layer, rms, flops_per_token  # noqa: E402

c = P.c
torch.manual_seed(0)
with torch.device("cuda"):
    layer = Layer(c, c["layers"] - 1, torch.bfloat16)  # the last layer of the stack: full attention
B, S = 8, 1024
x = torch.randn(B * S, c["d"], device="cuda", dtype=torch.bfloat16)


def step():
    h = x + rms(P.attn_b(layer, rms(x, layer.n1), B, S), layer.n2)
    mo, _ = layer.moe(rms(h, layer.n3), True)
    out = h + rms(mo, layer.n4)
    out.float().pow(2).mean().backward()


for _ in range(2):
    step()
torch.cuda.synchronize()
t = time.perf_counter()
n = 5
for _ in range(n):
    step()
torch.cuda.synchronize()
dt = (time.perf_counter() - t) / n
fl = 3 * (flops_per_token(c, S) - 2 * c["d"] * c["vocab"]) * B * S  # without the head
print(json.dumps(dict(kind="peer_layer", cfg=os.environ["PEER_CFG"], tokens=B * S, ms=dt * 1e3,
                      tok_s=B * S / dt, tflops=fl / dt / 1e12)), flush=True)
