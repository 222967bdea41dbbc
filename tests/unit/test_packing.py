"""Padding-free training: packed rows see only themselves, and a step on a long-tail batch is the padded step's
update (gradients and weights within 1e-5), in a world of one rank and of two (where the ranks' packed forwards
differ in number and are agreed)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from trainer_testing import GradsBackend, on_ranks_case, spawn_ranks, trained_once, update_gaps
from transformers import AutoModelForCausalLM

from relayrl.algorithms.logprobs import logprobs_from_logits
from relayrl.config import AlgorithmConfig, ConfigError, TrainerConfig, parse_config
from relayrl.runtime.ports import free_port
from relayrl.trainer.batch import to_train_batch
from relayrl.trainer.packing import FORWARD_COST, computed_positions, micro_batches, packed_logprobs
from relayrl.v1 import common_pb2, controller_pb2

TOLERANCE = 1e-5
ALG = AlgorithmConfig(old_logprobs="recompute")


def long_tail_batch(groups: int = 4, n: int = 4, seed: int = 0):
    """Rows of a 3-token prompt and a response of geometric length (mean ~8, cap 40): mostly short, a few long."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(groups * n):
        length = 1
        while length < 40 and float(torch.rand(1, generator=g)) > 1 / 8:
            length += 1
        if i == 0:
            length = 40  # the tail: the batch's longest row sets the padded width
        samples.append(
            controller_pb2.Sample(
                prompt_id=f"p{i // n}", group=i // n,
                prompt_token_ids=torch.randint(3, 20, (3,), generator=g).tolist(),
                response_token_ids=torch.randint(3, 20, (length,), generator=g).tolist(),
                rollout_logprobs=[-1.0] * length, reward=float(torch.rand(1, generator=g)),
                finish_reason=common_pb2.FINISH_REASON_STOP,
            )
        )  # fmt: skip
    return to_train_batch(samples, pad_token_id=0)


def test_micro_batches_hold_every_row_once_longest_first_within_the_budget() -> None:
    assert micro_batches([3, 4, 2, 9, 1], token_budget=8) == [[3], [1, 0], [2, 4]]  # 2 x 4, 1 x 9, 2 x 2
    lengths = [3, 4, 2, 9, 1]
    assert computed_positions(micro_batches(lengths, token_budget=8), lengths) == 9 + 2 * 4 + 2 * 2
    assert micro_batches([5, 5], token_budget=100) == [[0, 1]]
    assert micro_batches([], token_budget=100) == []
    long = 10 * FORWARD_COST
    # the short rows padded to the long one would cost more positions than a forward: split
    assert micro_batches([1, long, 1], token_budget=100 * long) == [[1], [0, 2]]
    # one padded position costs less than a forward: together
    assert micro_batches([long - 1, long], token_budget=100 * long) == [[1, 0]]
    with pytest.raises(ValueError, match="token_budget"):
        micro_batches([1], token_budget=0)


def test_packed_rows_see_only_themselves_and_score_as_padded(tiny_model_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    batch = long_tail_batch()
    mask = batch.response_mask
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits[:, :-1]
        padded = logprobs_from_logits(logits, batch.input_ids[:, 1:])
        every = batch.attention_mask[:, 1:].bool()  # every valid position scored
        packed, _ = packed_logprobs(
            model, batch.input_ids, batch.attention_mask, every, 1.0, torch.float32, device=torch.device("cpu"),
            token_budget=64,
        )  # fmt: skip
        batches = micro_batches(batch.attention_mask.sum(-1).tolist(), 64)
        row = next(b for b in batches if len(b) > 1)[-1]  # the shortest row of a micro-batch of several
        others = torch.arange(len(batch)) != row
        changed = batch.input_ids.clone()
        changed[others] = torch.where(
            batch.attention_mask[others].bool(), 3 + (changed[others] + 1) % 17, changed[others]
        )
        other, _ = packed_logprobs(model, changed, batch.attention_mask, every, 1.0, torch.float32,
                                   device=torch.device("cpu"), token_budget=64)  # fmt: skip
    assert len(batches) > 1
    assert float(((packed - padded) * mask).abs().max()) < TOLERANCE
    assert torch.equal(packed[row], other[row])  # forwarded with rows whose tokens all changed: not a bit moved
    assert float((packed - other)[others].abs().max()) > 0.01
    assert float(packed[batch.attention_mask[:, 1:] == 0].abs().max()) == 0.0  # nothing past a row's end


def one_step(model_dir: str, padding_free: str, budget: int = 1024) -> tuple[GradsBackend, dict, dict]:
    tcfg = TrainerConfig(
        lr=1e-3, mini_batches=2, padding_free=padding_free, pack_token_budget=budget, precision="float32"
    )  # packed and padded agree to float rounding
    return trained_once(model_dir, tcfg, long_tail_batch(), ALG, norm_len=40)


def same_update(model_dir: str, budget: int) -> dict:
    """Packed against padded, one step each: the largest gradient and weight gaps, and how far weights moved."""
    padded, packed = one_step(model_dir, "off"), one_step(model_dir, "on", budget)
    return update_gaps(padded, packed) | {
        "padding": [padded[1]["padding_share"], packed[1]["padding_share"]],
        "packed": [padded[1]["padding_free"], packed[1]["padding_free"]],
    }


def check(result: dict) -> None:
    assert result["grads"] < TOLERANCE and result["weights"] < TOLERANCE < result["moved"] / 50, result
    assert result["loss"] < 1e-6, result
    # long tail: mostly padding; sorted into buckets, only what the cut kept because a forward costs more
    assert result["padding"][0] > 0.5 and result["padding"][1] < result["padding"][0] - 0.2, result
    assert result["packed"] == [0.0, 1.0], result


def test_a_packed_step_is_the_padded_update(tiny_model_dir) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        check(same_update(str(tiny_model_dir), budget=1024))
    finally:
        dist.destroy_process_group()


def test_two_ranks_agree_on_their_packed_forwards(tiny_model_dir, tmp_path) -> None:
    """Budget 48: the ranks cut a mini-batch's rows into different numbers of micro-batches (rank 1's 24-token row
    goes alone, rank 0's rows of that mini-batch fit in one); FSDP's gathers stay matched (no hang) and the update
    is still the padded one."""
    out = tmp_path / "result.json"
    spawn_ranks(on_ranks_case, (2, free_port(), same_update, (str(tiny_model_dir), 48), str(out)), 2)
    check(json.loads(out.read_text()))


def test_megatron_refuses_padding_free_on_naming_the_key() -> None:
    raw = {"model": {"path": "m"}, "data": {"path": "d"}, "trainer": {"backend": "megatron", "padding_free": "on"}}
    with pytest.raises(ConfigError, match=r"trainer.*padding_free.*Transformer Engine"):
        parse_config(raw)
    raw["trainer"]["padding_free"] = "auto"
    assert parse_config(raw).trainer.padding_free == "auto"
