"""One vLLM engine in its own process for the tests: vLLM's real Scheduler and both halves of
KvferryConnector (test_vllm_end_to_end.Engine), driven by a test over a JSON-lines protocol on
stdin/stdout, so that P and D are separate processes and D can be killed outright.

    engine_process.py ROLE ENGINE_ID NUM_BLOCKS EXTRA_JSON     prints {"ready": true, ...}
    {"op": "add", "id": R, "prompt": [...], "params": {...} | null, "max_tokens": N}
    {"op": "step"}            one engine step; answers what finished and each request's status
    {"op": "blocks", "id": R} the request's block ids
    {"op": "kv", "blocks": [...]}   those blocks' bytes in every layer (base64)
    {"op": "quit"}            shuts the engine down, answers {"bye": true}
"""

import base64
import json
import sys

from pathlib import Path

from test_vllm_end_to_end import LAYERS, Engine
from vllm_harness import make_request, write_model_dir


def main() -> None:
    role, engine_id, num_blocks, extra, model_dir = sys.argv[1:6]
    engine = Engine(write_model_dir(Path(model_dir)), role,
                    num_blocks=int(num_blocks), extra=json.loads(extra), engine_id=engine_id)
    ready = {"ready": True}
    if engine.worker.connector_worker.prefill is not None:
        ready["bootstrap_port"] = engine.worker.connector_worker.prefill.bootstrap_port
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "add":
            engine.scheduler.add_request(make_request(
                command["id"], len(command["prompt"]), command["params"],
                max_tokens=command["max_tokens"], prompt=command["prompt"]))
            answer = {}
        elif op == "step":
            _, results, _ = engine.step()
            answer = {
                "finished_sending": sorted(results.finished_sending or ()),
                "finished_recving": sorted(results.finished_recving or ()),
                "failed_recving": sorted(results.failed_recving or ()),
                "status": {r: str(q.status) for r, q in engine.scheduler.requests.items()},
            }
        elif op == "blocks":
            answer = {"blocks": engine.blocks(command["id"])}
        elif op == "kv":
            answer = {"kv": {layer: [base64.b64encode(
                engine.kv[layer][b].contiguous().numpy().tobytes()).decode()
                for b in command["blocks"]] for layer in LAYERS}}
        elif op == "quit":
            engine.shutdown()
            print(json.dumps({"bye": True}), flush=True)
            return
        else:
            answer = {"error": f"unknown op {op}"}
        print(json.dumps(answer), flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
