"""Check kdtree-run's OpenAI batch output lines with the official `openai` package's own types.

Usage: python check_openai_batch.py OUTPUT.jsonl N_OK N_ERR

Every line must have the batch output line shape {id, custom_id, response: {status_code, request_id,
body}, error}; a 200 body must pass `openai.types.chat.ChatCompletion.model_validate` (which needs
`created`, `model`, `object`, `choices`, ...); an error body must be {"error": {message, type, code}}.
As a check that the validation is real, the first 200 body with `created` removed must be rejected.
Run by tools/kdtree-run/tests/openai_types.rs. Exit 0 = all good; anything else prints why.
"""

import copy
import json
import sys

import openai
import pydantic
from openai.types.chat import ChatCompletion


def fail(msg):
    print(f"check_openai_batch: {msg}", file=sys.stderr)
    sys.exit(1)


def main():
    path, want_ok, want_err = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ok = err = 0
    first_body = None
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            line = json.loads(raw)
            for key, kind in [("id", str), ("custom_id", str), ("response", dict)]:
                if not isinstance(line.get(key), kind):
                    fail(f"line {n}: {key!r} must be a {kind.__name__}: {raw}")
            if "error" not in line or line["error"] is not None:
                fail(f"line {n}: 'error' must be null when a response is given: {raw}")
            resp = line["response"]
            if not isinstance(resp.get("status_code"), int) or not isinstance(resp.get("request_id"), str):
                fail(f"line {n}: response needs an int status_code and a str request_id: {raw}")
            body = resp.get("body")
            if resp["status_code"] == 200:
                try:
                    cc = ChatCompletion.model_validate(body)
                except pydantic.ValidationError as e:
                    fail(f"line {n}: the body is not an openai ChatCompletion: {e}")
                if cc.object != "chat.completion" or not cc.choices or cc.choices[0].message.role != "assistant":
                    fail(f"line {n}: unexpected ChatCompletion {cc}")
                u = cc.usage
                if u is None or u.total_tokens != u.prompt_tokens + u.completion_tokens:
                    fail(f"line {n}: usage does not add up: {u}")
                if cc.created != line["timing"]["created"]:
                    fail(f"line {n}: body.created {cc.created} != timing.created")
                first_body = first_body or body
                ok += 1
            else:
                e = body.get("error") if isinstance(body, dict) else None
                if not (isinstance(e, dict) and all(isinstance(e.get(k), str) for k in ("message", "type", "code"))):
                    fail(f"line {n}: a failed response's body must be {{error: {{message, type, code}}}}: {raw}")
                err += 1
    if (ok, err) != (want_ok, want_err):
        fail(f"{ok} ok and {err} failed lines, expected {want_ok} and {want_err}")
    broken = copy.deepcopy(first_body)
    del broken["created"]
    try:
        ChatCompletion.model_validate(broken)
    except pydantic.ValidationError:
        pass
    else:
        fail("a body without 'created' was accepted: the check would not catch the bug it guards")
    print(f"check_openai_batch: {ok} ok + {err} failed lines valid (openai {openai.__version__}, pydantic {pydantic.VERSION})")


main()
