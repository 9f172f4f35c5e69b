#!/usr/bin/env python3
"""Prints kiln's training throughput over the peer's, both read from one log of a device call:
the last `grouped + fused` row of `kiln bench train` and every JSON line the peer printed.
Usage: peer_ratio.py LOG [LABEL]"""
import json, re, sys

text = open(sys.argv[1]).read()
label = sys.argv[2] if len(sys.argv) > 2 else "kiln / peer"
kiln = float(re.findall(r"grouped \+ fused\s+(\d+)", text)[-1])
for line in text.splitlines():
    if line.startswith("{") and '"peer_' in line:
        p = json.loads(line)
        mode = "compiled" if p.get("compile") else "eager"
        print(f"{label} ({mode}): {kiln:.0f} / {p['tok_s']:.0f} tok/s = {kiln / p['tok_s']:.2f}x")
