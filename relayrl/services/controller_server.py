"""gRPC face of the controller (``relayrl controller serve``)."""

from __future__ import annotations

import logging
import math
import queue
import threading
import uuid
from collections.abc import Callable

from transformers import AutoConfig

from relayrl.config import RelayConfig
from relayrl.controller.core import Controller
from relayrl.controller.dispatch import PromptJob
from relayrl.controller.scoring import CONFIG_REWARD, group_inputs
from relayrl.data.dataset import render_prompt
from relayrl.errors import PAUSED_DETAIL, InvalidArgument, Unavailable
from relayrl.ops.supervise import read_restarts
from relayrl.rewards import GroupInputs, RewardRaised, load_reward
from relayrl.rpc.channels import configure_client
from relayrl.rpc.server import GrpcServer, guarded
from relayrl.rpc.validate import (
    check_address,
    check_count,
    check_length,
    check_number,
    check_register_worker,
    check_report_step,
    check_submit_prompts,
)
from relayrl.services.metrics import ControllerCollector, MetricsEndpoint
from relayrl.v1 import controller_pb2, controller_pb2_grpc
from relayrl.wire.sampling import GenerationLimits, SamplingParams, validate_request

ClientReward = Callable[[GroupInputs], list[float]]  # a client's reward_fn: a group's rewards

log = logging.getLogger(__name__)
_DONE = object()


