"""The long-tail model of ``relayrl bench e2e --workloads long-tail`` and ``relayrl bench padding``: near-uniform next
tokens over ``mean_length`` tokens, so response lengths are geometric with that mean; and the padding bench on it."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relayrl.bench import padding
from relayrl.models.tiny import write_long_tail_model
from relayrl.runtime.precision import compute_dtype
from relayrl.trainer.precision import FLOAT32_SDPA


def test_eos_is_about_one_token_in_mean_length_whatever_the_context(tmp_path) -> None:
    path = write_long_tail_model(tmp_path / "m", mean_length=48, hidden_size=32, layers=2)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == 48 and model.config.max_position_embeddings >= 256 + 16
    ids = torch.randint(3, 48, (4, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=ids).logits, -1)
    eos = probs[..., tokenizer.eos_token_id]
    assert float((eos - 1 / 48).abs().max()) < 0.1 / 48  # within 10 % of 1/48 at every position of every row


def test_the_padding_bench_trains_the_same_update_both_ways(tmp_path, capsys) -> None:
    argv = ["--groups", "2", "--n", "4", "--max-tokens", "40", "--mean-length", "8", "--hidden", "32", "--layers", "2",
            "--rounds", "1", "--mini-batches", "1", "--workdir", str(tmp_path)]  # fmt: skip
    assert padding.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    batch = result["batch"]
    assert batch["rows"] == 8 and batch["padding_share"] > 0.3
    computed = batch["positions_computed"]  # padded: every position; length buckets: at most that, at least the tokens
    assert computed["padded"] == batch["padded_positions"] >= computed["padding_free"] >= batch["real_tokens"]
    assert result["update"]["weights_max_diff"] < 1e-5 < result["update"]["moved_max"]
    assert result["speedup"] > 0 and len(result["speedup_by_round"]) == 1 and result["cpu_speedup"] > 0
    machine = result["machine"]  # the fairness record (relayrl/bench/record.py)
    assert machine["cpu_model"] and "fpu" in machine["cpu_flags"].split() and machine["cpus_usable"] >= 1
    assert len(machine["git"]["commit"]) == 40 and isinstance(machine["git"]["dirty"], bool)
    compute, _ = compute_dtype("auto", "cpu")  # trainer.precision's default on this CPU: bf16 where it is native
    side = {"precision": str(compute).removeprefix("torch."), "attn_implementation": "sdpa"}
    if compute == torch.bfloat16:
        side["attn_implementation"] = FLOAT32_SDPA  # bf16 compute, float32 attention (trainer/precision.py)
    assert machine["resolved"] == {"padded": side, "padding_free": side}
