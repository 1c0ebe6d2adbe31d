"""How soon the engine is free after a client hangs up: `specrt serve`'s app on a loopback port, N streamed requests
each dropped after a few chunks, and per request the time from the stream's close() (the server noticing the
disconnect) to the decode loop's end (Stats.cancel_s, what /metrics shows as specrt_cancel_latency_seconds),
against the request's own mean round time.

    python -m experiments.cancel_latency --engines engines/smollm2-135m --requests 20
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="engines/smollm2-135m", help="engine set folder")
    ap.add_argument("--speculate", default="auto", help="--speculate mode of the server")
    ap.add_argument("--precision", default="fp32", help="target precision")
    ap.add_argument("--requests", type=int, default=20, help="requests to drop mid-stream")
    ap.add_argument("--after", type=int, default=8, help="content chunks read before hanging up")
    a = ap.parse_args(argv)

    import httpx
    import uvicorn

    from specrt.runtime.session import load
    from specrt.server.app import create_app

    app = create_app(load(a.engines, a.precision, a.speculate))
    server = app.state.server
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=uv.run, daemon=True).start()
    while not uv.started:
        time.sleep(0.02)
    body = {"messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
            "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    rows = []
    with httpx.Client(timeout=60) as http:
        for i in range(a.requests):
            last = server.history[-1] if server.history else None
            body["messages"][0]["content"] = f"[{i}] Write a long story about a lighthouse keeper."
            with http.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                got = 0
                for line in r.iter_lines():
                    got += line.startswith("data: ") and '"content"' in line
                    if got >= a.after:
                        break
            while not server.history or server.history[-1] is last or server.pending:
                time.sleep(0.002)
            st = server.history[-1]
            round_s = (st.total_s - st.ttft_s) / max(st.rounds - 1, 1)
            rows.append({"cancel_ms": st.cancel_s * 1000, "round_ms": round_s * 1000, "tokens": st.new_tokens,
                         "finish": st.finish_reason})
    uv.should_exit = True
    cancel = [r["cancel_ms"] for r in rows]
    ratio = [r["cancel_ms"] / r["round_ms"] for r in rows]
    out = {"requests": len(rows), "cancelled": sum(r["finish"] == "cancelled" for r in rows),
           "cancel_ms_median": round(statistics.median(cancel), 2), "cancel_ms_max": round(max(cancel), 2),
           "round_ms_median": round(statistics.median(r["round_ms"] for r in rows), 2),
           "cancel_over_round_median": round(statistics.median(ratio), 3),
           "cancel_over_round_max": round(max(ratio), 3),
           "within_one_round": sum(x <= 1.0 for x in ratio)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