class ControllerServicer(controller_pb2_grpc.ControllerServiceServicer):
    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self.limits = controller.cfg.rollout.limits
        model = AutoConfig.from_pretrained(controller.cfg.model.path)  # SubmitPrompts: vocabulary and context
        self.vocab_size, self.max_model_len = model.vocab_size, model.max_position_embeddings

    @guarded
    def RegisterWorker(self, request, context):
        check_register_worker(request, self.limits)
        registry = self.controller.registry
        if registry.get(request.worker_id) is None:  # a heartbeat of a known worker is O(1), not O(workers)
            check_count("workers", len(registry) + 1, self.controller.cfg.controller.max_workers)
            self.controller.drained.discard(request.worker_id)  # a new process under a drained id serves again
        self.controller.registry.register(
            request.worker_id, request.address, request.engine or "hf", request.policy_version
        )
        return controller_pb2.RegisterWorkerResponse(
            current_policy_version=self.controller.progress.policy_version,
            heartbeat_interval_s=registry.heartbeat_interval_s(self.controller.cfg.controller.heartbeats_per_s),
        )

    @guarded
    def DeregisterWorker(self, request, context):
        check_length("worker_id", request.worker_id, self.limits.max_id_chars, required=True)
        self.controller.registry.remove(request.worker_id)
        return controller_pb2.DeregisterWorkerResponse()

    def _pull_timeout(self, request, context) -> float:
        if request.step < 1:
            raise InvalidArgument("step", f"must be >= 1, got {request.step}")
        check_number("timeout_s", request.timeout_s, high=self.controller.cfg.controller.max_pull_timeout_s)
        timeout = request.timeout_s if request.timeout_s > 0 else 60.0
        return min(timeout, context.time_remaining() or math.inf)  # nobody waits for an answer after that

    @guarded
    def PullBatch(self, request, context):
        return self.controller.pull_batch(request.step, self._pull_timeout(request, context))

    @guarded
    def StreamBatch(self, request, context):
        yield from self.controller.stream_batch(request.step, self._pull_timeout(request, context))

    @guarded
    def ReportStep(self, request, context):
        check_report_step(request, self.limits, self.controller.cfg.controller.max_workers)
        self.controller.report_step(request)
        return controller_pb2.ReportStepResponse()

    @guarded
    def Rewind(self, request, context):
        if request.step < 0:
            raise InvalidArgument("step", f"must be >= 0, got {request.step}")
        return controller_pb2.RewindResponse(prompts_rewound=self.controller.rewind(request))

    @guarded
    def GetWeightSyncPlan(self, request, context):
        return self.controller.sync_plan(request.version, min(20.0, (context.time_remaining() or 30.0) / 2))

    @guarded
    def GetEvals(self, request, context):
        evaluator = self.controller.evaluator
        if evaluator is None:
            return controller_pb2.GetEvalsResponse()
        return controller_pb2.GetEvalsResponse(results=evaluator.list(request.min_version), pending=evaluator.pending)

    @guarded
    def Status(self, request, context):
        status = self.controller.status()
        status.restarts.update(read_restarts(self.controller.cfg.run_dir))  # written by the supervisor, if any
        for name, client in self.controller.scorer.clients.items():
            for address, answer in client.describe_servers():
                if isinstance(answer, str):
                    status.scorers.add(name=name, address=address, error=answer)
                    continue
                status.scorers.add(
                    name=name, address=address, kind=answer.kind, items_scored=answer.items_scored,
                    mean_batch_size=answer.mean_batch_size, mean_latency_s=answer.mean_latency_s, queued=answer.queued,
                )  # fmt: skip
        return status

    @guarded
    def Pause(self, request, context):
        check_length("reason", request.reason, self.limits.max_text_chars)
        return self.controller.pause(request.reason)

    @guarded
    def Resume(self, request, context):
        return self.controller.resume()

    @guarded
    def DrainWorker(self, request, context):
        check_length("worker_id", request.worker_id, self.limits.max_id_chars, required=True)
        return self.controller.drain(request.worker_id)

    @guarded
    def SyncWeights(self, request, context):
        return self.controller.request_sync(request.force)

    @guarded
    def ScaleRollout(self, request, context):
        check_number("replicas", request.replicas, low=1, high=self.controller.cfg.controller.max_workers)
        return self.controller.scale(request.replicas)

    @guarded
    def ScaleScorer(self, request, context):
        check_length("name", request.name, self.limits.max_id_chars, required=True)
        check_number("replicas", request.replicas, low=1, high=self.controller.cfg.controller.max_workers)
        return self.controller.scale_scorer(request.name, request.replicas)

    @guarded
    def RegisterScorer(self, request, context):
        check_length("name", request.name, self.limits.max_id_chars, required=True)
        check_address("address", request.address, self.limits)
        return self.controller.register_scorer(request.name, request.address, request.leaving)

    @guarded
    def WeightsStatus(self, request, context):
        return self.controller.weights_status()

    @guarded
    def ReportWeightSync(self, request, context):
        check_count("synced_worker_ids", len(request.synced_worker_ids), self.controller.cfg.controller.max_workers)
        self.controller.report_weight_sync(request)
        return controller_pb2.ReportWeightSyncResponse()

    @guarded
    def SubmitPrompts(self, request, context):
        """Sample completions for client prompts; streams one message per sample as groups complete."""
        ctl = self.controller
        limits = self.limits
        check_submit_prompts(request.prompts, limits)
        params = SamplingParams.from_proto(request.params)
        reward_fn = self._client_reward(request.reward_fn) if request.reward_fn else None
        jobs, prompts = [], {}
        for prompt in request.prompts:
            if prompt.token_ids:
                ids = list(prompt.token_ids)
            else:
                data = ctl.cfg.data  # templated as the training prompts are, system turn included
                ids = render_prompt(
                    ctl.tokenizer, prompt.text, "never" if request.raw else data.chat_template, data.system_prompt
                )
            prompt_id = prompt.prompt_id or f"client-{uuid.uuid4().hex[:12]}"
            jobs.append(PromptJob(prompt_id, ids))
            prompts[prompt_id] = prompt
        validate_request(
            [job.token_ids for job in jobs],
            params,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            limits=GenerationLimits(limits.max_prompts, limits.max_n, limits.max_tokens),
        )
        if not ctl.registry.snapshot():
            raise Unavailable("no rollout worker is registered yet")
        if ctl.state == "paused":
            raise Unavailable(f"{PAUSED_DETAIL}; retry after Resume")
        current = ctl.progress.policy_version  # a worker that joined at version 0 serves once it has these weights
        out: queue.Queue = queue.Queue()

        def on_group(prompt_id, completions):
            texts = ctl.scorer.decode_all(completions)
            # no answer: no reward (unset), not a score of 0
            rewards = (
                self._client_rewards(reward_fn, prompts[prompt_id], texts)
                if reward_fn and prompts[prompt_id].answer
                else [None] * len(texts)
            )
            for completion, text, reward in zip(completions, texts, rewards):
                message = controller_pb2.SubmittedCompletion(completion=completion)
                if reward is not None:
                    message.reward = reward
                message.completion.text = text
                out.put(message)

        def run():
            try:
                result = ctl.dispatcher.run(
                    jobs, params, min_version=current, on_group=on_group, should_stop=lambda: not context.is_active()
                )
                for prompt_id, reason in result.failed.items():
                    log.warning("client prompt %s failed: %s", prompt_id, reason)
                out.put(result)
            except Exception as err:  # reported to the client below
                out.put(err)
            out.put(_DONE)

        threading.Thread(target=run, name="submit", daemon=True).start()
        while (item := out.get()) is not _DONE:
            if isinstance(item, Exception):
                raise item
            if isinstance(item, controller_pb2.SubmittedCompletion):
                yield item
            elif item.failed:
                raise Unavailable(f"{len(item.failed)} prompts failed: {next(iter(item.failed.values()))}")

    def _client_reward(self, name: str) -> ClientReward:
        """A client may name the config's reward (``config``) or one of its functions (``Scorer.named``), or a
        registered function: importing any other ``module:function`` on a client's word would run that module's
        import-time code in the controller."""
        check_length("reward_fn", name, self.limits.max_id_chars)
        if (own := self.controller.scorer.named(name)) is not None:
            return own
        if ":" in name:
            raise InvalidArgument(
                "reward_fn",
                f"clients may name registered functions, {CONFIG_REWARD!r} (the config's reward) or a module:function "
                "of controller.reward.fn or fns",
            )
        try:
            return load_reward(name)
        except (KeyError, ValueError) as err:
            raise InvalidArgument("reward_fn", str(err).strip("'\"")) from None

    def _client_rewards(self, reward_fn: ClientReward, prompt, texts: list[str]) -> list[float | None]:
        """A client group's rewards; its row is its prompt and answer under the dataset's column names. A function
        that raises leaves them unset (logged); a wrong shape ends the call with the function's error."""
        data = self.controller.cfg.data
        row = {data.prompt_key: prompt.text, data.answer_key: prompt.answer}
        try:
            return reward_fn(group_inputs(prompt.text, prompt.answer, row, texts, None))
        except RewardRaised as err:
            log.warning("client prompt %s: %s", prompt.prompt_id, err)
            return [None] * len(texts)


def serve_controller(
    cfg: RelayConfig, *, port: int | None = None, state_dir: str | None = None, metrics_port: int | None = None
) -> tuple:
    """Start the controller and its gRPC server (and /metrics when ``metrics_port``); returns (server, controller)."""
    controller = Controller(cfg, state_dir=state_dir)
    metrics = MetricsEndpoint(metrics_port)
    bind_port = cfg.controller.port if port is None else port
    configure_client(cfg.security)  # the controller calls its workers
    server = GrpcServer(
        f"{cfg.controller.host}:{bind_port}",
        max_workers=cfg.controller.rpc_threads,
        max_message_mib=cfg.rollout.limits.max_message_mib,
        interceptors=metrics.interceptors,
        security=cfg.security,
    )
    server.add(
        controller_pb2_grpc.add_ControllerServiceServicer_to_server,
        ControllerServicer(controller),
        controller_pb2.DESCRIPTOR.services_by_name["ControllerService"],
    )
    controller.start()
    server.start()
    metrics.start(ControllerCollector(controller))
    log.info("controller serving on %s:%d", cfg.controller.host, server.port)
    return server, controller
