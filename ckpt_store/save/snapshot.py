"""The snapshot: copy the chunks this rank writes into reused host memory.

This copy is the only part of a save the caller waits for. The memory is
one ``memfd`` (anonymous shared memory, not limited by /dev/shm's size)
that grows as needed and is reused by every save, so no page is allocated
or faulted in after the first save; the writer process maps the same fd
and encodes and uploads straight from it. Each owned chunk gets a whole
chunk-shaped slot (C order, zero padding past the array's edge, as Zarr
stores edge chunks), so the writer never reshapes or pads. ``reserve``
lays the slots out before anything is copied, so the writer can be handed
the job first and write each slot as soon as ``fill`` has copied it.
"""

from __future__ import annotations

import mmap
import os

import torch

from ckpt_store.format import layout
from ckpt_store.format.zarr_format import chunk_key, slot_nbytes
from ckpt_store.save.save_job import Slot

ALIGN = 64
PROGRESS_BYTES = 16 * 2**20     # the writer hears how far the copy got after about this much


class HostArena:
    """A growable memfd-backed byte buffer shared with the writer process."""

    def __init__(self):
        self.fd: int | None = os.memfd_create("marind-ckpt-snapshot", 0)
        self.size = 0
        self._mm: mmap.mmap | None = None
        self.buf: torch.Tensor | None = None
        self._pinned = False

    def ensure(self, nbytes: int) -> None:
        if nbytes <= self.size:
            return
        size = max(nbytes, 1) + (1 << 20)
        self._unpin()      # the old mapping goes: its pages must not stay page-locked
        fd = self.fileno()
        os.ftruncate(fd, size)
        self._mm = mmap.mmap(fd, size)
        self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.size = size
        self._pinned = False

    def fileno(self) -> int:
        """The memfd (for the writer process to map)."""
        if self.fd is None:
            raise ValueError("the snapshot arena is closed")
        return self.fd

    def tensor(self) -> torch.Tensor:
        """The arena's bytes as a uint8 tensor (``ensure`` first)."""
        if self.buf is None:
            raise ValueError("the snapshot arena holds no memory: reserve() the slots first")
        return self.buf

    def pin_for_cuda(self) -> None:
        """Page-lock the arena once so device-to-host copies run at full speed."""
        if self._pinned or self.buf is None:
            return
        try:
            err = torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), self.size, 0)
            self._pinned = int(err) == 0
        except Exception:  # noqa: BLE001 - unpinned copies are slower, still correct
            self._pinned = False

    def _unpin(self) -> None:
        if self._pinned and self.buf is not None:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
            except Exception:  # noqa: BLE001 - the process is going anyway
                pass
        self._pinned = False

    def view(self) -> memoryview:
        return memoryview(self._mm) if self._mm is not None else memoryview(b"")

    def close(self) -> None:
        self._unpin()
        self.buf = None
        self._mm = None  # the mapping goes when the last view of it does
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def reserve(plans: list, arena: HostArena) -> tuple[list[Slot], list[tuple]]:
    """Give every owned chunk of ``plans`` a slot in ``arena`` (grown to hold them all).

    Returns the slots for the writer's job (in copy order) and the copies for ``fill``.
    """
    copies: list[tuple] = []
    slots: list[Slot] = []
    total = 0
    for plan in plans:
        spec = plan.spec
        for cell, piece in plan.owned:
            nbytes = slot_nbytes(spec)
            cbox = layout.cell_box(cell, spec.chunks, spec.shape)
            copies.append((plan, cbox, piece, total, nbytes))
            slots.append(Slot(key=chunk_key(spec.name, cell), array=spec.name, offset=total,
                              nbytes=nbytes, valid_rows=cbox.shape[0] if cbox.shape else 1))
            total += -(-nbytes // ALIGN) * ALIGN
    arena.ensure(total)
    return slots, copies


def fill(copies: list[tuple], arena: HostArena, on_progress=None, every_bytes: int = PROGRESS_BYTES) -> None:
    """Make ``copies`` in order. ``on_progress(n)``, after each run of at least ``every_bytes``:
    the first ``n`` slots hold their chunks (CUDA copies are synchronized first)."""
    cuda = False
    since = 0
    for i, (plan, cbox, piece, offset, nbytes) in enumerate(copies):
        spec = plan.spec
        src = plan.local[tuple(slice(a + o - b, a + o - b + s) for a, o, b, s in
                               zip(piece.local, cbox.offset, piece.box.offset, cbox.shape))]
        if src.device.type == "cuda" and not cuda:
            cuda = True
            arena.pin_for_cuda()
        dst = arena.tensor()[offset:offset + nbytes].view(src.dtype).view(spec.chunks)
        if tuple(cbox.shape) != tuple(spec.chunks):
            dst.zero_()
            dst = dst[tuple(slice(0, s) for s in cbox.shape)]
        dst.copy_(src, non_blocking=cuda)
        since += nbytes
        if on_progress is not None and since >= every_bytes and i + 1 < len(copies):
            if cuda:
                torch.cuda.current_stream().synchronize()
            on_progress(i + 1)
            since = 0
    if cuda:
        torch.cuda.current_stream().synchronize()   # the copies were queued on this stream
