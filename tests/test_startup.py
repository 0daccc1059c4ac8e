"""serving.startup: the entry points' imports run without the cyclic garbage collector, which comes back after."""

from __future__ import annotations

import gc

from serving.startup import imports_without_gc


def test_the_collector_is_off_within_and_back_after_with_what_was_made_frozen():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with imports_without_gc():
            assert not gc.isenabled()
            made = [[i] for i in range(1000)]  # tracked containers, alive when the block ends
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(made)
        gc.disable()  # a caller that had turned it off keeps it off
        with imports_without_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()
