"""The order clients are served in when the pool is full (`DispatchConfig.client_order`).

`fair`: the client with the fewest requests in flight per unit of weight first. `shortest_first`: the
client with the least work left (as it reports it), fair among equals. `longest_answers_first`: the client
asking for the longest answers (max_tokens) first, fair among equals. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

from fedpool.federation.dispatch_types import CLIENT_ORDERS


class ClientOrder:
    def __init__(self, order: str):
        if order not in CLIENT_ORDERS:
            raise ValueError(f"client_order must be one of {', '.join(CLIENT_ORDERS)}, not {order!r}")
        self.name = order
        self._weights: dict[str, float] = {}
        self._remaining: dict[str, float] = {}
        self._answer: dict[str, float] = {}  # the answer length each client asks for (max_tokens)

    def set_weight(self, client_id: str, weight: float) -> None:
        if weight <= 0:
            raise ValueError("client weight must be positive")
        self._weights[client_id] = weight

    def set_remaining(self, client_id: str, work: float) -> None:
        self._remaining[client_id] = max(0.0, work)

    def note_answer_length(self, client_id: str, max_tokens: float) -> None:
        self._answer[client_id] = max_tokens

    def first(self, client_id: str) -> float:
        """The order's own criterion (smaller first); 0 for every client under `fair`."""
        if self.name == "shortest_first":
            return self._remaining.get(client_id, float("inf"))
        if self.name == "longest_answers_first":
            return -self._answer.get(client_id, 0.0)
        return 0.0

    def key(self, client_id: str, inflight: int) -> tuple[float, float]:
        """Smaller first: the criterion, then requests in flight per unit of weight."""
        return self.first(client_id), inflight / self._weights.get(client_id, 1.0)
