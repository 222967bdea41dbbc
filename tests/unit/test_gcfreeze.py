"""relayrl.runtime.gcfreeze: a role collects nothing while it starts; then its startup heap leaves the cyclic collector
(never walked again), its startup garbage is freed first, and what it allocates later is collected again."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import gc, json, weakref
    from relayrl.runtime.gcfreeze import freeze_startup_heap, pause_collection

    pause_collection()                             # as a role does before its imports
    paused = not gc.isenabled()

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return a

    kept = [cycle() for _ in range(1000)]          # startup state the role keeps
    dropped = weakref.ref(cycle())                 # startup garbage: a cycle only the collector frees
    frozen, inherited = freeze_startup_heap("test")
    tracked = {id(o) for o in gc.get_objects()}    # the collector's generations; the frozen ones are not in them
    later = weakref.ref(cycle())                   # garbage made after the freeze
    gc.collect()
    print(json.dumps({
        "frozen": frozen, "inherited": inherited, "count": gc.get_freeze_count(),
        "startup_garbage_freed": dropped() is None,
        "kept_tracked": sum(id(n) in tracked for n in kept),
        "later_garbage_freed": later() is None, "paused": paused, "enabled_after": gc.isenabled(),
    }))
    """
)


def test_the_startup_heap_is_frozen_its_garbage_freed_and_collection_resumes():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["startup_garbage_freed"]  # collected before the freeze, not kept for good
    assert out["kept_tracked"] == 0  # no collection walks the startup objects any more
    assert out["frozen"] == out["count"] >= 2000 and out["inherited"] == 0  # a fresh interpreter: none inherited
    assert out["paused"] and out["enabled_after"]  # no collections while starting, the collector back on after
    assert out["later_garbage_freed"]  # and it still frees what comes after
