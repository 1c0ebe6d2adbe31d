"""The token ids that end a reply: read from the checkpoint, not from a list of known token strings.

Three places say it (docs/models.md, "Stop tokens"):
- the tokenizer's eos token;
- the generation config: `generation_config.json`'s `eos_token_id` (an id or a list; `config.json`'s when the
  folder has no generation config, as transformers' `generate` does), or a GGUF's `tokenizer.ggml.eos_token_id`,
  `eot_token_id` and `eom_token_id`;
- the chat template's end of turn: the special token the template writes right after an assistant message's
  text (Gemma's `<end_of_turn>`, ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`, Phi's `<|end|>`), found by
  rendering a one-turn conversation.
The tokenizer's own eos comes first in the list: it is the token a template's `eos_token` names.
"""

from __future__ import annotations

import json
from pathlib import Path

GGUF_STOP_FIELDS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_MARK = "\u2063specrt-reply\u2063"  # a reply text no template rewrites and no tokenizer merges with what follows


def stop_token_ids(tokenizer, src) -> list[int]:
    """src: an export Source (kind "hf" | "gguf", path). -> the stop ids, the tokenizer's eos first, then the rest
    ascending; ids outside the tokenizer's vocabulary are dropped."""
    found = set(config_stop_ids(src)) | set(template_end_of_turn(tokenizer))
    first = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    known = len(tokenizer)
    return first + sorted(i for i in found if 0 <= i < known and i not in first)


def config_stop_ids(src) -> list[int]:
    """The eos ids the checkpoint's generation config names (HF folder) or its GGUF header holds."""
    if src.kind == "gguf":
        from gguf import GGUFReader

        reader = GGUFReader(str(src.path))
        fields = (reader.get_field(name) for name in GGUF_STOP_FIELDS)
        return [int(f.contents()) for f in fields if f is not None]
    for name in ("generation_config.json", "config.json"):
        path = Path(src.path) / name
        if path.is_file():
            ids = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            if ids is not None:
                return _ids(ids)
    return []


def template_end_of_turn(tokenizer) -> list[int]:
    """[id] of the special token the chat template closes an assistant turn with, [] when it has none (no
    template, a template that cannot render a user/assistant pair, or plain text after the reply)."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _MARK}]
    try:
        text = tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception:  # noqa: BLE001 - a template may refuse any conversation (raise_exception) in its own way
        return []
    if not isinstance(text, str) or _MARK not in text:
        return []
    tail = tokenizer.encode(text.split(_MARK, 1)[1].lstrip(" "), add_special_tokens=False)
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return [tail[0]] if tail and tail[0] in special else []


def _ids(value) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]
