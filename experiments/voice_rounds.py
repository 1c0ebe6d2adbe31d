"""Round-by-round profile of speculation on the voice workload, in process: every round's asked and drafted length,
accepted tokens, draft and verify seconds, per turn of each call, through the same session the server builds
(KV reuse on, `--parallel` slots as `specrt serve` opens them). Used for docs/voice.md, "Why auto drafted little".

    python experiments/voice_rounds.py ENGINES --precision int4 --speculate auto --calls 2 --parallel 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specrt.runtime import speculative
from specrt.runtime.control import Round
from specrt.runtime.engine import EngineOptions
from specrt.runtime.prefix_cache import PrefixStore
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.session import load
from specrt.runtime.tokenizer import Message

LOG: list[Round] = []


class _Logged(Round):
    def __init__(self, *args):
        super().__init__(*args)
        LOG.append(self)


def _controllers(session) -> list:
    slots = getattr(session, "slots", None)
    decs = [s.decoder for s in slots] if slots else [session.decoder]
    return [getattr(d, "control", None) for d in decs]


def _turn(session, messages, max_tokens):
    LOG.clear()
    t0 = time.perf_counter()
    stream = session.stream(messages, max_new_tokens=max_tokens, sampling=SamplingParams(temperature=0.0))
    first = None
    text = ""
    for delta in stream:
        if first is None and delta:
            first = time.perf_counter() - t0
        text += delta
    total = time.perf_counter() - t0
    st = stream.result.stats
    rounds = [r for r in LOG if not r.prefill]
    drafts = [r for r in rounds if r.drafted]
    return text, {
        "ttft_s": round(first or total, 3), "total_s": round(total, 3), "tokens": len(stream.result.token_ids),
        "cached": st.cached_tokens, "prompt": st.prompt_tokens, "rounds": len(rounds), "draft_rounds": len(drafts),
        "accepted": sum(r.result.num_accepted for r in drafts),
        "tokens_per_draft_round": round(statistics.mean(r.result.num_accepted + 1 for r in drafts), 2) if drafts
        else None,
        "asked": [r.asked for r in rounds],
        "kept": [r.result.num_accepted for r in rounds],
        "draft_ms_per_token": [round(1e3 * r.draft_s / r.asked, 1) for r in drafts],
        "verify_ms_by_width": _by_width(rounds),
        "drafted_by_source": st.drafted_by_source,
        "controller_d_ms": [{s.name: round(1e3 * d, 1) for s, d in zip(c.drafters.sources, c.drafters.ds)}
                            for c in _controllers(session) if c is not None and hasattr(c, "drafters")],
    }


def _by_width(rounds) -> dict:
    out: dict[int, list[float]] = {}
    for r in rounds:
        out.setdefault(r.width, []).append(r.verify_s)
    return {w: round(1e3 * statistics.median(v), 1) for w, v in sorted(out.items())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engines", type=Path)
    ap.add_argument("--precision", default="int4")
    ap.add_argument("--speculate", default="auto")
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--workload", type=Path,
                    default=Path(__file__).resolve().parents[1] / "bench" / "data" / "voice-clinic.json")
    ap.add_argument("--system-chars", type=int, default=0, help="cut the system prompt (tiny sets' contexts)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    speculative.Round = _Logged
    work = json.loads(a.workload.read_text())
    if a.system_chars:
        work["system"] = work["system"][:a.system_chars]
    session = load(a.engines, a.precision, a.speculate, EngineOptions(threads=a.threads), parallel=a.parallel)
    session.enable_reuse(PrefixStore(256 << 20))  # as the server does (--cache-ram)
    if a.parallel > 1:
        session.detach = False
    report = []
    for c in range(a.calls):
        msgs = [Message("system", f"Call {c + 1}. " + work["system"])]
        for t, user in enumerate(work["calls"][c % len(work["calls"])]):
            msgs.append(Message("user", user))
            text, row = _turn(session, msgs, work.get("max_tokens", 64))
            msgs.append(Message("assistant", text))
            row.update(call=c + 1, turn=t + 1, text=text)
            report.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "text"}), flush=True)
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
