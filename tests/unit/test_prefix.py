"""Shared-prefix forwards: a group's rows laid out as [prompt, response_1, ..., response_k] see the prompt and their
own response only, score as their padded rows do, and a step so laid out is the padded step's update (gradients and
weights within 1e-5), in a world of one rank and of two."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from trainer_testing import GradsBackend, grpo_batch, on_ranks_case, spawn_ranks, trained_once, update_gaps
from transformers import AutoModelForCausalLM

from relayrl.algorithms.logprobs import logprobs_from_logits
from relayrl.config import AlgorithmConfig, ConfigError, TrainerConfig, parse_config
from relayrl.runtime.ports import free_port
from relayrl.trainer.prefix import (
    AUTO_MIN_SAVED_SHARE,
    GroupLayout,
    SharedPrefix,
    group_layouts,
    layout_inputs,
    mask_unsupported,
    shared_prefix_logprobs,
)

TOLERANCE = 1e-5
ALG = AlgorithmConfig(old_logprobs="recompute")


def test_a_layout_holds_the_prefix_once_then_each_suffix_seen_by_itself() -> None:
    ids = torch.tensor([[1, 2, 3, 4, 0], [1, 2, 5, 0, 0], [1, 2, 3, 6, 7], [8, 9, 0, 0, 0]])
    layouts = group_layouts(ids, [4, 3, 5, 2], torch.tensor([0, 0, 0, 1]))
    assert layouts == [GroupLayout((0, 1, 2), (4, 3, 5), 2), GroupLayout((3,), (2,), 2)]
    first = layouts[0]
    assert first.length == 2 + 2 + 1 + 3 and first.positions() == ([0, 1, 2, 3, 2, 2, 3, 4], [0, 0, 1, 1, 2, 3, 3, 3])
    t = torch.arange(5)
    assert first.where(2, t).tolist() == [0, 1, 5, 6, 7]  # row 2's tokens 2.. after rows 0's and 1's suffixes
    tokens, position_ids, mask = layout_inputs(layouts, ids, torch.device("cpu"))
    assert tokens.tolist() == [[1, 2, 3, 4, 5, 3, 6, 7], [8, 9, 0, 0, 0, 0, 0, 0]]
    assert position_ids[0].tolist() == [0, 1, 2, 3, 2, 2, 3, 4]
    seen = mask[0, 0]
    assert seen[6].tolist() == [True, True, False, False, False, True, True, False]  # prompt, its own suffix
    assert seen[4].tolist() == [True, True, False, False, True, False, False, False]
    assert mask[1, 0, 5].tolist() == [False] * 5 + [True, False, False]  # padding sees only itself


def test_shared_rows_see_their_prompt_and_own_response_only_and_score_as_padded(tiny_model_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    batch = grpo_batch()
    lengths = batch.attention_mask.sum(-1).tolist()
    layouts = group_layouts(batch.input_ids, lengths, batch.group_ids)
    assert layouts[0].prefix == 10 + 2  # the prompt and the two tokens every response of group 0 begins with
    every = batch.attention_mask[:, 1:].bool()
    with torch.no_grad():
        padded = logprobs_from_logits(model(input_ids=batch.input_ids).logits[:, :-1], batch.input_ids[:, 1:])
        shared, _ = shared_prefix_logprobs(
            model, layouts, batch.input_ids, every, 1.0, torch.float32, device=torch.device("cpu"), token_budget=64
        )
        row = layouts[1].rows[0]  # another response of its group changed: this row's logprobs do not move a bit
        changed = batch.input_ids.clone()
        other = layouts[1].rows[1]
        changed[other, layouts[1].prefix : lengths[other]] = (
            3 + (changed[other, layouts[1].prefix : lengths[other]] + 1) % 17
        )
        again, _ = shared_prefix_logprobs(
            model, layouts, changed, every, 1.0, torch.float32, device=torch.device("cpu"), token_budget=64
        )
    assert float(((shared - padded) * every).abs().max()) < TOLERANCE
    assert torch.equal(shared[row], again[row])
    assert float((shared[other] - again[other]).abs().max()) > 0.01
    assert float(shared[~every].abs().max()) == 0.0  # nothing past a row's end


def one_step(model_dir: str, shared_prefix: str, budget: int) -> tuple[GradsBackend, dict, dict]:
    tcfg = TrainerConfig(
        lr=1e-3, mini_batches=2, padding_free="off", shared_prefix=shared_prefix, pack_token_budget=budget,
        precision="float32",
    )  # fmt: skip
    return trained_once(model_dir, tcfg, grpo_batch(), ALG, norm_len=22)


def same_update(model_dir: str, budget: int) -> dict:
    """Shared against padded, one step each: the largest gradient and weight gaps, and how far weights moved."""
    padded, shared = one_step(model_dir, "off", budget), one_step(model_dir, "on", budget)
    return update_gaps(padded, shared) | {"prefix_shared": [padded[1]["prefix_shared"], shared[1]["prefix_shared"]]}


def check(result: dict) -> None:
    assert result["grads"] < TOLERANCE and result["weights"] < TOLERANCE < result["moved"] / 50, result
    assert result["loss"] < 1e-6, result
    assert result["prefix_shared"][0] == 0.0 and result["prefix_shared"][1] > 0.2, result


def test_a_shared_prefix_step_is_the_padded_update(tiny_model_dir) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        check(same_update(str(tiny_model_dir), budget=1024))
    finally:
        dist.destroy_process_group()


def test_two_ranks_agree_on_their_shared_forwards(tiny_model_dir, tmp_path) -> None:
    """Budget 40: each rank holds a contiguous run of a mini-batch's rows (the second mini-batch's 5 rows cut one
    group), so the ranks' layouts differ in number and length and cut into different numbers of forwards; FSDP's
    gathers stay matched (no hang) and the update is still the padded one."""
    out = tmp_path / "result.json"
    spawn_ranks(on_ranks_case, (2, free_port(), same_update, (str(tiny_model_dir), 40), str(out)), 2)
    check(json.loads(out.read_text()))


def test_auto_shares_where_it_saves_enough_and_every_layout_fits_the_budget() -> None:
    auto = SharedPrefix("auto", token_budget=100)
    assert auto.decide(row_tokens=400, layout_tokens=200, longest_layout=100)
    assert not auto.decide(row_tokens=400, layout_tokens=int(400 * (1 - AUTO_MIN_SAVED_SHARE)) + 1, longest_layout=50)
    assert not auto.decide(row_tokens=400, layout_tokens=100, longest_layout=101)  # the dense mask would not fit
    assert SharedPrefix("on", token_budget=100).decide(row_tokens=400, layout_tokens=399, longest_layout=500)
    assert not SharedPrefix("off", token_budget=100).decide(row_tokens=400, layout_tokens=1, longest_layout=1)


def test_megatron_refuses_shared_prefix_on_naming_the_key() -> None:
    raw = {"model": {"path": "m"}, "data": {"path": "d"}, "trainer": {"backend": "megatron", "shared_prefix": "on"}}
    with pytest.raises(ConfigError, match=r"trainer.*shared_prefix"):
        parse_config(raw)
    raw["trainer"]["shared_prefix"] = "auto"
    assert parse_config(raw).trainer.shared_prefix == "auto"


def test_an_attention_that_takes_no_mask_never_shares_and_says_why(tiny_model_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert mask_unsupported(model) is None  # sdpa
    model.config._attn_implementation = "flash_attention_2"
    reason = mask_unsupported(model)
    assert "flash_attention_2" in reason
    assert not SharedPrefix("on", 1024, available=False, reason=reason).decide(400, 100, 50)
