"""ObjectStore: the tensors one client session holds on a worker, by value id.

Each session has a store of its own (see session.py), so a client can only ever name its own
tensors: no id it sends can reach another client's. The store counts the bytes of the
distinct storages it holds as tensors come and go, so a memory check costs nothing. An
empty storage counts as one byte: a session that stores anything holds some memory (an
executor place is given up only by a session that holds none, shares.py).
"""

from __future__ import annotations

import torch


class ObjectStore:
    """Tensors by value id, and the bytes of the distinct storages behind them."""

    def __init__(self) -> None:
        self._objects: dict[int, torch.Tensor] = {}
        # storage identity (its StorageImpl, which keeps its identity when resize_ moves its
        # data) -> [nbytes, references]
        self._storages: dict[int, list[int]] = {}
        self.stored_bytes = 0

    def put(self, vid: int, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):  # a bug upstream; never store anything else
            raise TypeError(f"only tensors are stored, not {type(tensor).__name__}")
        if vid in self._objects:
            self.free(vid)
        storage = tensor.untyped_storage()
        key, nbytes = storage._cdata, _size(storage)
        entry = self._storages.get(key)
        if entry is None:
            self._storages[key] = [nbytes, 1]
            self.stored_bytes += nbytes
        else:  # held already, maybe grown by a resize_ since: counted at its size now
            self.stored_bytes += nbytes - entry[0]
            entry[0] = nbytes
            entry[1] += 1
        self._objects[vid] = tensor

    def recount(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage at its size now, if a value here holds it: a resize_
        grows a storage in place, and the growth is held whether or not its run goes on."""
        storage = tensor.untyped_storage()
        entry = self._storages.get(storage._cdata)
        if entry is not None and entry[0] != _size(storage):
            self.stored_bytes += _size(storage) - entry[0]
            entry[0] = _size(storage)

    def get(self, vid: int) -> torch.Tensor:
        try:
            return self._objects[vid]
        except KeyError:
            raise KeyError(f"value %{vid} is not stored here (freed, or never sent)") from None

    def has(self, vid: int) -> bool:
        return vid in self._objects

    def free(self, vid: int) -> None:
        tensor = self._objects.pop(vid, None)
        if tensor is None:
            return
        ptr = tensor.untyped_storage()._cdata
        entry = self._storages[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.stored_bytes -= entry[0]
            del self._storages[ptr]

    def bytes_freed_by(self, vids: list[int]) -> int:
        """Bytes that freeing `vids` would release (storages no other value shares)."""
        dropped: dict[int, int] = {}
        for vid in set(vids):
            tensor = self._objects.get(vid)
            if tensor is not None:
                ptr = tensor.untyped_storage()._cdata
                dropped[ptr] = dropped.get(ptr, 0) + 1
        return sum(self._storages[p][0] for p, n in dropped.items() if n == self._storages[p][1])

    def clear(self) -> int:
        """Drop every tensor; returns how many."""
        n = len(self._objects)
        self._objects.clear()
        self._storages.clear()
        self.stored_bytes = 0
        return n

    def __len__(self) -> int:
        return len(self._objects)


def _size(storage: torch.UntypedStorage) -> int:
    """Bytes a storage is counted for: its own, at least one (see the module docstring)."""
    return max(storage.nbytes(), 1)
