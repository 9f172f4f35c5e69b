# An environment worker for tests/trainer/test_environment.cpp whose answer the sampled response
# names, so that each test drives one behaviour. Standard library only; see
# recipes/calculator_env.py for a real one.
#
# Responses: "text:S" observes the text S; "ids:1,2,3" observes those ids; "end:R" ends the episode
# with reward R and components {"turns": turn + 1}; "crash" exits 3; "hang" sleeps; "nodone" leaves
# "done" out; "both" gives text and ids; "badids" gives a negative id; "error" answers an error;
# "echo" observes the request itself (JSON) as text, so a test can read what kiln sent.
# --script N ignores the response: turns before N - 1 observe "o<turn>|" as text (even turns) or
# the ids [65 + turn, 66 + turn] (odd turns), and turn N - 1 ends the episode with reward
# sum(response_ids) % 2 (varied, so that groups have advantages). --crash-turn T: exit 3 on turn T of
# the episodes whose first response id is odd. --bad-ids: observe id 100000 (outside any test vocab).
# --nul-text: observe text holding a NUL byte. A demonstration request's prompt names its answer:
# "demo:text" (a call observed as text, then the label), "demo:ids" (an observation as ids),
# "demo:none" (no turns), "demo:long" (a 30-byte observation), "demo:turns" (five turns),
# "demo:lastobs" (the last turn observed: refused), "demo:noresponse" (refused).
import json
import sys
import time

script = int(sys.argv[sys.argv.index("--script") + 1]) if "--script" in sys.argv else 0
crash_turn = int(sys.argv[sys.argv.index("--crash-turn") + 1]) if "--crash-turn" in sys.argv else -1
bad_ids = "--bad-ids" in sys.argv
nul_text = "--nul-text" in sys.argv


def scripted(req):
    rid, turn = req["id"], req["turn"]
    first = (req["history"][0]["response_ids"] if req["history"] else req["response_ids"])[:1]
    if turn == crash_turn and first and first[0] % 2 == 1:
        sys.stderr.write("test_env: crashing on turn %d on purpose\n" % turn)
        sys.stderr.flush()
        sys.exit(3)
    if bad_ids:
        return {"id": rid, "done": False, "observation_ids": [100000]}
    if nul_text:  # a NUL: text the byte tokenizer refuses
        return {"id": rid, "done": False, "observation": "a\u0000b"}
    if turn + 1 >= script:
        return {"id": rid, "done": True, "reward": float(sum(req["response_ids"]) % 2)}
    if turn % 2 == 0:
        return {"id": rid, "done": False, "observation": "o%d|" % turn}
    return {"id": rid, "done": False, "observation_ids": [65 + turn, 66 + turn]}


def demonstration(req):
    kind, label = req["prompt"], req["label"]
    turns = {"demo:text": [{"response": "c 1+2", "observation": "=3\n"}, {"response": label}],
             "demo:ids": [{"response": "c", "observation_ids": [65, 66]}, {"response": label}],
             "demo:none": [],
             "demo:long": [{"response": "c", "observation": "x" * 30}, {"response": label}],
             "demo:turns": [{"response": "c", "observation": "o"}] * 4 + [{"response": label}],
             "demo:lastobs": [{"response": label, "observation": "o"}],
             "demo:noresponse": [{"observation": "o"}, {"response": label}]}[kind]
    return {"id": req["id"], "turns": turns}


def answer(req):
    if req.get("demonstrate"):
        return demonstration(req)
    if script:
        return scripted(req)
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
