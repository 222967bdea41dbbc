from relayrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EvalResult(_message.Message):
    __slots__ = ("name", "policy_version", "metrics", "prompts", "prompts_failed", "seconds", "unix_time")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    name: str
    policy_version: int
    metrics: _containers.ScalarMap[str, float]
    prompts: int
    prompts_failed: int
    seconds: float
    unix_time: float
    def __init__(self, name: _Optional[str] = ..., policy_version: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., prompts: _Optional[int] = ..., prompts_failed: _Optional[int] = ..., seconds: _Optional[float] = ..., unix_time: _Optional[float] = ...) -> None: ...

class GetEvalsRequest(_message.Message):
    __slots__ = ("min_version",)
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    min_version: int
    def __init__(self, min_version: _Optional[int] = ...) -> None: ...

class GetEvalsResponse(_message.Message):
    __slots__ = ("results", "pending")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EvalResult]
    pending: int
    def __init__(self, results: _Optional[_Iterable[_Union[EvalResult, _Mapping]]] = ..., pending: _Optional[int] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "address", "engine", "policy_version")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    engine: str
    policy_version: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., engine: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("current_policy_version", "heartbeat_interval_s")
    CURRENT_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    current_policy_version: int
    heartbeat_interval_s: float
    def __init__(self, current_policy_version: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DeregisterWorkerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PullBatchRequest(_message.Message):
    __slots__ = ("step", "timeout_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    timeout_s: float
    def __init__(self, step: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("prompt_id", "group", "prompt_token_ids", "response_token_ids", "rollout_logprobs", "reward", "score", "finish_reason", "policy_version", "worker_id", "loss_mask", "token_versions", "routed_experts", "teacher_logprobs")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    group: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    response_token_ids: _containers.RepeatedScalarFieldContainer[int]
    rollout_logprobs: _containers.RepeatedScalarFieldContainer[float]
    reward: float
    score: float
    finish_reason: _common_pb2.FinishReason
    policy_version: int
    worker_id: str
    loss_mask: bytes
    token_versions: _containers.RepeatedScalarFieldContainer[int]
    routed_experts: _common_pb2.RoutedExperts
    teacher_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, prompt_id: _Optional[str] = ..., group: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., response_token_ids: _Optional[_Iterable[int]] = ..., rollout_logprobs: _Optional[_Iterable[float]] = ..., reward: _Optional[float] = ..., score: _Optional[float] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., policy_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., loss_mask: _Optional[bytes] = ..., token_versions: _Optional[_Iterable[int]] = ..., routed_experts: _Optional[_Union[_common_pb2.RoutedExperts, _Mapping]] = ..., teacher_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class BatchStats(_message.Message):
    __slots__ = ("groups_kept", "groups_filtered", "gen_batches", "rollout_version_min", "rollout_version_max", "generation_seconds", "reward_mean", "score_mean", "samples_generated", "response_len_mean", "groups_stale", "groups_failed", "cursor_start", "cursor_end", "episodes", "turns_mean", "turns_median", "env_seconds_mean", "tool_parse_errors", "episode_ends", "env_metrics", "observation_tokens_mean", "samples_aborted", "reward_means", "prompts_too_long", "prompts_truncated", "scorer_metrics")
    class EpisodeEndsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class EnvMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class RewardMeansEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ScorerMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    GROUPS_KEPT_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FILTERED_FIELD_NUMBER: _ClassVar[int]
    GEN_BATCHES_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_VERSION_MIN_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_VERSION_MAX_FIELD_NUMBER: _ClassVar[int]
    GENERATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    SCORE_MEAN_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_GENERATED_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_LEN_MEAN_FIELD_NUMBER: _ClassVar[int]
    GROUPS_STALE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FAILED_FIELD_NUMBER: _ClassVar[int]
    CURSOR_START_FIELD_NUMBER: _ClassVar[int]
    CURSOR_END_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    TURNS_MEAN_FIELD_NUMBER: _ClassVar[int]
    TURNS_MEDIAN_FIELD_NUMBER: _ClassVar[int]
    ENV_SECONDS_MEAN_FIELD_NUMBER: _ClassVar[int]
    TOOL_PARSE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ENDS_FIELD_NUMBER: _ClassVar[int]
    ENV_METRICS_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_TOKENS_MEAN_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_ABORTED_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEANS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_TOO_LONG_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    SCORER_METRICS_FIELD_NUMBER: _ClassVar[int]
    groups_kept: int
    groups_filtered: int
    gen_batches: int
    rollout_version_min: int
    rollout_version_max: int
    generation_seconds: float
    reward_mean: float
    score_mean: float
    samples_generated: int
    response_len_mean: float
    groups_stale: int
    groups_failed: int
    cursor_start: int
    cursor_end: int
    episodes: int
    turns_mean: float
    turns_median: float
    env_seconds_mean: float
    tool_parse_errors: int
    episode_ends: _containers.ScalarMap[str, int]
    env_metrics: _containers.ScalarMap[str, float]
    observation_tokens_mean: float
    samples_aborted: int
    reward_means: _containers.ScalarMap[str, float]
    prompts_too_long: int
    prompts_truncated: int
    scorer_metrics: _containers.ScalarMap[str, float]
    def __init__(self, groups_kept: _Optional[int] = ..., groups_filtered: _Optional[int] = ..., gen_batches: _Optional[int] = ..., rollout_version_min: _Optional[int] = ..., rollout_version_max: _Optional[int] = ..., generation_seconds: _Optional[float] = ..., reward_mean: _Optional[float] = ..., score_mean: _Optional[float] = ..., samples_generated: _Optional[int] = ..., response_len_mean: _Optional[float] = ..., groups_stale: _Optional[int] = ..., groups_failed: _Optional[int] = ..., cursor_start: _Optional[int] = ..., cursor_end: _Optional[int] = ..., episodes: _Optional[int] = ..., turns_mean: _Optional[float] = ..., turns_median: _Optional[float] = ..., env_seconds_mean: _Optional[float] = ..., tool_parse_errors: _Optional[int] = ..., episode_ends: _Optional[_Mapping[str, int]] = ..., env_metrics: _Optional[_Mapping[str, float]] = ..., observation_tokens_mean: _Optional[float] = ..., samples_aborted: _Optional[int] = ..., reward_means: _Optional[_Mapping[str, float]] = ..., prompts_too_long: _Optional[int] = ..., prompts_truncated: _Optional[int] = ..., scorer_metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("batch_id", "step", "samples", "stats", "temperature", "minibatch_groups", "prompts")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    MINIBATCH_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    step: int
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    stats: BatchStats
    temperature: float
    minibatch_groups: _containers.RepeatedScalarFieldContainer[int]
    prompts: _containers.RepeatedCompositeFieldContainer[PromptText]
    def __init__(self, batch_id: _Optional[str] = ..., step: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., stats: _Optional[_Union[BatchStats, _Mapping]] = ..., temperature: _Optional[float] = ..., minibatch_groups: _Optional[_Iterable[int]] = ..., prompts: _Optional[_Iterable[_Union[PromptText, _Mapping]]] = ...) -> None: ...

class PromptText(_message.Message):
    __slots__ = ("group", "text", "answer")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    group: int
    text: str
    answer: str
    def __init__(self, group: _Optional[int] = ..., text: _Optional[str] = ..., answer: _Optional[str] = ...) -> None: ...

class BatchPart(_message.Message):
    __slots__ = ("samples", "batch", "streamed", "temperature")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    batch: Batch
    streamed: bool
    temperature: float
    def __init__(self, samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., batch: _Optional[_Union[Batch, _Mapping]] = ..., streamed: _Optional[bool] = ..., temperature: _Optional[float] = ...) -> None: ...

class ReportStepRequest(_message.Message):
    __slots__ = ("step", "batch_id", "policy_version", "sync_seconds", "step_seconds", "metrics", "synced_worker_ids")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SYNC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    SYNCED_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    batch_id: str
    policy_version: int
    sync_seconds: float
    step_seconds: float
    metrics: _containers.ScalarMap[str, float]
    synced_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., batch_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., sync_seconds: _Optional[float] = ..., step_seconds: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., synced_worker_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReportStepResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RewindRequest(_message.Message):
    __slots__ = ("step", "cursor", "synced_worker_ids")
    STEP_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    SYNCED_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    cursor: int
    synced_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., cursor: _Optional[int] = ..., synced_worker_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RewindResponse(_message.Message):
    __slots__ = ("prompts_rewound",)
    PROMPTS_REWOUND_FIELD_NUMBER: _ClassVar[int]
    prompts_rewound: int
    def __init__(self, prompts_rewound: _Optional[int] = ...) -> None: ...

class GetWeightSyncPlanRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class WorkerEndpoint(_message.Message):
    __slots__ = ("worker_id", "address", "policy_version")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    policy_version: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class WeightSyncPlan(_message.Message):
    __slots__ = ("workers", "sync_request_id", "force")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SYNC_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerEndpoint]
    sync_request_id: int
    force: bool
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerEndpoint, _Mapping]]] = ..., sync_request_id: _Optional[int] = ..., force: _Optional[bool] = ...) -> None: ...

