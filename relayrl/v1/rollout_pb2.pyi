from relayrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PromptInput(_message.Message):
    __slots__ = ("prompt_id", "token_ids")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "params", "min_policy_version", "renews_registration", "whole_groups")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RENEWS_REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    WHOLE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[PromptInput]
    params: _common_pb2.SamplingParams
    min_policy_version: int
    renews_registration: bool
    whole_groups: bool
    def __init__(self, prompts: _Optional[_Iterable[_Union[PromptInput, _Mapping]]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., min_policy_version: _Optional[int] = ..., renews_registration: _Optional[bool] = ..., whole_groups: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("completions",)
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[_common_pb2.Completion]
    def __init__(self, completions: _Optional[_Iterable[_Union[_common_pb2.Completion, _Mapping]]] = ...) -> None: ...

class InitWeightSyncRequest(_message.Message):
    __slots__ = ("master_address", "master_port", "rank", "world_size", "group_name", "backend", "timeout_s")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    rank: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., group_name: _Optional[str] = ..., backend: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class InitWeightSyncResponse(_message.Message):
    __slots__ = ("group_name",)
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    group_name: str
    def __init__(self, group_name: _Optional[str] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("manifest", "group_name")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.WeightManifest
    group_name: str
    def __init__(self, manifest: _Optional[_Union[_common_pb2.WeightManifest, _Mapping]] = ..., group_name: _Optional[str] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("policy_version", "checksum", "load_seconds", "peak_extra_bytes")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEAK_EXTRA_BYTES_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    checksum: str
    load_seconds: float
    peak_extra_bytes: int
    def __init__(self, policy_version: _Optional[int] = ..., checksum: _Optional[str] = ..., load_seconds: _Optional[float] = ..., peak_extra_bytes: _Optional[int] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("with_checksum",)
    WITH_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    with_checksum: bool
    def __init__(self, with_checksum: _Optional[bool] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("worker_id", "engine", "state", "policy_version", "active_requests", "generated_tokens", "tokens_per_second", "weights_checksum", "weight_sync_group", "last_update_seconds", "loaded")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNC_GROUP_FIELD_NUMBER: _ClassVar[int]
    LAST_UPDATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    engine: str
    state: str
    policy_version: int
    active_requests: int
    generated_tokens: int
    tokens_per_second: float
    weights_checksum: str
    weight_sync_group: str
    last_update_seconds: float
    loaded: _containers.RepeatedCompositeFieldContainer[LoadedVersion]
    def __init__(self, worker_id: _Optional[str] = ..., engine: _Optional[str] = ..., state: _Optional[str] = ..., policy_version: _Optional[int] = ..., active_requests: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., weights_checksum: _Optional[str] = ..., weight_sync_group: _Optional[str] = ..., last_update_seconds: _Optional[float] = ..., loaded: _Optional[_Iterable[_Union[LoadedVersion, _Mapping]]] = ...) -> None: ...

class LoadedVersion(_message.Message):
    __slots__ = ("policy_version", "checksum", "load_seconds")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    checksum: str
    load_seconds: float
    def __init__(self, policy_version: _Optional[int] = ..., checksum: _Optional[str] = ..., load_seconds: _Optional[float] = ...) -> None: ...
