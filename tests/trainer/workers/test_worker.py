# A reward worker for tests/trainer/test_rewards.cpp that misbehaves on request: the response text
# (or a flag) says how. Standard library only; see recipes/reward_worker_example.py for a clean one.
#
# Flags: --exit-at-start (write to stderr, exit 1), --close-stdin (close stdin, then idle),
#        --reverse (read what is waiting, answer it in reverse order), --stderr-flood N (N KiB of
#        stderr per request), --log PATH (append each request id to PATH).
# Responses: "crash" exits 3; "crash-once:PATH" exits 3 unless PATH exists (and creates it);
#        "hang" sleeps; "garbage" writes junk lines first; "nan" answers NaN ("nestednan" with the next
#        request's id nested before its own); "str" a string reward;
#        "error" an error answer; "dup" answers twice; "noid" answers without an id. Otherwise the
#        reward is float(label) (0 when the label is not a number) with components {"len": len(response)}.
import json
import os
import select
import sys
import time


def answer(req):
    resp, rid = req["response"], req["id"]
    if resp == "crash":
        sys.stderr.write("test_worker: crashing on purpose (id=%d)\n" % rid)
        sys.stderr.flush()
        os._exit(3)
    if resp.startswith("crash-once:"):
        path = resp.split(":", 1)[1]
        if not os.path.exists(path):
            open(path, "w").close()
            sys.stderr.write("test_worker: crashing once (id=%d)\n" % rid)
            sys.stderr.flush()
            os._exit(3)
    if resp == "hang":
        time.sleep(3600)
    if resp == "garbage":
        out("this is not json")
        out('{"no_id": 1}')
        out('{"id": 987654321, "reward": 1}')
    if resp == "nan":
        return ['{"id": %d, "reward": NaN}' % rid]
    if resp == "nestednan":  # another request's id nested before its own, in a line that is not JSON
        return ['{"components": {"id": %d}, "id": %d, "reward": NaN}' % (rid + 1, rid)]
    if resp == "str":
        return [json.dumps({"id": rid, "reward": "high"})]
    if resp == "error":
        return [json.dumps({"id": rid, "error": "cannot parse the response"})]
    if resp == "noid":
        return [json.dumps({"reward": 1.0})]
    try:
        reward = float(req["label"])
    except ValueError:
        reward = 0.0
    line = json.dumps({"id": rid, "reward": reward, "components": {"len": len(resp)}})
    return [line, line] if resp == "dup" else [line]


def out(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main():
    args = sys.argv[1:]
    flood = int(args[args.index("--stderr-flood") + 1]) if "--stderr-flood" in args else 0
    log = args[args.index("--log") + 1] if "--log" in args else None
    if "--exit-at-start" in args:
        sys.stderr.write("test_worker: cannot load the scoring model\n")
        sys.exit(1)
    if "--close-stdin" in args:
        os.close(0)
        time.sleep(3600)
    reverse = "--reverse" in args
    buf = b""
    while True:
        chunk = os.read(0, 65536)  # raw reads: a buffered reader would hide waiting lines from select
        if not chunk:
            return
        buf += chunk
        if reverse:  # whatever else arrives within 50 ms joins the batch
            while select.select([0], [], [], 0.05)[0]:
                more = os.read(0, 65536)
                if not more:
                    break
                buf += more
        *lines, buf = buf.split(b"\n")
        if reverse:
            lines.reverse()
        for raw in lines:
            req = json.loads(raw)
            if log:
                with open(log, "a") as f:
                    f.write("%d\n" % req["id"])
            if flood:
                sys.stderr.write(("x" * 1023 + "\n") * flood)
                sys.stderr.flush()
            for reply in answer(req):
                out(reply)


if __name__ == "__main__":
    main()
