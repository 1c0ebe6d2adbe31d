"""Request keys: the conversation a request belongs to (Ray Serve's routing, specrt/server/ray_serve.py) and the
scope of what a server keeps across requests for suffix decoding (`--suffix-scope`).

The conversation key is a hash of the request's leading messages, the system prompt(s) up to and including the
first user message, for /v1/chat/completions; the first PROMPT_PREFIX_CHARS characters of the prompt for
/v1/completions; or the client's own `X-Specrt-Conversation` header. Every turn of a conversation resends that
beginning, so every turn has the same key.

Suffix decoding drafts from earlier answers, and how fast an answer comes reveals what those answers looked like,
so the store they live in is scoped: one for the whole server (a single tenant), one per API key (the bearer token
a request sends: a gateway's per-tenant keys; requests without one share a store), or one per conversation.
"""

from __future__ import annotations

import hashlib
import itertools
import json

CONVERSATION_HEADER = "x-specrt-conversation"  # a client's own conversation key (overrides the computed one)
PROMPT_PREFIX_CHARS = 64                       # /v1/completions: the key is this much of the prompt
SUFFIX_SCOPES = ("server", "api-key", "conversation")
_unkeyed = itertools.count()


def _digest(material) -> str:
    return hashlib.blake2b(json.dumps(material, sort_keys=True, separators=(",", ":")).encode(),
                           digest_size=16).hexdigest()


def conversation_key(path: str, body: bytes, header: str | None = None) -> str | None:
    """The same key for every turn of one conversation; None for requests that are not generations or not valid
    JSON."""
    if header:
        return _digest(["header", header])
    if not path.rstrip("/").endswith("/completions"):  # /v1/chat/completions or /v1/completions
        return None
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return request_key(path, req)


def request_key(path: str, req, header: str | None = None) -> str | None:
    """conversation_key of a generation request's parsed body."""
    if header:
        return _digest(["header", header])
    if not isinstance(req, dict):
        return None
    if path.rstrip("/").endswith("/chat/completions"):
        messages = req.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        lead = []
        for m in messages:  # the system prompt(s) and the first user message: what every later turn starts with
            lead.append(m)
            if isinstance(m, dict) and m.get("role") == "user":
                break
        return _digest(["chat", req.get("model"), lead])
    prompt = req.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one (n > 1 is refused by the server)
    if not isinstance(prompt, (str, list)) or not prompt:
        return None
    return _digest(["text", req.get("model"), prompt[:PROMPT_PREFIX_CHARS]])


def store_key(scope: str, path: str, req: dict, headers) -> str | None:
    """The suffix store a generation request reads and writes under `scope` (None: the one every request shares).
    req: its parsed body; headers: its headers, lower-case names."""
    if scope == "server":
        return None
    if scope == "api-key":
        _, _, token = headers.get("authorization", "").partition(" ")
        return "key:" + _digest(["key", token.strip()])
    key = request_key(path, req, headers.get(CONVERSATION_HEADER))
    return "conversation:" + (key or f"unkeyed-{next(_unkeyed)}")  # no key: the request's own store
