"""Ray Serve's request router for the engine replicas of `specrt serve-ray`: a request goes to the replica its
conversation key maps to (rendezvous hashing over the live replicas, specrt.server.ray_serve.rendezvous), so a follow-up
turn reaches the replica holding its prefix in the KV cache. Imports Ray: loaded only by Ray Serve (by the import
path in the engine deployment's RequestRouterConfig), never by `specrt` itself."""

from __future__ import annotations

import random
from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .ray_serve import CONVERSATION_KWARG, rendezvous


class ConversationRouter(RequestRouter):
    """A keyed request (the `conversation` keyword of the engine call): only the replica the key maps to, waiting
    while it is busy (its queue is bounded by max_ongoing_requests; the server's --max-queue answers 503 before
    that). A dead replica leaves the candidates (Serve calls on_replica_actor_died / update_replicas), and its
    keys move to the live ones, each to one replica again. Unkeyed requests (/health, /v1/models, /metrics): the
    shorter queue of two replicas drawn at random."""

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # a busy replica: retry after a backoff
        key = pending_request.kwargs.get(CONVERSATION_KWARG) if pending_request is not None else None
        if key is None:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[rendezvous(key, by_id)]]]
