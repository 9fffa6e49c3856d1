"""Where cached activations live: a table with one row per sample key, in memory or in a
file on disk, under byte limits.

A table holds one tensor leaf of the cached output per row; rows are written once per
key (the first epoch that sees it) and read by batches of keys. Rows are stored in the
activation's own dtype unless a lower storage dtype was asked for. On disk every row has
a CRC-32; a row whose bytes or length do not check out raises :class:`CorruptRows`, and a
failed write raises :class:`StoreFull`.

No cache file outlives its process: a disk table's file is unlinked as soon as it is open
and read and written through its descriptor, so the space comes back when the descriptor is
closed, on :meth:`Table.close`, at exit, or by the kernel when the process is killed. Where
an open file cannot be unlinked (Windows), it is removed on close, when the table is
collected, or at interpreter exit (``weakref.finalize``); a killed process leaves it there.
"""

from __future__ import annotations

import os
import tempfile
import weakref
import zlib
from typing import Sequence

import numpy as np
import torch

__all__ = ["Table", "MemoryTable", "DiskTable", "CorruptRows", "StoreFull", "FILE_PREFIX", "disk_folder"]

#: How a disk table's file is named in its folder (``egeria-activations-XXXX.bin``), for the
#: moment between its creation and its unlinking.
FILE_PREFIX = "egeria-activations-"


def disk_folder(directory: str | None) -> str:
    """Where disk tables go: ``directory``, else the system's temporary folder
    (``tempfile.gettempdir()``: ``$TMPDIR``, else ``/tmp`` on Linux)."""
    return os.path.abspath(directory if directory is not None else tempfile.gettempdir())


class CorruptRows(Exception):
    """Some rows read back do not match what was written."""


class StoreFull(Exception):
    """A write failed (disk full, I/O error)."""


class Table:
    """Rows of shape ``shape`` for keys ``0..rows-1``.

    Args:
        rows: number of keys.
        shape: per-sample shape of the cached tensor.
        dtype: the activation's dtype (what reads return).
        storage: the dtype rows are kept in (``dtype`` by default: exact).
    """

    kind = "memory"

    def __init__(self, rows: int, shape: Sequence[int], dtype: torch.dtype, storage: torch.dtype | None = None) -> None:
        self.rows = rows
        self.shape = tuple(shape)
        self.dtype = dtype
        self.storage = storage or dtype
        self.written = np.zeros(rows, dtype=bool)

    @staticmethod
    def row_bytes(shape: Sequence[int], storage: torch.dtype) -> int:
        return int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=storage).element_size()

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes(self.shape, self.storage)

    def has(self, keys: Sequence[int]) -> bool:
        return bool(self.written[np.asarray(keys)].all())

    def forget(self, keys: Sequence[int]) -> None:
        """Marks rows as not written (after a corrupt read), so they are recomputed."""
        self.written[np.asarray(keys)] = False

    def write(self, keys: Sequence[int], values: torch.Tensor) -> None:
        raise NotImplementedError

    def read(self, keys: Sequence[int]) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


class MemoryTable(Table):
    """Rows in one preallocated CPU tensor."""

    kind = "memory"

    def __init__(self, rows: int, shape: Sequence[int], dtype: torch.dtype, storage: torch.dtype | None = None) -> None:
        super().__init__(rows, shape, dtype, storage)
        self.data = torch.empty((rows, *self.shape), dtype=self.storage)

    def write(self, keys: Sequence[int], values: torch.Tensor) -> None:
        index = torch.as_tensor(keys, dtype=torch.long)
        self.data.index_copy_(0, index, values.detach().to("cpu", self.storage))
        self.written[np.asarray(keys)] = True

    def read(self, keys: Sequence[int]) -> torch.Tensor:
        return self.data.index_select(0, torch.as_tensor(keys, dtype=torch.long)).to(self.dtype)

    def close(self) -> None:
        self.data = torch.empty(0)


class DiskTable(Table):
    """Rows in one file, written and read with ``pwrite``/``pread``, one CRC-32 per row.

    The file is unlinked as soon as it is open (see the module docstring): nothing is left
    in ``directory`` once it is created, even by a killed process.

    Args:
        directory: the folder the file goes in (created if needed; see :func:`disk_folder`).

    Attributes:
        path: the name the file was created under (gone from the folder when ``unlinked``).
        folder: the folder it is in.
        unlinked: True when the name was removed at once; False where an open file cannot be
            unlinked, and it is removed on close, collection or interpreter exit instead.
    """

    kind = "disk"

    def __init__(
        self, rows: int, shape: Sequence[int], dtype: torch.dtype, storage: torch.dtype | None = None, *, directory: str | None = None
    ) -> None:
        super().__init__(rows, shape, dtype, storage)
        self.folder = disk_folder(directory)
        os.makedirs(self.folder, exist_ok=True)
        fd, self.path = tempfile.mkstemp(prefix=FILE_PREFIX, suffix=".bin", dir=self.folder)
        self.fd: int | None = fd
        try:
            os.unlink(self.path)
            self.unlinked = True
        except OSError:  # Windows: an open file keeps its name
            self.unlinked = False
        # closes the descriptor (and removes a file that kept its name) on close(), when the
        # table is collected, or at interpreter exit, whichever comes first
        self._release = weakref.finalize(self, _release, fd, None if self.unlinked else self.path)
        self.stride = self.row_bytes(self.shape, self.storage)
        self.crc = np.zeros(rows, dtype=np.uint32)

    def write(self, keys: Sequence[int], values: torch.Tensor) -> None:
        rows = values.detach().to("cpu", self.storage).contiguous()
        raw = rows.reshape(-1).view(torch.uint8).reshape(len(keys), -1).numpy()
        try:
            for key, row in zip(keys, raw):
                data = row.tobytes()
                if os.pwrite(self.fd, data, key * self.stride) != len(data):
                    raise OSError("short write")
                self.crc[key] = zlib.crc32(data)
        except OSError as err:
            raise StoreFull(f"writing {self.path}: {err}") from err
        self.written[np.asarray(keys)] = True

    def read(self, keys: Sequence[int]) -> torch.Tensor:
        out = np.empty((len(keys), self.stride), dtype=np.uint8)
        for i, key in enumerate(keys):
            try:
                data = os.pread(self.fd, self.stride, key * self.stride)
            except OSError as err:
                raise CorruptRows(f"reading row {key} of {self.path}: {err}") from err
            if len(data) != self.stride:
                raise CorruptRows(f"row {key} of {self.path} is truncated ({len(data)} of {self.stride} bytes)")
            if zlib.crc32(data) != self.crc[key]:
                raise CorruptRows(f"row {key} of {self.path} fails its checksum")
            out[i] = np.frombuffer(data, dtype=np.uint8)
        rows = torch.from_numpy(out).view(self.storage).reshape(len(keys), *self.shape)
        return rows.to(self.dtype)

    def close(self) -> None:
        self.fd = None
        self._release()


def _release(fd: int, path: str | None) -> None:
    """Closes a disk table's file, and removes it when it still has a name (``path``)."""
    try:
        os.close(fd)
    except OSError:
        pass
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
