"""ObjectStore: the tensors a worker holds, keyed by (client, value id).

A value belongs to the client that created it; a client can only name its own ids, so one
client can never read, use or free another's tensors.
"""

from __future__ import annotations

import torch


class ObjectStore:
    """Tensors by (client identity, value id)."""

    def __init__(self) -> None:
        self._objects: dict[tuple[str, int], torch.Tensor] = {}

    def put(self, client: str, vid: int, tensor: torch.Tensor) -> None:
        self._objects[(client, vid)] = tensor

    def get(self, client: str, vid: int) -> torch.Tensor:
        try:
            return self._objects[(client, vid)]
        except KeyError:
            raise KeyError(f"value %{vid} is not stored here (freed, or never sent)") from None

    def has(self, client: str, vid: int) -> bool:
        return (client, vid) in self._objects

    def free(self, client: str, vid: int) -> None:
        self._objects.pop((client, vid), None)

    def free_client(self, client: str) -> int:
        """Drop every tensor of `client`; returns how many."""
        mine = [k for k in self._objects if k[0] == client]
        for k in mine:
            del self._objects[k]
        return len(mine)

    def clients(self) -> set[str]:
        return {c for c, _ in self._objects}

    def __len__(self) -> int:
        return len(self._objects)

    def stored_bytes(self) -> int:
        """Bytes of distinct storages held (views of one tensor count once)."""
        seen: dict[int, int] = {}
        for t in self._objects.values():
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())
