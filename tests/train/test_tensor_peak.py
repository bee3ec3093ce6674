"""``TensorPeak``: the peak and net bytes of live tensors from the CPU allocator's events.

- the event walk: peak and net of a known sequence; a block freed before the window lowers net;
  a block allocated again at an address still counted live (its free ran on a thread the
  profiler does not watch, as gloo's workers do) is counted once, not twice;
- the profiler wiring: tensors made and dropped in the block give their exact sizes.
"""

from __future__ import annotations

import os

import torch

from hybridpar.train.tensor_peak import TensorPeak, walk_allocations

MIB = 2**20


def test_walk_gives_the_peak_and_what_is_left_live():
    events = [(0, 100, 1), (1, 50, 2), (2, -100, 1), (3, 30, 3)]  # (time, size, address); a free < 0
    assert walk_allocations(events) == (150, 80)
    assert walk_allocations(list(reversed(events))) == (150, 80)  # ordered by time, not by arrival


def test_a_block_freed_in_the_window_but_made_before_it_lowers_net():
    assert walk_allocations([(0, 64, 1), (1, -256, 9)]) == (64, -192)


def test_an_address_allocated_again_without_a_seen_free_counts_once():
    # without the rule: 100 + 100 live at the end, peak 200
    assert walk_allocations([(0, 100, 7), (1, 100, 7)]) == (100, 100)
    # the same address reused after a seen free is an ordinary new block
    assert walk_allocations([(0, 100, 7), (1, -100, 7), (2, 40, 7)]) == (100, 40)


def test_tensors_made_in_the_block_are_measured_exactly():
    with TensorPeak(live_before=5) as peak:
        kept = torch.empty(4 * MIB, dtype=torch.uint8)
        dropped = torch.empty(2 * MIB, dtype=torch.uint8)
        del dropped
    assert peak.net_bytes == kept.untyped_storage().nbytes() == 4 * MIB
    assert peak.bytes == 5 + 6 * MIB


def test_the_profilers_notice_is_dropped_and_other_stderr_lines_pass(capfd):
    """Every measured step printed "Memory block of unknown size was allocated before the profiling
    started ..." from C++ on every rank (a tensor made before the step freed in it); the step's
    other stderr lines reach the user, in order."""
    before = torch.ones(1024)  # allocated before the block, freed in it: the profiler's notice
    with TensorPeak():
        os.write(2, b"first line\n")
        del before
        os.write(2, b"[W] CPUAllocator.cpp: Memory block of unknown size was allocated before the profiling started\n")
        os.write(2, b"second line\n")
    err = capfd.readouterr().err
    assert "first line\nsecond line\n" in err and "profiling started" not in err
