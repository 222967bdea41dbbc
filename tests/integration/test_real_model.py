"""A real pretrained model, end to end: ``builtin:smollm2-135m-instruct`` (SmolLM2-135M-Instruct: Llama, 30 layers,
tied embeddings, a 49,152-token vocabulary, ChatML, EOS id 2) built from the smollm2 extra's GGUF file loads as a
plain Hugging Face directory, and a 2-step ``relayrl up`` trains it on the addition example's prompts with the hf
engine's fast decode runner, whose logprobs are the trainer's (``logprob_mismatch``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from relayrl.config import load_config
from relayrl.models.assets import prepare_assets
from relayrl.trainer.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "addition-smollm2.yaml"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """The built model, in the machine's asset cache: built by the first test run here, reused by every later one."""
    cfg = load_config(EXAMPLE)
    prepare_assets(cfg)
    return Path(cfg.model.path)


def test_the_builtin_is_a_plain_llama_chat_directory(model_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from relayrl.rollout.hf import eos_token_ids
    from relayrl.rollout.llama_decode import unsupported_reason

    config = AutoConfig.from_pretrained(model_dir)
    assert (config.model_type, config.architectures, config.tie_word_embeddings) == (
        "llama", ["LlamaForCausalLM"], True,
    )  # fmt: skip
    assert (config.vocab_size, config.num_hidden_layers, config.dtype) == (49152, 30, torch.float32)
    assert not hasattr(config, "quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tokenize=False,
                                           add_generation_prompt=True)  # fmt: skip
    assert prompt.endswith("<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2

    from transformers import AutoModelForCausalLM, GenerationConfig

    assert eos_token_ids(tokenizer, GenerationConfig.from_pretrained(model_dir)) == frozenset({2})
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert unsupported_reason(model) is None  # the hf engine's fast decode runner serves it
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    # the weights are the model's, q and k in the Hugging Face rotary layout: an answer's mean NLL was 1.97 with
    # them and 4.54 with q and k left as the GGUF stores them
    turns = [{"role": "user", "content": "What is the capital of France?"}]
    answer = "The capital of France is Paris. It is known for the Eiffel Tower, the Louvre museum and its cafes along "
    answer += "the river Seine."
    prompt_ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, return_dict=True)["input_ids"]
    turns.append({"role": "assistant", "content": answer})
    ids = torch.tensor([tokenizer.apply_chat_template(turns, return_dict=True)["input_ids"]])
    labels = ids.clone()
    labels[:, : len(prompt_ids)] = -100
    with torch.no_grad():
        assert model(ids, labels=labels).loss.item() < 3.0


def test_two_steps_train_it_on_the_fast_decode_path_with_shared_prompts_and_the_trainers_logprobs(
    tmp_path: Path, model_dir
) -> None:
    overrides = {
        "run.dir": str(tmp_path / "runs"),
        "trainer.steps": 2,
        "trainer.checkpoint_every": 0,
        "rollout.n": 2,
        "rollout.max_tokens": 6,
        "rollout.hf_decode": "fast",  # refused at start if the runner could not serve the model
        "controller.prompts_per_gen_batch": 2,
        "controller.train_batch_groups": 2,
        "controller.dynamic_sampling": False,
        "trainer.mini_batches": 1,
        "trainer.precision": "float32",  # and so the engine's weights: exact up to float rounding (bf16: the bench)
        "trainer.skip_zero_advantage": False,  # every row trained, so the shared prompts show whatever the rewards
        "eval": None,
    }
    argv = [sys.executable, "-m", "relayrl.cli", "up", str(EXAMPLE)]
    for key, value in overrides.items():
        argv += ["--set", f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...')}"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    run_dir = tmp_path / "runs" / "add-smollm2"
    logs = "".join(p.read_text()[-2000:] for p in (run_dir / "logs").glob("*.log")) if run_dir.exists() else ""
    assert done.returncode == 0, done.stderr[-3000:] + logs
    assert "building builtin:smollm2" not in done.stdout + done.stderr  # the module's fixture built it

    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["samples_trained"] == 4 and r["response_len_mean"] > 0
        assert 0 < r["logprob_mismatch"] < 1e-3, r  # float rounding of a 30-layer model, not another policy
        assert r["prefix_shared"] > 0.3, r  # each group's 38-token prompt forwarded once (trainer.shared_prefix auto)
    assert "decoding with the fast Llama-family runner" in (run_dir / "logs" / "rollout-0.log").read_text()
