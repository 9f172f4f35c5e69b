#!/usr/bin/env python3
# A tool-use environment for the arithmetic task, to copy: the JSONL protocol of kiln's
# environments (trainer/environment.h), standard library only. Each turn the model either calls
# the calculator, "calc 12+34", and is shown "=46" as the observation, or answers with a number,
# which ends the episode: reward 1 when it equals the label, plus 0.2 for a well-formed answer
# (components "correct", "format" and "tool_calls"). Anything else ends the episode with reward 0.
# The worker keeps no state: every request carries the episode's history. Asked to demonstrate
# (kiln sft with sft.demonstrations: environment), it shows half the problems solved with the
# calculator, "calc 12+34", "=46", "46", and leaves the other half to their label, so that the warm
# start has seen the tool and RL can learn when it pays.
import json
import re
import sys

MAX_CALLS = 2  # calculator calls per episode; a further call ends the episode unanswered
CALL = re.compile(r"calc\s+([0-9+\-*() ]{1,40})")
NUMBER = re.compile(r"-?[0-9]+")


def evaluate(expr):
    """The value of an arithmetic expression (digits, + - * and parentheses), or None."""
    tokens = re.findall(r"[0-9]+|[+\-*()]", expr)
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def take():
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def atom():
        t = peek()
        if t == "(":
            take()
            v = total()
            if take() != ")":
                raise ValueError
            return v
        if t == "-":
            take()
            return -atom()
        if t is None or not t.isdigit():
            raise ValueError
        return int(take())

    def product():
        v = atom()
        while peek() == "*":
            take()
            v *= atom()
        return v

    def total():
        v = product()
        while peek() in ("+", "-"):
            v = v + product() if take() == "+" else v - product()
        return v

    try:
        v = total()
        return v if pos == len(tokens) else None
    except (ValueError, IndexError):
        return None


def step(req):
    text = req["response"].strip()
    calls = len(req["history"])  # every earlier turn was a call (an answer ends the episode)
    parts = {"tool_calls": calls}
    call = CALL.fullmatch(text)
    if call and calls < MAX_CALLS:
        value = evaluate(call.group(1))
        observation = "=%d\n" % value if value is not None else "=error\n"
        return {"done": False, "observation": observation, "reward": 0.0}
    if NUMBER.fullmatch(text):
        correct = 1.0 if text == req["label"].strip() else 0.0
        parts.update(correct=correct, format=1.0)
        return {"done": True, "reward": correct + 0.2, "components": parts}
    parts.update(correct=0.0, format=0.0)
    return {"done": True, "reward": 0.0, "components": parts}


def demonstrate(req):
    expr = req["prompt"].strip().rstrip("=").strip()
    value = evaluate(expr)
    # A stable half of the problems (not Python's salted hash): the sum of the prompt's bytes.
    if value is None or sum(req["prompt"].encode()) % 2:
        return {"turns": []}
    return {"turns": [{"response": "calc " + expr, "observation": "=%d\n" % value},
                      {"response": req["label"].strip()}]}


for line in sys.stdin:
    if not line.strip():
        continue
    req = json.loads(line)
    try:
        answer = demonstrate(req) if req.get("demonstrate") else step(req)
    except Exception as e:  # a bug here fails this episode, not the run
        answer = {"error": "%s: %s" % (type(e).__name__, e)}
    answer["id"] = req["id"]
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
