"""`specrt train-medusa` and `specrt train-eagle`: the typer commands. Only typer at import time (torch loads inside
them)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import SpecrtError


def train_medusa(
    source: str = typer.Option("smollm2-135m", "--source", "-s", help="Target: embedded name, HF directory or .gguf."),
    out: Optional[Path] = typer.Option(None, "--out", help="Heads file to write. Default: heads/<source>.npz."),
    work: Path = typer.Option(Path("engines/.cache/medusa"), "--work",
                              help="Dataset cache and resumable checkpoints."),
    heads: int = typer.Option(4, "--heads", help="Number of Medusa heads (draft depth)."),
    vocab: int = typer.Option(4096, "--vocab", min=0, help="Reduced vocabulary the heads score (0 = full)."),
    max_new_tokens: int = typer.Option(96, "--max-new-tokens", help="Target continuation length per prompt."),
    budget_minutes: float = typer.Option(25.0, "--budget-minutes", help="Wall-clock training budget (data excluded)."),
    epochs: int = typer.Option(3, "--epochs", help="Stop earlier after this many epochs."),
    lr: float = typer.Option(2e-3, "--lr", help="Peak learning rate (cosine decay)."),
    parts: int = typer.Option(2, "--parts", help="Data parts: 1 = greedy continuations, 2 = + sampled ones (the "
                                                 "shipped heads), 3 = + more sampled ones (what each costs: "
                                                 "docs/design-notes.md, 'Medusa training data generation')."),
    plain_medusa: bool = typer.Option(False, "--plain-medusa",
                                      help="Medusa-1 heads on the hidden state only (no pending-token input)."),
    threads: int = typer.Option(2, "--threads", help="torch CPU threads."),
):
    """Train Medusa heads on the target's own continuations (target frozen; resumable; held-out report)."""
    import shutil

    import torch

    from ..export.train.medusa import TrainConfig, train_heads
    from ..export.train.medusa_data import build_dataset, default_parts
    from ..export.sources import load, resolve
    from ..pipeline import source_name

    n_parts = len(default_parts())
    if not 1 <= parts <= n_parts:
        raise SpecrtError(f"--parts must be in 1..{n_parts}, got {parts}")
    for flag, v in (("--heads", heads), ("--epochs", epochs), ("--threads", threads),
                    ("--max-new-tokens", max_new_tokens), ("--budget-minutes", budget_minutes)):
        if not v > 0:  # checked before the dataset (minutes): 0 epochs or budget would write untrained heads
            raise SpecrtError(f"{flag} must be > 0, got {v}")
    for flag, path in (("--out", out), ("--work", work)):
        blocked = next((q for q in ([path] if path else []) + list(path.parents if path else []) if q.is_file()),
                       None)
        if blocked is not None and not (flag == "--out" and blocked == path):
            raise SpecrtError(f"{flag} '{path}' cannot be created: '{blocked}' is a file; pass another path")
    torch.set_num_threads(threads)
    src = resolve(source)
    say = lambda m: typer.secho(f"specrt {m}", err=True)  # noqa: E731
    data = [build_dataset(src, work, part, log=say) for part in default_parts(heads, max_new_tokens)[:parts]]
    lm_head = load(src)[0].lm_head.weight.detach().numpy()
    cfg = TrainConfig(vocab=vocab, max_epochs=epochs, lr=lr, budget_s=budget_minutes * 60, threads=threads,
                      token_input=not plain_medusa)
    run_dir = work / (f"run-{'-'.join(d.stem[5:13] for d in data)}-h{heads}-v{vocab}-e{epochs}"
                      f"-lr{lr}-t{int(cfg.token_input)}")
    train_heads(data, lm_head, run_dir, cfg, log=say)
    dest = out or Path("heads") / f"{source_name(source)}.npz"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(run_dir / "heads.npz", dest)
    typer.echo(str(dest))


def train_eagle(
    source: str = typer.Option("smollm2-135m", "--source", "-s", help="Target: embedded name, HF directory or .gguf."),
    out: Optional[Path] = typer.Option(None, "--out", help="Head file to write. Default: heads/<source>-eagle.npz."),
    work: Path = typer.Option(Path("engines/.cache/eagle"), "--work",
                              help="Data cache (target features) and the resumable checkpoint."),
    vocab: int = typer.Option(8192, "--vocab", help="Draft vocabulary: the most frequent target choices (0 = all)."),
    budget_minutes: float = typer.Option(20.0, "--budget-minutes", help="Wall-clock training budget (data excluded)."),
    epochs: int = typer.Option(20, "--epochs", help="Stop earlier after this many epochs."),
    lr: float = typer.Option(1e-3, "--lr", help="Peak learning rate (cosine decay)."),
    w_cls: float = typer.Option(0.1, "--w-cls", help="Weight of the token loss against the feature loss (EAGLE: 0.1)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Target answer length per training prompt."),
    threads: int = typer.Option(2, "--threads", help="torch CPU threads."),
):
    """Train an EAGLE head on the target's own features (target frozen; resumable). Data: one teacher-forced pass
    per sequence over packaged text and the target's greedy answers to chat prompts (cached under --work); the
    report replays chain drafting on the benchmark's prompts, never trained on."""
    import shutil

    import torch

    from ..corpora import BENCH_PROMPTS
    from ..export.eagle import EagleTrainConfig, HeadShape
    from ..export.train.eagle import train
    from ..export.train.eagle_data import EagleDataConfig, build_eval_set, build_train_set, load_set
    from ..export.sources import fingerprint, load, resolve
    from ..pipeline import source_name

    for flag, v in (("--epochs", epochs), ("--threads", threads), ("--max-new-tokens", max_new_tokens),
                    ("--budget-minutes", budget_minutes), ("--lr", lr)):
        if not v > 0:  # before the data (minutes): 0 epochs or budget would write an untrained head
            raise SpecrtError(f"{flag} must be > 0, got {v}")
    if vocab < 0 or w_cls < 0:
        raise SpecrtError("--vocab and --w-cls must be >= 0")
    torch.set_num_threads(threads)
    src = resolve(source)
    say = lambda m: typer.secho(f"specrt {m}", err=True)  # noqa: E731
    heldout = load_set(build_eval_set(src, work, BENCH_PROMPTS, log=say))
    data = load_set(build_train_set(src, work, EagleDataConfig(max_new_tokens=max_new_tokens), log=say))
    model, _ = load(src)
    embed = model.model.embed_tokens.weight.detach().numpy()
    lm_head = model.lm_head.weight.detach().numpy()
    cfg = EagleTrainConfig(vocab=vocab, lr=lr, max_epochs=epochs, budget_s=budget_minutes * 60, w_cls=w_cls,
                           threads=threads)
    dest = out or Path("heads") / f"{source_name(source)}-eagle.npz"
    work.mkdir(parents=True, exist_ok=True)
    run_file = work / f"head-v{vocab}-lr{lr}-w{w_cls}.npz"
    report = train(data, embed, lm_head, HeadShape.of(model.config), run_file, cfg, heldout=heldout, log=say,
                   extra={"target_source_sha256": fingerprint(src)})
    dest.parent.mkdir(parents=True, exist_ok=True)
    if run_file.resolve() != dest.resolve():
        shutil.copy2(run_file, dest)
    for kind, r in report["heldout"].items():
        say(f"{kind:>12}: first token {r['first_top1']:.1%}, acceptance by position "
            f"{', '.join(f'{a:.2f}' for a in r['acceptance_by_position'])}; chain tau by depth "
            f"{', '.join(f'{t:.2f}' for t in r['tau_by_depth'])}")
    typer.echo(str(dest))

