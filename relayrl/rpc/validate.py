"""Field checks for the RPCs of ControllerService and RolloutService (sampling has its own validator).

Every check raises ``InvalidArgument`` naming the field (a wrong value) or ``ResourceExhausted`` naming the
field and the limit (a count or length over a configured limit), so a servicer can call them first and
trust its input afterwards.
"""

from __future__ import annotations

import math
import re
import typing
from collections.abc import Iterable, Sequence

from relayrl.config import GenerationLimitsConfig, RolloutConfig
from relayrl.errors import InvalidArgument, ResourceExhausted

ENGINES = typing.get_args(RolloutConfig.model_fields["engine"].annotation)
_HOST_PORT = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>[0-9]{1,5})")
_HOST = re.compile(r"[0-9A-Fa-f:.]+|[A-Za-z0-9._-]+")


def check_length(field: str, value: str, limit: int, *, required: bool = False) -> None:
    """``value`` has at most ``limit`` characters (and is not empty when ``required``)."""
    if required and not value:
        raise InvalidArgument(field, "must not be empty")
    if len(value) > limit:
        raise ResourceExhausted(f"{field} length", limit, len(value))


def check_count(field: str, count: int, limit: int) -> None:
    if count > limit:
        raise ResourceExhausted(field, limit, count)


def check_number(field: str, value: float, *, low: float = 0.0, high: float = math.inf) -> None:
    """A finite number in [low, high]."""
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidArgument(field, f"must be a finite number in [{low}, {high}], got {value}")


def check_address(field: str, value: str, limits: GenerationLimitsConfig) -> None:
    """``host:port`` with a DNS name, an IPv4 address or a bracketed IPv6 address, and a port in 1..65535."""
    check_length(field, value, limits.max_id_chars, required=True)
    match = _HOST_PORT.fullmatch(value)
    if match is None or not 1 <= int(match["port"]) <= 65535:
        raise InvalidArgument(field, f"{value!r} is not host:port with a port in 1..65535")


def check_host(field: str, value: str, limits: GenerationLimitsConfig) -> None:
    check_length(field, value, limits.max_id_chars, required=True)
    if not _HOST.fullmatch(value):
        raise InvalidArgument(field, f"{value!r} is not a host name or IP address")


def check_ids(field: str, ids: Iterable[str], limits: GenerationLimitsConfig) -> None:
    """Each id (``field[i]``) has at most ``max_id_chars`` characters."""
    for i, value in enumerate(ids):
        check_length(f"{field}[{i}]", value, limits.max_id_chars)


# -- ControllerService -------------------------------------------------------------------------------
def check_register_worker(request, limits: GenerationLimitsConfig) -> None:
    check_length("worker_id", request.worker_id, limits.max_id_chars, required=True)
    check_address("address", request.address, limits)
    if request.engine and request.engine not in ENGINES:
        raise InvalidArgument("engine", f"{request.engine[:64]!r} is not one of {', '.join(ENGINES)}")
    if request.policy_version < -1:
        raise InvalidArgument("policy_version", f"must be >= -1 (-1: torn), got {request.policy_version}")


def check_report_step(request, limits: GenerationLimitsConfig, max_workers: int) -> None:
    if request.step < 1:
        raise InvalidArgument("step", f"must be >= 1, got {request.step}")
    check_length("batch_id", request.batch_id, limits.max_id_chars, required=True)
    if request.policy_version < 0:
        raise InvalidArgument("policy_version", f"must be >= 0, got {request.policy_version}")
    check_number("sync_seconds", request.sync_seconds)
    check_number("step_seconds", request.step_seconds)
    check_count("synced_worker_ids", len(request.synced_worker_ids), max_workers)
    check_ids("synced_worker_ids", request.synced_worker_ids, limits)
    for key in request.metrics:
        check_length("metrics key", key, limits.max_id_chars)


def check_submit_prompts(prompts: Sequence, limits: GenerationLimitsConfig) -> None:
    """Count, ids (unique), text and answer lengths; token ids are checked with the sampling validator."""
    if not prompts:
        raise InvalidArgument("prompts", "must not be empty")
    check_count("prompts", len(prompts), limits.max_prompts)
    seen: set[str] = set()
    for i, prompt in enumerate(prompts):
        check_length(f"prompts[{i}].prompt_id", prompt.prompt_id, limits.max_id_chars)
        if prompt.prompt_id in seen:
            raise InvalidArgument(f"prompts[{i}].prompt_id", f"{prompt.prompt_id!r} appears twice")
        if prompt.prompt_id:
            seen.add(prompt.prompt_id)
        check_length(f"prompts[{i}].text", prompt.text, limits.max_text_chars)
        check_length(f"prompts[{i}].answer", prompt.answer, limits.max_text_chars)
        if not prompt.text and not prompt.token_ids:
            raise InvalidArgument(f"prompts[{i}]", "needs text or token_ids")


# -- RolloutService ----------------------------------------------------------------------------------
def check_init_weight_sync(request, limits: GenerationLimitsConfig, max_timeout_s: float) -> None:
    check_host("master_address", request.master_address, limits)
    if not 1 <= request.master_port <= 65535:
        raise InvalidArgument("master_port", f"must be in 1..65535, got {request.master_port}")
    if request.world_size < 2:
        raise InvalidArgument("world_size", f"must be >= 2 (the trainer and this worker), got {request.world_size}")
    if not 1 <= request.rank < request.world_size:
        raise InvalidArgument("rank", f"{request.rank} is not in [1, {request.world_size})")
    check_length("group_name", request.group_name, limits.max_id_chars, required=True)
    if request.backend not in ("", "gloo", "nccl"):
        raise InvalidArgument("backend", f"{request.backend[:64]!r} is not 'gloo' or 'nccl'")
    check_number("timeout_s", request.timeout_s, high=max_timeout_s)
