#!/usr/bin/env python3
"""Breaks a Kineto Chrome trace (kiln bench train --profile, or torch.profiler's export_chrome_trace)
down by op class: GPU kernel time per class, the top kernels and the launch gaps. Each kernel is
charged to the CPU op that launched it and, in the backward, to the autograd node around that op.
Usage: profile_summary.py TRACE.json [--label NAME] [--steps N] [--top K]"""
import argparse, bisect, json, re, sys
from collections import defaultdict

CLASSES = [  # (class, kernel-name pattern, op-name pattern); the first match wins
    ("attention", r"flash|fmha|attention|attn", r"scaled_dot_product|flash|efficient_attention|attention"),
    ("gemm", r"gemm|cutlass|nvjet|xmma|cublas|GroupProblem|Kernel2", r"^aten::(mm|addmm|bmm|_grouped_mm|matmul|linear|baddbmm)$"),
    ("moe permute/combine", r"moe_|index|gather|scatter|sort|radix|Radix|embedding|Dispatch|Combine",
     r"index|scatter|gather|sort|embedding|moe|take|nonzero|bincount|cumsum"),
    ("norm", r"rms|norm", r"^aten::(pow|mean|rsqrt)$|rms|norm"),
    ("loss", r"logsumexp|softmax|log_softmax|nll|cross_entropy|logprob", r"logsumexp|softmax|nll|cross_entropy|logprob"),
    ("cast/copy", r"copy|cast|convert", r"^aten::(to|_to_copy|copy_|contiguous|clone)$"),
    ("optimizer", r"multi_tensor|adam|muon", r"adam|muon|optimizer"),
]


def classify(kernel, op):
    for name, kpat, opat in CLASSES:
        if re.search(opat, op or "") or re.search(kpat, kernel):
            return name
    return "elementwise/other"


def load(path):
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(events, label, steps, top):
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "operator")]
    by_ext = {}
    for e in ops:
        ext = e.get("args", {}).get("External id")
        if ext is not None:
            by_ext[ext] = e
    # autograd nodes per thread, to charge backward kernels to the forward op they differentiate
    nodes = defaultdict(list)
    for e in ops:
        if e["name"].startswith("autograd::engine::evaluate_function:"):
            nodes[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"].split(":")[-1].strip()))
    for v in nodes.values():
        v.sort()
    starts = {t: [n[0] for n in v] for t, v in nodes.items()}

    def node_of(op):
        if op is None or op["tid"] not in nodes:
            return ""
        i = bisect.bisect_right(starts[op["tid"]], op["ts"]) - 1
        if i >= 0:
            s, e, name = nodes[op["tid"]][i]
            if s <= op["ts"] <= e:
                return name
        return ""

    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    if not gpu:
        print(f"{label}: no GPU events in the trace")
        return
    per_class, per_kernel, per_op = defaultdict(float), defaultdict(lambda: [0.0, 0]), defaultdict(float)
    total = 0.0
    for k in gpu:
        op = by_ext.get(k.get("args", {}).get("External id"))
        opname = op["name"] if op else ""
        node = node_of(op)
        cls = "memset/memcpy" if k["cat"] != "kernel" else classify(k["name"], opname)
        if node and cls == "elementwise/other":
            cls = classify("", node) if classify("", node) != "elementwise/other" else cls
        d = k["dur"] / steps
        total += d
        per_class[cls] += d
        short = re.sub(r"\(.*", "", k["name"].replace("(anonymous namespace)::", ""))[:90]
        per_kernel[(short, opname, node)][0] += d
        per_kernel[(short, opname, node)][1] += 1
        per_op[(node + " > " if node else "") + (opname or "?")] += d
    iv = sorted((k["ts"], k["ts"] + k["dur"]) for k in gpu)
    busy, cur_s, cur_e = 0.0, iv[0][0], iv[0][1]
    for s, e in iv[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = (iv[-1][1] - iv[0][0])
    print(f"\n== {label}: {len(gpu) / steps:.0f} GPU kernels per step, GPU span {span / steps / 1e3:.2f} ms, "
          f"busy {busy / steps / 1e3:.2f} ms, idle (launch gaps) {(span - busy) / steps / 1e3:.2f} ms")
    print(f"{'class':<22} {'ms/step':>9} {'share':>7}")
    for cls, d in sorted(per_class.items(), key=lambda x: -x[1]):
        print(f"{cls:<22} {d / 1e3:>9.2f} {d / total * 100:>6.1f}%")
    print(f"top {top} ops (autograd node > op) by GPU time:")
    for name, d in sorted(per_op.items(), key=lambda x: -x[1])[:top]:
        print(f"  {d / 1e3:>8.2f} ms {d / total * 100:>5.1f}%  {name[:110]}")
    print(f"top {top} kernels:")
    for (kname, opname, node), (d, n) in sorted(per_kernel.items(), key=lambda x: -x[1][0])[:top]:
        print(f"  {d / 1e3:>8.2f} ms x{n / steps:<4.0f} {kname[:70]}  [{(node + ' > ') if node else ''}{opname}]")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--label", default="")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    summarize(load(a.trace), a.label or a.trace, a.steps, a.top)
