# An environment worker for tests/trainer/test_environment.cpp whose answer the sampled response
# names, so that each test drives one behaviour. Standard library only; see
# recipes/calculator_env.py for a real one.
#
# Responses: "text:S" observes the text S; "ids:1,2,3" observes those ids; "end:R" ends the episode
# with reward R and components {"turns": turn + 1}; "crash" exits 3; "hang" sleeps; "nodone" leaves
# "done" out; "both" gives text and ids; "badids" gives a negative id; "error" answers an error;
# "echo" observes the request itself (JSON) as text, so a test can read what kiln sent.
import json
import sys
import time


def answer(req):
    resp, rid = req["response"], req["id"]
    if resp == "crash":
        sys.stderr.write("test_env: crashing on purpose (id=%d)\n" % rid)
        sys.stderr.flush()
        sys.exit(3)
    if resp == "hang":
        time.sleep(3600)
    if resp.startswith("text:"):
        return {"id": rid, "done": False, "observation": resp[5:], "reward": 0.5}
    if resp.startswith("ids:"):
        return {"id": rid, "done": False, "observation_ids": [int(x) for x in resp[4:].split(",")]}
    if resp.startswith("end:"):
        return {"id": rid, "done": True, "reward": float(resp[4:]), "components": {"turns": req["turn"] + 1}}
    if resp == "nodone":
        return {"id": rid, "observation": "x"}
    if resp == "both":
        return {"id": rid, "done": False, "observation": "x", "observation_ids": [1]}
    if resp == "badids":
        return {"id": rid, "done": False, "observation_ids": [3, -1]}
    if resp == "error":
        return {"id": rid, "error": "cannot run this tool"}
    if resp == "echo":
        return {"id": rid, "done": False, "observation": json.dumps(req, sort_keys=True)}
    return {"id": rid, "done": True, "reward": 0.0}


for line in sys.stdin:
    if line.strip():
        sys.stdout.write(json.dumps(answer(json.loads(line))) + "\n")
        sys.stdout.flush()
