"""Keep Python's cyclic garbage collector off the startup heap: no full collection walks it mid-run.

A role's heap after startup is hundreds of thousands of objects (torch, transformers, datasets and gRPC
modules, the model, the tokenizer), and it lives as long as the process. CPython's collector walks all of it at
every full (generation-2) collection, which it runs whenever the objects that survived into the oldest
generation grew by 25 %: early in a run, as the first steps' caches fill, that is several times, and the whole
process stands still while it walks them (a rollout worker's chunk or a trainer's step stalls, and so do the
fork server's imports on the way to the first step).

``gc.freeze()`` moves every object alive into a permanent generation the collector never walks (it is still
freed by reference counting). Used as the CPython documentation of ``gc.freeze`` recommends for a forking
server, and as vLLM (``freeze_gc_heap`` at the end of ``compile_or_warm_up_model``, vllm/v1/worker) and
SGLang (``freeze_gc``, sglang/srt/utils) do after their startup:

- the fork server (``relayrl/runtime/forkserver.py``) collects nothing while it imports (``gc.disable``) and freezes its
  heap before each fork, so a forked role starts with its imports frozen (and their copy-on-write pages left
  alone by the collector) and turns its collector back on;
- every role, forked or not, collects nothing while it imports and loads (``pause_collection``, first thing in
  its command) and freezes what its startup built once it is ready to serve or to train
  (``freeze_startup_heap``): a collection first, so that startup garbage is freed rather than kept forever,
  then the collector resumes. A role started fresh (the K >= 1 trainer, which the fork server does not fork;
  torchrun's ranks; a role on another machine) runs one full collection on the way to its first step, the one
  before its freeze, instead of one at every growth of its imports.

What a role allocates afterwards is collected as usual.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def pause_collection() -> None:
    """No cyclic collection until ``freeze_startup_heap``: call it before a role's imports."""
    gc.disable()


def freeze_startup_heap(role: str) -> tuple[int, int]:
    """Collect once, exempt every object alive from the cyclic collector, and (re)enable it. Returns (frozen in
    all, of which frozen already: by the fork server, for a forked role)."""
    inherited = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    gc.enable()
    frozen = gc.get_freeze_count()
    log.info(
        "%s: %d startup objects frozen out of garbage collection (%d of them by the fork server)",
        role, frozen, inherited,
    )  # fmt: skip
    return frozen, inherited
