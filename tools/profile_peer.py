#!/usr/bin/env python3
"""Profiles one training step of the plain-PyTorch peer (torch_peer.py, the baseline kiln's bench
train is compared with) under torch.profiler, eager and torch.compile, and writes Chrome traces for
tools/profile_summary.py. Usage: profile_peer.py PEER_DIR OUT_DIR"""
import os, sys
import torch, torch.nn.functional as F

peer_dir, out_dir = sys.argv[1], sys.argv[2]
sys.path.insert(0, peer_dir)
import torch_peer as P  # noqa: E402  (PEER_CFG picks the config, as for torch_peer.py itself)

torch.manual_seed(0)
with torch.device("cuda"):
    m = P.Model(P.c)
B, S = 8, 1024
tok = torch.randint(0, P.c["vocab"], (B * S,), device="cuda")
for compiled in (False, True):
    f = torch.compile(P.fwd) if compiled else P.fwd

    def step():
        loss = F.cross_entropy(f(m, tok, B, S).float(), tok.roll(-1))
        loss.backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        step()
        torch.cuda.synchronize()
    path = os.path.join(out_dir, f"peer-{'compiled' if compiled else 'eager'}.json")
    prof.export_chrome_trace(path)
    print("wrote", path, flush=True)
