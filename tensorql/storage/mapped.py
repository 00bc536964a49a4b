"""Keep a memory-mapped input from filling the writer's resident memory.

Reading a memory-mapped ``.npy`` chunk by chunk maps every page it touches into the process;
those file-backed pages count towards its RSS until the kernel needs them back. When a store
streams such an array in, ``MappedPageReleaser`` periodically tells the kernel the process no
longer needs them (``MADV_DONTNEED``). For shared mappings (numpy modes ``r``, ``r+``, ``w+``)
this drops nothing: the data stays in the file and its page cache and is faulted back in if
read again. Copy-on-write mappings (mode ``c``) are left alone, since that would discard
private changes.

>>> import numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "a.npy")
>>> np.save(path, np.arange(10.0))
>>> mapped = np.load(path, mmap_mode="r")
>>> releaser = MappedPageReleaser.for_array(mapped, every_bytes=1)
>>> releaser.consumed(80)
True
>>> float(mapped.sum())
45.0
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import numpy as np

_SHARED_MODES = ("r", "r+", "w+", "readonly", "readwrite", "write")


@dataclass
class MappedPageReleaser:
    """Calls ``madvise(MADV_DONTNEED)`` on ``mapping`` after every ``every_bytes`` consumed."""

    mapping: mmap.mmap | None
    every_bytes: int = 256 << 20
    _since: int = field(default=0, repr=False)

    @classmethod
    def for_array(cls, array: np.ndarray, every_bytes: int = 256 << 20) -> MappedPageReleaser:
        """A releaser for ``array``'s mapping; a no-op one unless it is a shared np.memmap."""
        mapping = getattr(array, "_mmap", None)
        mode = getattr(array, "mode", None)
        usable = (isinstance(mapping, mmap.mmap) and mode in _SHARED_MODES
                  and hasattr(mapping, "madvise") and hasattr(mmap, "MADV_DONTNEED"))
        return cls(mapping if usable else None, every_bytes)

    def consumed(self, nbytes: int) -> bool:
        """Count ``nbytes`` read from the mapping; True when its pages were just released."""
        if self.mapping is None:
            return False
        self._since += int(nbytes)
        if self._since < self.every_bytes:
            return False
        self._since = 0
        try:
            self.mapping.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):  # closed or not advisable: nothing to release
            return False
        return True
