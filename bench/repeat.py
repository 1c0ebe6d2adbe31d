"""Workloads that repeat, for drafters that learn across requests (`--speculate suffix`):

- voice: a restaurant's phone agent, one system prompt, `--calls` calls of 3-5 turns drawn from five caller intents
  with varied names, days, times and party sizes (text written here, seeded);
- code: an agentic edit loop, the same Python file rewritten whole over `--edits` turns, each turn sending the file
  as the last answer left it.

Every mode answers the same histories (plain greedy's answers; greedy speculation must equal them, checked per
turn), one session per mode, interleaved turn by turn, greedy. Writes repeat.json, repeat.md and repeat.png.
More: docs/bench-notes.md, "Module notes: bench/repeat.py".
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

SYSTEM = ("You are the phone host of Luigi's, a small Italian restaurant open Tuesday to Sunday, 12:00-15:00 and "
          "18:00-23:00. Be brief and friendly; confirm bookings by repeating the name, day, time and party size.")
NAMES = ["Ada Moretti", "Bob Lane", "Chloe Park", "Dev Patel", "Emma Stone", "Farid Haddad", "Grace Kim", "Hugo Weber",
         "Ines Costa", "Jon Berg", "Kira Sato", "Luca Rossi", "Maya Cohen", "Nils Olsen", "Omar Aziz", "Pia Jensen"]
DAYS = ["Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
TIMES = ["12:30", "13:00", "18:30", "19:00", "19:30", "20:00", "20:30"]
INTENTS = {
    "book": ["Hi, I'd like to book a table for {party} on {day}.", "Around {time}, please.",
             "The name is {name}.", "Perfect, thank you!"],
    "change": ["Hello, I have a booking under {name} and need to change it.", "Can we move it to {day} at {time}?",
               "And we'll be {party} people now.", "Great, thanks."],
    "cancel": ["Hi, I need to cancel my reservation.", "It's under {name}, for {day}.", "Thanks, bye."],
    "hours": ["Hi, are you open on {day}?", "What time does the kitchen close?", "Do I need to book for {party}?",
              "OK, thank you."],
    "menu": ["Hello, do you have vegetarian dishes?", "Is the tiramisu made in house?",
             "Can you do a birthday cake for {party} people on {day}?", "Lovely, thanks!"],
}
FILE = '''def total(items):
    s = 0
    for i in items:
        s = s + i["price"] * i["qty"]
    return s


def discount(total, code):
    if code == "TEN":
        return total * 0.9
    return total
'''
EDITS = ["Rename the variable s to subtotal.", "Add type hints to both functions.",
         "Add a one-line docstring to each function.", "Make discount also accept the code 'TWENTY' for 20% off.",
         "Use sum() with a generator in total.", "Rename items to lines everywhere.",
         "Round the result of discount to 2 decimals.", "Add a module docstring at the top."]


def voice_calls(n: int, seed: int = 0) -> list[list[str]]:
    rng = random.Random(seed)
    calls = []
    for _ in range(n):
        turns = INTENTS[rng.choice(sorted(INTENTS))]
        fill = {"name": rng.choice(NAMES), "day": rng.choice(DAYS), "time": rng.choice(TIMES),
                "party": rng.choice(["two", "three", "four", "five", "six", "eight"])}
        calls.append([t.format(**fill) for t in turns])
    return calls


def run(engines, modes: list[str], calls: int, edits: int, max_tokens: int, warm: int, config=None,
        log=print) -> dict:
    from ..manifest import Manifest, load_manifest
    from ..runtime.sampling import SamplingParams
    from ..runtime.session import load
    from ..runtime.speculative import SpeculativeConfig
    from ..runtime.tokenizer import Message

    greedy = SamplingParams(temperature=0.0)
    shared: dict = {}
    config = config or SpeculativeConfig()
    manifest = engines if isinstance(engines, Manifest) else load_manifest(Path(engines))  # read once for every mode
    sessions = {m: load(manifest, "fp32", m, shared=shared, config=config)
                for m in ["off"] + [m for m in modes if m != "off"]}
    rows = []

    def turn(workload: str, call: int, msgs: list) -> str:
        out, ref = {}, None
        for mode, s in sessions.items():
            r = s.generate(msgs, max_new_tokens=max_tokens, sampling=greedy)
            st = r.stats
            drafted = st.drafted_by_position[0] if st.drafted_by_position else 0  # rounds with a draft
            out[mode] = {"tokens": len(r.token_ids), "s": st.total_s, "rounds": st.rounds, "drafted": drafted,
                         "draft_s": st.draft_s, "verify_s": st.verify_s,
                         "same": ref is None or r.token_ids == ref.token_ids}
            ref = ref or r
        rows.append({"workload": workload, "call": call, **out})
        return ref.text

    for i, call in enumerate(voice_calls(calls)):
        msgs = [Message("system", SYSTEM)]
        for user in call:
            msgs.append(Message("user", user))
            msgs.append(Message("assistant", turn("voice", i, msgs)))
        log(f"voice call {i + 1}/{calls}: " + _line(rows, "voice", i, sessions))
    code = FILE
    for i, ask in enumerate(EDITS[:edits]):
        msgs = [Message("system", "You edit Python files. Reply with the whole updated file, nothing else."),
                Message("user", f"{ask}\n\n```python\n{code}```")]
        answer = turn("code", i, msgs)
        code = answer.split("```python\n")[-1].split("```")[0] if "```" in answer else answer
        code = code if code.endswith("\n") else code + "\n"
        log(f"code edit {i + 1}/{edits}: " + _line(rows, "code", i, sessions))
    return {"engines": str(manifest.root), "modes": list(sessions), "calls": calls, "edits": edits,
            "max_tokens": max_tokens,
            "suffix": {"threshold": config.suffix_threshold, "factor": config.suffix_factor,
                       "cache_mib": config.suffix_cache_mib},
            "warm": warm, "machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"),
            "summary": summary(rows, list(sessions), warm), "rows": rows}


def _tok_s(rows, mode) -> float:
    return sum(r[mode]["tokens"] for r in rows) / max(sum(r[mode]["s"] for r in rows), 1e-9)


def _line(rows, workload, call, sessions) -> str:
    mine = [r for r in rows if r["workload"] == workload and r["call"] == call]
    return "  ".join(f"{m} {_tok_s(mine, m):.1f}" for m in sessions)


def summary(rows: list, modes: list[str], warm: int) -> dict:
    out = {}
    for workload, lo in (("voice", warm - 1), ("code", 0)):
        part = [r for r in rows if r["workload"] == workload and r["call"] >= lo]
        if not part:
            continue
        tps = {m: round(_tok_s(part, m), 2) for m in modes}
        out[workload] = {"from_call": lo + 1, "tok_s": tps,
                         "vs_off": {m: round(tps[m] / tps["off"], 3) for m in modes},
                         "tau": {m: round(sum(r[m]["tokens"] for r in part) / sum(r[m]["rounds"] for r in part), 3)
                                 for m in modes},
                         "drafted": {m: round(sum(r[m]["drafted"] for r in part) / sum(r[m]["rounds"] for r in part),
                                              3) for m in modes},
                         "draft_share": {m: round(sum(r[m]["draft_s"] for r in part)
                                                  / max(sum(r[m]["draft_s"] + r[m]["verify_s"] for r in part), 1e-9), 4)
                                         for m in modes},
                         "identical": {m: all(r[m]["same"] for r in part) for m in modes}}
    return out


def markdown(r: dict) -> str:
    lines = [f"# Repeating workloads ({r['engines']}, fp32, greedy, {r['date']})", ""]
    for workload, s in r["summary"].items():
        lines += [f"## {workload} (from call {s['from_call']} on)", "",
                  "| mode | tok/s | vs off | tau | rounds that drafted | drafting share of a round | identical |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {m} | {s['tok_s'][m]} | {s['vs_off'][m]}x | {s['tau'][m]} | {s['drafted'][m]} | "
                  f"{s['draft_share'][m]} | {s['identical'][m]} |"
                  for m in r["modes"]]
        lines.append("")
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    voice = [x for x in r["rows"] if x["workload"] == "voice"]
    calls = sorted({x["call"] for x in voice})
    for m in r["modes"]:
        ax.plot([c + 1 for c in calls], [_tok_s([x for x in voice if x["call"] == c], m) for c in calls], label=m)
    ax.set_xlabel("call")
    ax.set_ylabel("tok/s")
    ax.set_title("voice-agent calls: how fast the store warms up")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="engines/smollm2-135m")
    ap.add_argument("--modes", default="off,prompt-lookup,suffix")
    ap.add_argument("--calls", type=int, default=32)
    ap.add_argument("--edits", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--warm", type=int, default=10, help="ratios count from this call on")
    ap.add_argument("--suffix-threshold", type=float, default=0.3)
    ap.add_argument("--suffix-factor", type=float, default=4.0)
    ap.add_argument("--out", default="repeat-out")
    a = ap.parse_args()
    from ..runtime.speculative import SpeculativeConfig

    cfg = SpeculativeConfig(suffix_threshold=a.suffix_threshold, suffix_factor=a.suffix_factor)
    cfg.check()
    r = run(a.engines, a.modes.split(","), a.calls, a.edits, a.max_tokens, a.warm, cfg)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "repeat.json").write_text(json.dumps(r, indent=1) + "\n")
    (out / "repeat.md").write_text(markdown(r) + "\n")
    plot(r, out / "repeat.png")
    print(markdown(r))


if __name__ == "__main__":
    main()
