"""The model-family matrix: every family's tiny model (relayrl/models/families.py) builds from its own config
class, seeded, and loads back through ``AutoModelForCausalLM`` as a user's model directory does."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from relayrl.models.families import FAMILIES, PATHS, STATUSES, build_family_model, claim, write_family_model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_builds_from_its_own_config_seeded_and_loads_back(family, tmp_path) -> None:
    spec = FAMILIES[family]
    model = build_family_model(family, seed=3)
    assert type(model.config) is getattr(transformers, spec.config_class)
    assert type(model) is getattr(transformers, spec.model_class)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    again = build_family_model(family, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    loaded = AutoModelForCausalLM.from_pretrained(write_family_model(family, tmp_path, seed=3))
    ids = torch.randint(3, 20, (2, 16))
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6)


def test_every_claim_is_one_of_the_statuses_and_a_claim_not_exact_says_why() -> None:
    for family in FAMILIES:
        for path in PATHS:
            found = claim(family, path)
            assert found.status in STATUSES and (found.status == "exact") == (found.reason == ""), (family, path)
