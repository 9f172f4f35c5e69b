#!/usr/bin/env python3
"""Writes the arithmetic task as a chat dataset, the shape a real job's data has.

Each line of the output JSONL is one example:
  {"prompt": [{"role": "user", "content": "What is 12 + 34? ..."}],
   "label": "46", "data_source": "add2", "metadata": {"a": 12, "b": 34, "op": "+"}}

Usage: recipes/make_arith_chat.py OUT_DIR [--train N] [--eval N] [--seed S]
writes OUT_DIR/train.jsonl and OUT_DIR/eval.jsonl with disjoint questions. Only the standard
library; the same seed gives the same files.
"""
import argparse
import json
import os
import random

# data_source -> (operators, operand range)
SOURCES = {
    "add2": ("+", 10, 99),
    "sub2": ("-", 10, 99),
    "mul": ("*", 2, 99),  # a one-digit factor (below): 784 distinct questions
}


def question(rng):
    source = rng.choice(sorted(SOURCES))
    ops, lo, hi = SOURCES[source]
    a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(ops)
    if op == "*":
        a = rng.randint(2, 9)  # one factor a digit
    value = a + b if op == "+" else a - b if op == "-" else a * b
    text = f"What is {a} {op} {b}? Reply with the number only."
    return source, text, str(value), {"a": a, "b": b, "op": op}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--train", type=int, default=12000)
    p.add_argument("--eval", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    seen, rows = set(), []
    while len(rows) < args.train + args.eval:
        source, text, label, meta = question(rng)
        if text in seen:
            continue
        seen.add(text)
        rows.append({"prompt": [{"role": "user", "content": text}], "label": label,
                     "data_source": source, "metadata": meta})
    os.makedirs(args.out_dir, exist_ok=True)
    for name, part in (("eval", rows[:args.eval]), ("train", rows[args.eval:])):
        with open(os.path.join(args.out_dir, name + ".jsonl"), "w", encoding="utf-8") as f:
            for row in part:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {args.train} train and {args.eval} eval examples to {args.out_dir}")


if __name__ == "__main__":
    main()
