"""The megatron-core CPU compatibility layer: every replaced site still exists upstream and still holds the
CUDA hard-code it stands in for (an upgrade that moves or fixes one fails here, loudly), and the
replacements do on CPU what the originals do on CUDA."""

from __future__ import annotations

import inspect

import megatron.core as megatron_core  # the dev extra: make test runs these (a broken install fails)
import pytest
import torch

from relayrl.trainer.backends import megatron_cpu
from relayrl.trainer.backends.megatron_cpu import SITES, apply_cpu_compat, original, site_owner


def test_megatron_core_is_the_tested_release():
    assert megatron_core.__version__.startswith("0.16."), (
        f"megatron-core {megatron_core.__version__}: the CPU layer (relayrl/trainer/backends/megatron_cpu.py) was "
        "checked against 0.16.x; re-check every site, then widen the `megatron` extra's pin"
    )


@pytest.mark.parametrize("site", SITES, ids=lambda s: f"{s.module}.{s.owner or ''}.{s.name}")
def test_every_replaced_site_still_holds_its_cuda_hard_code(site):
    try:
        owner = site_owner(site)
    except (ImportError, AttributeError) as err:
        pytest.fail(f"megatron-core moved {site.module}.{site.owner}: {err}; update megatron_cpu.SITES")
    assert hasattr(owner, site.name), f"{site.module}.{site.owner}.{site.name} is gone upstream"
    source = inspect.getsource(original(site))
    assert site.cuda_marker in source, (
        f"{site.module}.{site.name} no longer contains {site.cuda_marker!r}: upstream changed it; "
        "drop or redo its replacement in megatron_cpu.py"
    )


def test_applied_on_cpu_only(monkeypatch):
    assert apply_cpu_compat() is True
    for site in SITES:
        assert getattr(site_owner(site), site.name) is site.replacement
    assert apply_cpu_compat() is True  # idempotent: the originals stay recorded
    assert all(original(site) is not site.replacement for site in SITES)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert apply_cpu_compat() is False


def test_causal_mask_and_rotary_embedding_on_cpu():
    apply_cpu_compat()
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer import utils

    mask = utils.get_default_causal_mask(4)
    assert mask.device.type == "cpu" and torch.equal(mask, torch.ones(4, 4).triu(1).bool())
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
    emb = rope.get_emb(5)
    theta = torch.arange(5.0).unsqueeze(1) * (10000 ** (-torch.arange(0, 8, 2) / 8.0))
    assert emb.shape == (5, 1, 1, 8)
    torch.testing.assert_close(emb[:, 0, 0], torch.cat([theta, theta], dim=-1))


def test_rng_tracker_forks_the_cpu_generator():
    tracker = megatron_cpu.CPURNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    with tracker.fork():
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the forked stream advanced
    torch.manual_seed(123)
    assert torch.equal(first, torch.rand(3))
    with pytest.raises(RuntimeError, match="not added"):
        tracker.fork("other").__enter__()
