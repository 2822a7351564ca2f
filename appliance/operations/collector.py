"""How the appliance's process runs Python's cyclic garbage collector once it serves.

Owns the collector's settings for serving. Once every part of the appliance has started, what
exists then (imported modules, torch's among them, the model, the parts' state: all of it lives
as long as the process) is collected once and moved out of the collector's sight
(``gc.freeze``, once per process), so a full collection while serving does not walk it all again
(about 0.4 s with torch imported, every thousand calls or so). From then on the youngest
generation is collected every :data:`GC_YOUNG_THRESHOLD` allocations instead of Python's 700: a
call's large short-lived containers (a long conversation's parsed request, its prompt's ids) are
then seldom alive when a collection runs, which walks each of them (measured at 30k tokens: ten
collections per hundred calls, 2.5 ms each, without it).

``appliance.app`` applies it once started (:func:`freeze_startup_objects`); a benchmark that
measures one part as the appliance runs it applies the same settings for a while
(:func:`serving_collector`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["GC_YOUNG_THRESHOLD", "freeze_startup_objects", "serving_collector"]

#: Allocations between two collections of the youngest generation, once serving.
GC_YOUNG_THRESHOLD = 10_000

_frozen = False


def freeze_startup_objects() -> None:
    """Once per process, when the appliance has started: collect, then move every object left
    out of the collector's sight, and collect the youngest generation less often."""
    global _frozen
    if not _frozen:
        _frozen = True
        _apply()


@contextlib.contextmanager
def serving_collector() -> Iterator[None]:
    """The collector as a serving appliance runs it (what exists now frozen, the youngest
    generation collected every :data:`GC_YOUNG_THRESHOLD` allocations), undone on exit.

    For a process that has not frozen anything before (a benchmark's): leaving unfreezes every
    frozen object. Raises RuntimeError in one that has.
    """
    if gc.get_freeze_count():
        raise RuntimeError("serving_collector: this process has frozen objects already")
    thresholds = gc.get_threshold()
    _apply()
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def _apply() -> None:
    gc.collect()
    gc.freeze()
    _young, *older = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *older)