class SubmitPromptsRequest(_message.Message):
    __slots__ = ("prompts", "params", "reward_fn", "raw")
    class Prompt(_message.Message):
        __slots__ = ("prompt_id", "text", "token_ids", "answer")
        PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
        TEXT_FIELD_NUMBER: _ClassVar[int]
        TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        ANSWER_FIELD_NUMBER: _ClassVar[int]
        prompt_id: str
        text: str
        token_ids: _containers.RepeatedScalarFieldContainer[int]
        answer: str
        def __init__(self, prompt_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., answer: _Optional[str] = ...) -> None: ...
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FN_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[SubmitPromptsRequest.Prompt]
    params: _common_pb2.SamplingParams
    reward_fn: str
    raw: bool
    def __init__(self, prompts: _Optional[_Iterable[_Union[SubmitPromptsRequest.Prompt, _Mapping]]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., reward_fn: _Optional[str] = ..., raw: _Optional[bool] = ...) -> None: ...

class SubmittedCompletion(_message.Message):
    __slots__ = ("completion", "reward")
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    completion: _common_pb2.Completion
    reward: float
    def __init__(self, completion: _Optional[_Union[_common_pb2.Completion, _Mapping]] = ..., reward: _Optional[float] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "address", "engine", "state", "policy_version", "in_flight", "tokens_per_second")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    engine: str
    state: str
    policy_version: int
    in_flight: int
    tokens_per_second: float
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., engine: _Optional[str] = ..., state: _Optional[str] = ..., policy_version: _Optional[int] = ..., in_flight: _Optional[int] = ..., tokens_per_second: _Optional[float] = ...) -> None: ...

