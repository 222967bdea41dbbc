"""The hf engine's prefix KV cache: finished rows' keys and values, kept for later prompts that extend them.

An agentic episode sends each turn as a new prompt: the whole conversation so far, i.e. the previous turn's
prompt, its sampled tokens and the observation's tokens, as a request of one sample (``n`` = 1). The KV of every
finished (``stop`` or ``length``) row of such a request is kept here under its token ids: the prompt and the
sampled tokens but the last (which was never fed, so has no KV). A later prompt prefills only its tokens after
the longest prefix it shares with any stored sequence, on top of that sequence's stored KV
(``relayrl.rollout.batcher``): an episode's turn extends its previous turn's sequence, so its prefill costs the
turn's new tokens, not the conversation; and prompts that begin alike (a system prompt, the tools) share their
beginning. vLLM's automatic prefix caching (blocks) and SGLang's radix cache (a tree) do the same; here the
sequences sit in a token trie, so a lookup walks the prompt once.

Bounded by ``budget`` tokens (``rollout.prefix_cache_tokens``; 0 turns it off): storing beyond it evicts the least
recently used (stored or hit) entries; an entry longer than the budget is not stored. Storing a row's sequence
makes the entry its prompt was prefilled on (the previous turn of the same episode, whose tokens it holds) the
first to go: kept while there is room, since the episodes of a group often begin alike and another may still
need it.

Entries are valid for one set of weights: ``flush`` (every weight change: a load, an adapter, an in-flight
update) drops them all and starts a new ``epoch``; a row whose KV was computed under an older epoch is never
stored (``store`` checks), so no entry outlives the weights that computed it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CachedPrefix:
    """A token sequence and its KV: per layer keys and values [kv_heads, len(tokens), head_dim]."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class _Node:
    """A trie node: the sequence of the tokens on the path to it; ``entry`` when that sequence is stored. A node
    without an entry has children (``PrefixCache._drop`` prunes the others)."""

    __slots__ = ("children", "entry")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.entry: CachedPrefix | None = None


class PrefixCache:
    """The store (module docstring): entries in a token trie (a lookup walks the prompt once) and in least recently
    used order. Thread-safe (the scheduler stores and looks up, a weight load flushes)."""

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"prefix_cache_tokens (rollout.prefix_cache_tokens): must be >= 0, got {budget}")
        self.budget = budget
        self.epoch = 0
        self.tokens = 0  # stored, all entries together
        self._entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()  # least recently used first
        self._root = _Node()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int]) -> CachedPrefix | None:
        """The longest common prefix of ``prompt`` (but its last token: one is left to prefill) and any stored
        sequence, with that sequence's KV for it (a stored entry itself when it is all of one, else a view of
        the first tokens of one), the sequence marked as recently used; None when no token is shared."""
        with self._lock:
            node, depth = self._root, 0
            for token in prompt[: len(prompt) - 1]:
                child = node.children.get(token)
                if child is None:
                    break
                node, depth = child, depth + 1
            if depth == 0:
                return None
            while node.entry is None:  # every node without an entry leads to one
                node = next(iter(node.children.values()))
            entry = node.entry
            self._entries.move_to_end(entry.tokens)
        if depth == len(entry.tokens):
            return entry
        return CachedPrefix(
            entry.tokens[:depth], [k[:, :depth] for k in entry.keys], [v[:, :depth] for v in entry.values]
        )

    def store(self, entry: CachedPrefix, epoch: int, extends: tuple[int, ...] | None = None) -> bool:
        """Keep ``entry`` (its KV computed under ``epoch``) unless that epoch is over or it exceeds the budget, in
        place of an equal one; the entry ``extends`` (the one its row was prefilled on) becomes the least recently
        used; evicts what the budget needs. Returns whether it was stored."""
        size = len(entry.tokens)
        with self._lock:
            if epoch != self.epoch or not 0 < size <= self.budget:
                return False
            self._drop(entry.tokens)
            if extends in self._entries:
                self._entries.move_to_end(extends, last=False)
            while self.tokens + size > self.budget:
                self._drop(next(iter(self._entries)))
            node = self._root
            for token in entry.tokens:
                node = node.children.setdefault(token, _Node())
            node.entry = entry
            self._entries[entry.tokens] = entry
            self.tokens += size
            return True

    def flush(self) -> int:
        """Drop every entry and start a new epoch (the weights changed); returns how many entries went."""
        with self._lock:
            dropped = len(self._entries)
            self._entries.clear()
            self._root = _Node()
            self.tokens = 0
            self.epoch += 1
            return dropped

    def _drop(self, tokens: tuple[int, ...]) -> None:
        """Remove the entry stored under ``tokens`` if there is one, and the trie nodes only it used (lock held)."""
        if self._entries.pop(tokens, None) is None:
            return
        self.tokens -= len(tokens)
        path = [self._root]
        for token in tokens:
            path.append(path[-1].children[token])
        path[-1].entry = None
        for depth in reversed(range(len(tokens))):
            node = path[depth + 1]
            if node.children or node.entry is not None:
                break
            del path[depth].children[tokens[depth]]
