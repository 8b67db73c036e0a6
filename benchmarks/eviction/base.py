"""Base class of the eviction policies: reference and child counting, leaf-first pinning.

The owner protocol and the policies are described in :mod:`benchmarks.eviction`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable

Key = Hashable


class EvictionPolicy(ABC):
    """Chooses victims among the evictable entries of a cache; see the module docstring.

    Keys are any hashable (block ids in a block pool, 32-byte block keys in ``PolicyCache``).
    Misuse raises: ``ValueError`` for inserting a cached key, releasing an unreferenced one or
    removing a non-evictable one, ``KeyError`` for an unknown key, ``LookupError`` from
    ``victim()`` when nothing is evictable.

    Subclasses keep the *unpinned* (evictable) entries in their victim structures; the base
    counts references and children and calls ``_pin`` / ``_unpin`` / ``_unhold`` as an entry
    stops / starts being evictable.
    """

    def __init__(self) -> None:
        self._refs: dict[Key, int] = {}    # entry -> references by requests (> 0)
        self._kids: dict[Key, int] = {}    # entry -> number of its cached children (> 0)
        self._parent: dict[Key, Key] = {}  # entry -> its cached parent
        self._num_pinned = 0               # entries with references or children

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        if key in self:
            raise ValueError(f"{key!r} is already cached")
        self._refs[key] = 1
        self._num_pinned += 1
        self._insert(key)
        if parent is not None and parent in self:
            self._parent[key] = parent
            kids = self._kids.get(parent, 0)
            if not kids and parent not in self._refs:
                self._pin(parent)
                self._num_pinned += 1
            self._kids[parent] = kids + 1

    def on_hit(self, key: Key) -> None:
        refs = self._refs.get(key, 0)
        if not refs and key not in self._kids:
            if not self._has_unpinned(key):
                raise KeyError(key)
            self._pin(key)
            self._num_pinned += 1
        self._refs[key] = refs + 1
        self._access(key)

    def on_release(self, key: Key) -> None:
        refs = self._refs.get(key, 0)
        if not refs:
            raise ValueError(f"{key!r} is not referenced")
        if refs > 1:
            self._refs[key] = refs - 1
            return
        del self._refs[key]
        if key in self._kids:
            self._release_held(key)
        else:
            self._num_pinned -= 1
            self._unpin(key)

    def on_remove(self, key: Key) -> None:
        if key in self._refs or key in self._kids:
            raise ValueError(f"{key!r} is referenced or has cached children")
        if not self._has_unpinned(key):
            raise KeyError(key)
        self._remove(key)
        self._drop_from_parent(key)

    def victim(self) -> Key:
        """Choose an evictable entry, forget it and return its key."""
        if not self._num_unpinned():
            raise LookupError("no evictable entry")
        key = self._victim()
        self._drop_from_parent(key)
        return key

    def is_evictable(self, key: Key) -> bool:
        return key not in self._refs and key not in self._kids and self._has_unpinned(key)

    @property
    def num_evictable(self) -> int:
        return self._num_unpinned()

    def __len__(self) -> int:
        return self._num_pinned + self._num_unpinned()

    def __contains__(self, key: Key) -> bool:
        return key in self._refs or key in self._kids or self._has_unpinned(key)

    def _is_pinned(self, key: Key) -> bool:
        return key in self._refs or key in self._kids

    def _drop_from_parent(self, key: Key) -> None:
        parent = self._parent.pop(key, None)
        if parent is None:
            return
        kids = self._kids[parent] - 1
        if kids:
            self._kids[parent] = kids
            return
        del self._kids[parent]
        if parent not in self._refs:
            self._num_pinned -= 1
            self._unhold(parent)

    @abstractmethod
    def _insert(self, key: Key) -> None:
        """A new entry (pinned: referenced once)."""

    @abstractmethod
    def _access(self, key: Key) -> None:
        """A reference to an existing entry (now pinned)."""

    @abstractmethod
    def _pin(self, key: Key) -> None:
        """An unpinned entry stops being evictable: take it out of the victim structures."""

    @abstractmethod
    def _unpin(self, key: Key) -> None:
        """The last reference went: the entry is evictable as of now."""

    def _unhold(self, key: Key) -> None:
        """An unreferenced entry lost its last cached child: evictable again. Default: as if
        just released; list policies put it first in line (it was last used with that child)."""
        self._unpin(key)

    def _release_held(self, key: Key) -> None:
        """The last reference went, but the entry has cached children: stays pinned."""

    @abstractmethod
    def _remove(self, key: Key) -> None:
        """Forget an unpinned entry (not chosen as a victim)."""

    @abstractmethod
    def _victim(self) -> Key:
        """Forget and return an unpinned entry; at least one exists."""

    @abstractmethod
    def _num_unpinned(self) -> int: ...

    @abstractmethod
    def _has_unpinned(self, key: Key) -> bool: ...