class LedgerCounts(_message.Message):
    __slots__ = ("dispatched", "trained", "filtered", "failed", "pending", "torn_tails", "failed_by_reason")
    class FailedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DISPATCHED_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    FILTERED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    TORN_TAILS_FIELD_NUMBER: _ClassVar[int]
    FAILED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    dispatched: int
    trained: int
    filtered: int
    failed: int
    pending: int
    torn_tails: int
    failed_by_reason: _containers.ScalarMap[str, int]
    def __init__(self, dispatched: _Optional[int] = ..., trained: _Optional[int] = ..., filtered: _Optional[int] = ..., failed: _Optional[int] = ..., pending: _Optional[int] = ..., torn_tails: _Optional[int] = ..., failed_by_reason: _Optional[_Mapping[str, int]] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("run_name", "state", "trainer_step", "policy_version", "workers", "ledger", "last_sync_seconds", "last_sync_unix", "error", "dataset_cursor", "desired_rollout_replicas", "restarts", "total_steps", "recent_reward", "samples_per_second", "eta_seconds", "recent_steps", "drained_workers", "evals", "scorers", "step_metrics", "desired_scorer_replicas")
    class RestartsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class StepMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class DesiredScorerReplicasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUN_NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    LAST_SYNC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_SYNC_UNIX_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DATASET_CURSOR_FIELD_NUMBER: _ClassVar[int]
    DESIRED_ROLLOUT_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    RECENT_REWARD_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ETA_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECENT_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAINED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    EVALS_FIELD_NUMBER: _ClassVar[int]
    SCORERS_FIELD_NUMBER: _ClassVar[int]
    STEP_METRICS_FIELD_NUMBER: _ClassVar[int]
    DESIRED_SCORER_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    run_name: str
    state: str
    trainer_step: int
    policy_version: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    ledger: LedgerCounts
    last_sync_seconds: float
    last_sync_unix: float
    error: str
    dataset_cursor: int
    desired_rollout_replicas: int
    restarts: _containers.ScalarMap[str, int]
    total_steps: int
    recent_reward: float
    samples_per_second: float
    eta_seconds: float
    recent_steps: int
    drained_workers: _containers.RepeatedScalarFieldContainer[str]
    evals: _containers.RepeatedCompositeFieldContainer[EvalResult]
    scorers: _containers.RepeatedCompositeFieldContainer[ScorerStatus]
    step_metrics: _containers.ScalarMap[str, float]
    desired_scorer_replicas: _containers.ScalarMap[str, int]
    def __init__(self, run_name: _Optional[str] = ..., state: _Optional[str] = ..., trainer_step: _Optional[int] = ..., policy_version: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., ledger: _Optional[_Union[LedgerCounts, _Mapping]] = ..., last_sync_seconds: _Optional[float] = ..., last_sync_unix: _Optional[float] = ..., error: _Optional[str] = ..., dataset_cursor: _Optional[int] = ..., desired_rollout_replicas: _Optional[int] = ..., restarts: _Optional[_Mapping[str, int]] = ..., total_steps: _Optional[int] = ..., recent_reward: _Optional[float] = ..., samples_per_second: _Optional[float] = ..., eta_seconds: _Optional[float] = ..., recent_steps: _Optional[int] = ..., drained_workers: _Optional[_Iterable[str]] = ..., evals: _Optional[_Iterable[_Union[EvalResult, _Mapping]]] = ..., scorers: _Optional[_Iterable[_Union[ScorerStatus, _Mapping]]] = ..., step_metrics: _Optional[_Mapping[str, float]] = ..., desired_scorer_replicas: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ScorerStatus(_message.Message):
    __slots__ = ("name", "address", "kind", "items_scored", "mean_batch_size", "mean_latency_s", "queued", "error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ITEMS_SCORED_FIELD_NUMBER: _ClassVar[int]
    MEAN_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEAN_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    kind: str
    items_scored: int
    mean_batch_size: float
    mean_latency_s: float
    queued: int
    error: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., kind: _Optional[str] = ..., items_scored: _Optional[int] = ..., mean_batch_size: _Optional[float] = ..., mean_latency_s: _Optional[float] = ..., queued: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class PauseRunRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class PauseRunResponse(_message.Message):
    __slots__ = ("state", "workers", "worker_errors")
    class WorkerErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ERRORS_FIELD_NUMBER: _ClassVar[int]
    state: str
    workers: _containers.RepeatedScalarFieldContainer[str]
    worker_errors: _containers.ScalarMap[str, str]
    def __init__(self, state: _Optional[str] = ..., workers: _Optional[_Iterable[str]] = ..., worker_errors: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ResumeRunRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeRunResponse(_message.Message):
    __slots__ = ("state", "workers", "worker_errors")
    class WorkerErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ERRORS_FIELD_NUMBER: _ClassVar[int]
    state: str
    workers: _containers.RepeatedScalarFieldContainer[str]
    worker_errors: _containers.ScalarMap[str, str]
    def __init__(self, state: _Optional[str] = ..., workers: _Optional[_Iterable[str]] = ..., worker_errors: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DrainWorkerResponse(_message.Message):
    __slots__ = ("worker_id", "state", "in_flight")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    state: str
    in_flight: int
    def __init__(self, worker_id: _Optional[str] = ..., state: _Optional[str] = ..., in_flight: _Optional[int] = ...) -> None: ...

class SyncWeightsRequest(_message.Message):
    __slots__ = ("force",)
    FORCE_FIELD_NUMBER: _ClassVar[int]
    force: bool
    def __init__(self, force: _Optional[bool] = ...) -> None: ...

class SyncWeightsResponse(_message.Message):
    __slots__ = ("sync_request_id", "policy_version")
    SYNC_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    sync_request_id: int
    policy_version: int
    def __init__(self, sync_request_id: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class ScaleRolloutRequest(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: int
    def __init__(self, replicas: _Optional[int] = ...) -> None: ...

class ScaleScorerRequest(_message.Message):
    __slots__ = ("name", "replicas")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    name: str
    replicas: int
    def __init__(self, name: _Optional[str] = ..., replicas: _Optional[int] = ...) -> None: ...

class ScaleScorerResponse(_message.Message):
    __slots__ = ("previous", "replicas", "servers")
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    previous: int
    replicas: int
    servers: int
    def __init__(self, previous: _Optional[int] = ..., replicas: _Optional[int] = ..., servers: _Optional[int] = ...) -> None: ...

class RegisterScorerRequest(_message.Message):
    __slots__ = ("name", "address", "leaving")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    leaving: bool
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., leaving: _Optional[bool] = ...) -> None: ...

class RegisterScorerResponse(_message.Message):
    __slots__ = ("servers",)
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    servers: int
    def __init__(self, servers: _Optional[int] = ...) -> None: ...

class ScaleRolloutResponse(_message.Message):
    __slots__ = ("previous", "replicas", "registered")
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    previous: int
    replicas: int
    registered: int
    def __init__(self, previous: _Optional[int] = ..., replicas: _Optional[int] = ..., registered: _Optional[int] = ...) -> None: ...

class WeightsStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerWeights(_message.Message):
    __slots__ = ("worker_id", "address", "state", "policy_version", "last_update_seconds", "weight_sync_group", "generated_tokens", "tokens_per_second", "error")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_UPDATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNC_GROUP_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    state: str
    policy_version: int
    last_update_seconds: float
    weight_sync_group: str
    generated_tokens: int
    tokens_per_second: float
    error: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., policy_version: _Optional[int] = ..., last_update_seconds: _Optional[float] = ..., weight_sync_group: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class WeightSyncRecord(_message.Message):
    __slots__ = ("policy_version", "reason", "seconds", "unix_time", "synced_worker_ids", "failed", "sync_request_id")
    class FailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    SYNCED_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    SYNC_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    reason: str
    seconds: float
    unix_time: float
    synced_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    failed: _containers.ScalarMap[str, str]
    sync_request_id: int
    def __init__(self, policy_version: _Optional[int] = ..., reason: _Optional[str] = ..., seconds: _Optional[float] = ..., unix_time: _Optional[float] = ..., synced_worker_ids: _Optional[_Iterable[str]] = ..., failed: _Optional[_Mapping[str, str]] = ..., sync_request_id: _Optional[int] = ...) -> None: ...

class WeightsStatusResponse(_message.Message):
    __slots__ = ("policy_version", "workers", "recent_syncs", "sync_request_pending", "sync_request_handled")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    RECENT_SYNCS_FIELD_NUMBER: _ClassVar[int]
    SYNC_REQUEST_PENDING_FIELD_NUMBER: _ClassVar[int]
    SYNC_REQUEST_HANDLED_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerWeights]
    recent_syncs: _containers.RepeatedCompositeFieldContainer[WeightSyncRecord]
    sync_request_pending: int
    sync_request_handled: int
    def __init__(self, policy_version: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerWeights, _Mapping]]] = ..., recent_syncs: _Optional[_Iterable[_Union[WeightSyncRecord, _Mapping]]] = ..., sync_request_pending: _Optional[int] = ..., sync_request_handled: _Optional[int] = ...) -> None: ...

class ReportWeightSyncRequest(_message.Message):
    __slots__ = ("policy_version", "seconds", "synced_worker_ids", "failed", "sync_request_id", "reason")
    class FailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SYNCED_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    SYNC_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    seconds: float
    synced_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    failed: _containers.ScalarMap[str, str]
    sync_request_id: int
    reason: str
    def __init__(self, policy_version: _Optional[int] = ..., seconds: _Optional[float] = ..., synced_worker_ids: _Optional[_Iterable[str]] = ..., failed: _Optional[_Mapping[str, str]] = ..., sync_request_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ReportWeightSyncResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
