"""Peak bytes of live tensors during a block of code, on CPU, from the allocator's events.

``torch.profiler`` with ``profile_memory=True`` records every allocation and free of the CPU
allocator on the threads it watches (this one and autograd's). Walking them in time order gives
the peak of ``live(t) = live_before + sum(alloc) - sum(free)``. ``live_before`` is what exists when
the block starts and survives it; the caller passes the tensors it knows (the model's parameters
and buffers, the optimizer state). gloo's worker threads are not watched: a collective's buffer
whose last reference its work drops there leaves no free event (which thread drops it last is a
race), so an allocation at an address still counted live first frees the block counted there.
Such a block that no later allocation reuses stays counted, so the figure can still be high.
The process baseline (interpreter, libraries) is not a tensor and is not included: RSS
(``metrics.peak_memory_gib``) includes it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import torch

__all__ = ["TensorPeak", "live_tensor_bytes", "walk_allocations"]


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def live_tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (DTensors by their local shard)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = _local(t).untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 points at /dev/null for the block (C++ code writes there directly)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# What the profiler's memory hook says when a tensor allocated before the block is freed in it
# (every measured step, from C++ on every rank): the case ``walk_allocations`` handles already.
PROFILER_NOTICES = (b"allocated before the profiling started",)


class _FilteredStderr(contextlib.AbstractContextManager):
    """File descriptor 2 through a pipe for the block: lines holding one of ``drop`` are dropped,
    every other line goes on to the real stderr (a thread copies them, in order)."""

    def __init__(self, drop: tuple[bytes, ...]):
        self.drop = drop

    def __enter__(self):
        sys.stderr.flush()
        self._saved = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self._thread = threading.Thread(target=self._copy, args=(read,), daemon=True)
        self._thread.start()
        return self

    def _copy(self, read: int) -> None:
        with os.fdopen(read, "rb") as pipe:
            for line in pipe:
                if not any(text in line for text in self.drop):
                    os.write(self._saved, line)

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self._saved, 2)  # closes the pipe's last write end: the thread reads to the end
        self._thread.join(timeout=10)
        os.close(self._saved)
        return False


def walk_allocations(events) -> tuple[int, int]:
    """``(peak, net)`` bytes of allocator events ``(time_ns, size, address)``, a free with size < 0:
    the highest and the last value of the running sum, in time order. A new block at an address
    still counted live first frees the block counted there (its free was not seen)."""
    live = peak = 0
    blocks: dict[int, int] = {}  # address -> size of a block allocated here and not freed
    for _, size, address in sorted(events):
        if size > 0:
            live -= blocks.pop(address, 0)
            blocks[address] = size
        else:
            blocks.pop(address, None)
        live += size
        peak = max(peak, live)
    return peak, live


class TensorPeak(contextlib.AbstractContextManager):
    """``with TensorPeak(live_before) as peak: ...``; then ``peak.bytes`` (``peak.gib``) and
    ``peak.net_bytes`` (what the block allocated and left live)."""

    def __init__(self, live_before: int = 0):
        self.live_before = live_before
        self.bytes = live_before

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():  # kineto prints "profiler_start" lines a user has no use for
            self._profile.__enter__()
        self._filter = _FilteredStderr(PROFILER_NOTICES).__enter__()
        return self

    def __exit__(self, *exc):
        from torch._C._profiler import _EventType

        with _quiet_stderr():
            self._profile.__exit__(*exc)
        self._filter.__exit__(*exc)
        events, stack = [], list(self._profile.profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
                events.append((event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.ptr))
            stack.extend(event.children)
        peak, self.net_bytes = walk_allocations(events)  # net: allocated in the block, live at its end
        self.bytes = self.live_before + peak
        return False

    @property
    def gib(self) -> float:
        return self.bytes / 2**30


def step_tensor_peak(model, optimizer, device):
    """The context the trainer measures a step in: ``TensorPeak`` on CPU (live before: parameters,
    buffers, optimizer state), None on an accelerator (its allocator peak is ``peak_memory_gib``)."""
    if device.type != "cpu":
        return None
    state = [t for s in optimizer.state.values() for t in s.values()]
    return TensorPeak(live_tensor_bytes([*model.parameters(), *model.buffers(), *state]))
