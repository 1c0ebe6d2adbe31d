"""`specrt generate --compare-plain`: answer the same prompt again with plain decoding (--speculate off) on the same
target engine, and say in one line what speculation bought (the last line `make demo` prints)."""

from __future__ import annotations

from ..errors import SpecrtError


def check_speculating(mode: str) -> None:
    """--compare-plain compares a speculative answer with a plain one: the run itself must speculate."""
    if mode == "off":
        raise SpecrtError("--compare-plain compares speculation with plain decoding, but --speculate is off; "
                          "drop --speculate off (the default is auto) or --compare-plain")


def warm_up(session, prompt, **kwargs) -> None:
    """One token of the prompt first, so that neither timed run pays the engines' first passes (memory, kernels)."""
    session.generate(prompt, **{**kwargs, "max_new_tokens": 1})


def plain_pass(session, shared: dict, prompt, **kwargs):
    """The same prompt, decoding options and target engine (shared with `session` where the options match),
    decoded plainly after its own warm-up -> its Result. The session's plan, decoded plainly: nothing is loaded,
    looked up or resolved again."""
    from ..runtime.session import open_session

    plain = open_session(session.plan.plain(), shared=shared)
    warm_up(plain, prompt, **kwargs)
    return plain.generate(prompt, **kwargs)


def summary(spec, plain) -> dict:
    """What the comparison found, from the two results' stats: the speculative run's mode, tau and time, the
    plain run's time, the speedup in tokens per second (prefill included in both) and whether the tokens match."""
    s, p = spec.stats, plain.stats
    return {"proposer": s.proposer, "tau": s.tau, "new_tokens": s.new_tokens, "total_s": s.total_s,
            "plain_new_tokens": p.new_tokens, "plain_total_s": p.total_s,
            "speedup": s.tok_s / p.tok_s if p.tok_s > 0 else None,
            "identical": spec.token_ids == plain.token_ids, "plain_stats": p.as_dict()}


def line(found: dict, asked: str) -> str:
    """One line: 'auto (lookup+medusa): 128 tokens in 1.90 s, tau 2.40; plain: 128 tokens in 4.10 s -> 2.16x
    tokens/s, identical output'."""
    mode = f"{asked} ({found['proposer']})" if asked != found["proposer"] else asked
    speedup = f"{found['speedup']:.2f}x tokens/s" if found["speedup"] is not None else "no plain tokens to compare"
    return (f"{mode}: {found['new_tokens']} tokens in {found['total_s']:.2f} s, tau {found['tau']:.2f}; "
            f"plain: {found['plain_new_tokens']} tokens in {found['plain_total_s']:.2f} s -> {speedup}, "
            f"{'identical output' if found['identical'] else 'different output'}")
