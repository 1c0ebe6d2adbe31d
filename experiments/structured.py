"""Structured output: 20 schema-constrained chat requests, in-process (what `specrt serve` runs for a
`response_format` json_schema), greedy. For each request and --reps runs, interleaved:

- valid: the reply parses and validates against its schema (jsonschema), unconstrained and constrained;
- plain constrained vs plain unconstrained over the same number of target passes (ignore_eos, the constrained
  reply's length: the same passes, so the difference is the grammar's cost and the full-logits read it needs);
- auto constrained vs auto unconstrained tok/s (speculation: the tokens differ, so this is the price a user sees),
  and whether auto's constrained tokens equal plain constrained greedy's (they must);
- grammar_s: the time inside the grammar engine (masks, draft checks), as a share of the request.

    python -m experiments.structured --engines engines/smollm2-135m --reps 3 --out docs/bench/.../structured.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

S = {"type": "string", "maxLength": 40}
CASES = [
    ("Book a table for four at 19:30 under the name Ada.",
     {"party": {"type": "integer", "minimum": 1, "maximum": 12},
      "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}, "name": S}),
    ("What's the weather like in Paris today?", {"city": S, "celsius": {"type": "number"},
                                                  "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}}),
    ("Extract the contact: Jane Doe, jane@example.com, +44 20 7946 0958.", {"name": S, "email": S, "phone": S}),
    ("Order two large pepperoni pizzas for delivery.", {"item": S, "size": {"enum": ["small", "medium", "large"]},
                                                         "quantity": {"type": "integer", "minimum": 1}}),
    ("Give me a recipe title and three ingredients for pancakes.",
     {"title": S, "ingredients": {"type": "array", "items": S, "minItems": 3, "maxItems": 3}}),
    ("Is 17 a prime number? Answer with a boolean and a reason.", {"prime": {"type": "boolean"}, "reason": S}),
    ("Classify the sentiment of: 'The film was a delight from start to finish.'",
     {"sentiment": {"enum": ["positive", "neutral", "negative"]}, "confidence": {"type": "number"}}),
    ("Turn on the kitchen lights at 50% brightness.",
     {"room": S, "on": {"type": "boolean"}, "brightness": {"type": "integer", "minimum": 0, "maximum": 100}}),
    ("Set a timer for 12 minutes for the pasta.", {"minutes": {"type": "integer", "minimum": 1}, "label": S}),
    ("Translate 'good morning' into French and Spanish.", {"french": S, "spanish": S}),
    ("Summarise: Speculative decoding drafts tokens cheaply and verifies them in one target pass.",
     {"summary": {"type": "string", "maxLength": 120}, "words": {"type": "integer"}}),
    ("List three planets of the solar system.", {"planets": {"type": "array", "items": S, "minItems": 3,
                                                              "maxItems": 3}}),
    ("Schedule a meeting with Bob on Friday at 10am about the budget.",
     {"who": S, "day": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]}, "hour": {"type": "integer"},
      "topic": S}),
    ("Convert 5 kilometres to miles.", {"km": {"type": "number"}, "miles": {"type": "number"}}),
    ("Write a Python function name and its one-line docstring for adding two numbers.", {"name": S, "docstring": S}),
    ("Rate this review from 1 to 5: 'Decent food, slow service.'", {"stars": {"type": "integer", "minimum": 1,
                                                                               "maximum": 5}, "why": S}),
    ("Which city is the capital of Japan, and on which continent?", {"capital": S, "continent": S}),
    ("Parse the date 'March 3rd, 2024' into parts.", {"year": {"type": "integer"}, "month": {"type": "integer",
                                                                                          "minimum": 1, "maximum": 12},
                                                      "day": {"type": "integer", "minimum": 1, "maximum": 31}}),
    ("Suggest a name and a colour for a new pet cat.", {"name": S, "colour": S}),
    ("Call me a taxi to the airport for two people with luggage.", {"destination": S, "passengers": {"type": "integer"},
                                                                   "luggage": {"type": "boolean"}}),
]


def schema_of(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run(engines: str, precision: str, reps: int, max_tokens: int) -> dict:
    from specrt.runtime.grammar import json_schema_grammar
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.session import load
    from specrt.runtime.tokenizer import Message

    greedy = SamplingParams(temperature=0.0)
    plain, auto = load(engines, precision, "off"), load(engines, precision, "auto")
    plain.grammar("start: /a/")  # build the grammar's tokenizer before timing anything
    rows = []
    for prompt, props in CASES:
        schema = schema_of(props)
        msgs = [Message("system", "Answer in JSON."), Message("user", prompt)]
        g = json_schema_grammar(schema)
        free = plain.generate(msgs, max_new_tokens=max_tokens, sampling=greedy)
        runs = {k: [] for k in ("plain_c", "plain_u", "auto_c", "auto_u")}
        share, same, con = [], True, None
        for _ in range(reps):
            con = plain.generate(msgs, max_new_tokens=max_tokens, sampling=greedy, grammar=plain.grammar(g))
            n = len(con.token_ids)
            unc = plain.generate(msgs, max_new_tokens=n, sampling=greedy, ignore_eos=True)
            a = auto.generate(msgs, max_new_tokens=max_tokens, sampling=greedy, grammar=auto.grammar(g))
            au = auto.generate(msgs, max_new_tokens=max_tokens, sampling=greedy)
            same &= a.token_ids == con.token_ids
            runs["plain_c"].append(n / con.stats.total_s)
            runs["plain_u"].append(len(unc.token_ids) / unc.stats.total_s)
            runs["auto_c"].append(len(a.token_ids) / a.stats.total_s)
            runs["auto_u"].append(len(au.token_ids) / au.stats.total_s)
            share.append(a.stats.grammar_s / a.stats.total_s)
        rows.append({"prompt": prompt, "free_valid": valid(free.text, schema), "valid": valid(con.text, schema),
                     "finish": con.stats.finish_reason, "tokens": len(con.token_ids), "auto_equals_plain": same,
                     "auto_proposer": auto.mode, "text": con.text,
                     **{k: round(statistics.median(v), 2) for k, v in runs.items()},
                     "auto_grammar_share": round(statistics.median(share), 4)})
        print(f"{rows[-1]['valid']!s:5} {rows[-1]['free_valid']!s:5} {rows[-1]['tokens']:4d} "
              f"plain {rows[-1]['plain_c']:.1f}/{rows[-1]['plain_u']:.1f} auto {rows[-1]['auto_c']:.1f}/"
              f"{rows[-1]['auto_u']:.1f} same={same} {con.text[:70]}", flush=True)
    tot = {k: sum(r["tokens"] for r in rows) / sum(r["tokens"] / r[k] for r in rows)
           for k in ("plain_c", "plain_u", "auto_c", "auto_u")}  # tokens over time, all requests
    return {"engines": engines, "precision": precision, "reps": reps, "max_tokens": max_tokens,
            "machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"),
            "valid": sum(r["valid"] for r in rows), "free_valid": sum(r["free_valid"] for r in rows),
            "requests": len(rows), "auto_equals_plain": sum(r["auto_equals_plain"] for r in rows),
            "tok_s": {k: round(v, 2) for k, v in tot.items()},
            "plain_cost": round(1 - tot["plain_c"] / tot["plain_u"], 4),
            "auto_cost": round(1 - tot["auto_c"] / tot["auto_u"], 4), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="engines/smollm2-135m")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--out")
    a = ap.parse_args()
    r = run(a.engines, a.precision, a.reps, a.max_tokens)
    print(json.dumps({k: v for k, v in r.items() if k != "rows"}, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
