"""A shared-memory mapping that owns its CUDA registration.

Every mapping of an arena file (payload segments, exported host caches, a consumer's
mappings of them) is a :class:`PinnedMap`. :meth:`~PinnedMap.pin_later` asks the process's
:class:`~vllm_omni_kv.backends.pinner.Pinner` to register it in the background (a request
path never waits for ``cudaHostRegister``); :meth:`~PinnedMap.close`, and the garbage
collector for a mapping dropped unclosed, release the registration before the memory is
unmapped (a close during the registration leaves the unmap to the pinner's thread; the
collector waits for it). A registration therefore never outlives its mapping, and a later mapping at the
same address never meets a stale one (CUDA error 712).
"""

from __future__ import annotations

import ctypes
import mmap

from vllm_omni_kv.backends.pinner import PendingPin, Pinner, default_pinner

__all__ = ["PinnedMap"]


class PinnedMap(mmap.mmap):
    """``mmap.mmap`` plus the registration of its memory (None until asked for)."""

    _pin: PendingPin | None = None
    _closing = False  # close() was called (the unmap may still be pending)

    @property
    def pin(self) -> PendingPin | None:
        """The registration asked for (settles in the background), or None."""
        return self._pin

    def address(self) -> int:
        """Where the mapping starts in this process."""
        ref = ctypes.c_char.from_buffer(self)
        addr = ctypes.addressof(ref)
        del ref  # the buffer export would keep the map from closing
        return addr

    def pin_later(self, pinner: Pinner | None = None) -> None:
        """Have the mapping registered with CUDA in the background (nothing where this
        process does not use CUDA); copies stay synchronous until it lands."""
        if self._pin is not None or self._closing or self.closed or len(self) == 0:
            return
        self._pin = (pinner if pinner is not None else default_pinner()).request(
            self.address(), len(self)
        )

    def unpin(self) -> None:
        """Release the registration, waiting for one in flight; the mapping stays."""
        pin, self._pin = self._pin, None
        if pin is not None:
            pin.release()

    def close(self) -> None:
        """Unregister, then unmap (``BufferError`` while views are alive, as mmap's). While
        the registration is in flight, the mapping stays open and the pinner's thread unmaps
        it once the registration is undone: no caller waits for ``cudaHostRegister``."""
        self._closing = True
        pin, self._pin = self._pin, None
        if pin is not None and not pin.release(then=self._unmap_later):
            return
        super().close()

    def _unmap_later(self) -> None:
        try:
            super().close()
        except BufferError:  # views still alive: the collector unmaps it
            pass

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # runs before mmap's own deallocation unmaps the memory
        self.unpin()
