#!/usr/bin/env python3
"""A kiln reward worker that scores math answers; copy it as the template for your own scorer.

kiln starts a pool of these (a recipe's `reward: {type: worker, command: [python3, this file], ...}`)
and keeps them running for the whole job. The protocol is JSON Lines over stdin/stdout:

  kiln -> worker, one line per sample:
    {"id": 7, "prompt": "...", "response": "...", "label": "...", "data_source": "...",
     "metadata": {...}, "truncated": false}
  worker -> kiln, one line per request, in any order, flushed at once:
    {"id": 7, "reward": 1.1, "components": {"correct": 1, "format": 1}}   (components optional)
    {"id": 7, "error": "why this sample could not be scored"}

Rules: answer every request exactly once with its id; write nothing else to stdout (logs go to
stderr, whose last lines kiln shows when something fails); rewards are finite numbers (json.dumps
writes NaN for float("nan"), which is not JSON and fails the request); exit when stdin ends.
kiln may write several requests before reading the answers, so a worker may batch them. A worker
that exits, closes stdout or is silent past the timeout is killed and restarted, and its requests
are sent again once; the recipe's on_failure says whether a request that still fails scores 0 or
stops the run.

Here: reward = correct + FORMAT_WEIGHT * format, where format is 1 when the response puts its
answer in \\boxed{...}, and correct is 1 when the final answer (the last \\boxed{...}, else the
last number) equals the label as a number (1/2 == 0.5 == \\frac{1}{2}, 1,000 == 1000) or, when
either is not a number, as text without spaces and $. Standard library only.
"""
import json
import re
import sys
from fractions import Fraction

FORMAT_WEIGHT = 0.1
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def last_boxed(text):
    """The content of the last \\boxed{...} (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None  # cut off: no answer


def final_answer(text):
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = NUMBER.findall(text)
    return numbers[-1].rstrip(",") if numbers else None


def as_number(text):
    """A Fraction for 12, -3.50, 1,000, 1/2 or \\frac{1}{2}; None for anything else."""
    s = text.replace("$", "").replace(" ", "").replace("\\dfrac", "\\frac").rstrip(".")
    m = re.fullmatch(r"(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}", s)
    if m:
        s = m.group(1) + m.group(2) + "/" + m.group(3)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def same(answer, label):
    a, b = as_number(answer), as_number(label)
    if a is not None and b is not None:
        return a == b
    norm = lambda t: t.replace("$", "").replace(" ", "").rstrip(".")
    return norm(answer) == norm(label)


def score(request):
    response, label = request["response"], request["label"]
    answer = final_answer(response)
    correct = 1.0 if answer is not None and same(answer, label) else 0.0
    fmt = 1.0 if last_boxed(response) is not None else 0.0
    return {"reward": correct + FORMAT_WEIGHT * fmt, "components": {"correct": correct, "format": fmt}}


def main():
    for line in sys.stdin:  # one request per line until kiln closes stdin
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except ValueError as e:  # no id to answer: log it; kiln counts the request as timed out
            print("reward_worker_example: bad request line: %s" % e, file=sys.stderr, flush=True)
            continue
        try:
            reply = {"id": request["id"], **score(request)}
        except Exception as e:  # one bad sample must not take the worker down
            reply = {"id": request.get("id"), "error": "%s: %s" % (type(e).__name__, e)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
