"""gRPC face of the controller (``relayrl controller serve``)."""

from __future__ import annotations

import logging
import queue
import threading
import uuid

from relayrl.config import RelayConfig
from relayrl.controller.core import Controller
from relayrl.controller.dispatch import PromptJob
from relayrl.data.dataset import render_prompt
from relayrl.errors import InvalidArgument, ResourceExhausted, Unavailable
from relayrl.rewards import resolve_reward
from relayrl.rollout.sampling import SamplingParams
from relayrl.services.server import GrpcServer, guarded
from relayrl.v1 import controller_pb2, controller_pb2_grpc

log = logging.getLogger(__name__)
_DONE = object()


class ControllerServicer(controller_pb2_grpc.ControllerServiceServicer):
    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    @guarded
    def RegisterWorker(self, request, context):
        for field in ("worker_id", "address"):
            if not getattr(request, field):
                raise InvalidArgument(field, "must not be empty")
        self.controller.registry.register(
            request.worker_id, request.address, request.engine or "hf", request.policy_version
        )
        return controller_pb2.RegisterWorkerResponse(current_policy_version=self.controller.progress.policy_version)

    @guarded
    def DeregisterWorker(self, request, context):
        self.controller.registry.remove(request.worker_id)
        return controller_pb2.DeregisterWorkerResponse()

    @guarded
    def PullBatch(self, request, context):
        if request.step < 1:
            raise InvalidArgument("step", f"must be >= 1, got {request.step}")
        timeout = request.timeout_s if request.timeout_s > 0 else 60.0
        return self.controller.pull_batch(request.step, timeout)

    @guarded
    def ReportStep(self, request, context):
        if request.step < 1:
            raise InvalidArgument("step", f"must be >= 1, got {request.step}")
        self.controller.report_step(request)
        return controller_pb2.ReportStepResponse()

    @guarded
    def GetWeightSyncPlan(self, request, context):
        return self.controller.sync_plan()

    @guarded
    def Status(self, request, context):
        return self.controller.status()

    @guarded
    def SubmitPrompts(self, request, context):
        """Sample completions for client prompts; streams one message per sample as groups complete."""
        ctl = self.controller
        limits = ctl.cfg.rollout.limits
        if not request.prompts:
            raise InvalidArgument("prompts", "must not be empty")
        if len(request.prompts) > limits.max_prompts:
            raise ResourceExhausted("prompts", limits.max_prompts, len(request.prompts))
        params = SamplingParams.from_proto(request.params)
        reward_fn = None
        if request.reward_fn:
            try:
                reward_fn = resolve_reward(request.reward_fn)
            except (KeyError, ValueError) as err:
                raise InvalidArgument("reward_fn", str(err).strip("'\"")) from None
        jobs, answers = [], {}
        for i, prompt in enumerate(request.prompts):
            if prompt.token_ids:
                ids = list(prompt.token_ids)
            elif prompt.text:
                ids = render_prompt(ctl.tokenizer, prompt.text, "never" if request.raw else ctl.cfg.data.chat_template)
            else:
                raise InvalidArgument(f"prompts[{i}]", "needs text or token_ids")
            prompt_id = prompt.prompt_id or f"client-{uuid.uuid4().hex[:12]}"
            jobs.append(PromptJob(prompt_id, ids))
            answers[prompt_id] = prompt.answer
        if not ctl.registry.snapshot():
            raise Unavailable("no rollout worker is registered yet")
        out: queue.Queue = queue.Queue()

        def on_group(prompt_id, completions):
            for completion in completions:
                message = controller_pb2.SubmittedCompletion(completion=completion)
                if reward_fn is not None:
                    message.reward = ctl.scorer.score(ctl.scorer.decode(completion), answers[prompt_id])
                message.completion.text = ctl.scorer.decode(completion)
                out.put(message)

        def run():
            try:
                result = ctl.dispatcher.run(
                    jobs, params, on_group=on_group, should_stop=lambda: not context.is_active()
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


def serve_controller(cfg: RelayConfig, *, port: int | None = None, state_dir: str | None = None) -> tuple:
    """Start the controller and its gRPC server; returns (server, controller)."""
    controller = Controller(cfg, state_dir=state_dir)
    bind_port = cfg.controller.port if port is None else port
    server = GrpcServer(f"{cfg.controller.host}:{bind_port}", max_message_mib=cfg.rollout.limits.max_message_mib)
    server.add(
        controller_pb2_grpc.add_ControllerServiceServicer_to_server,
        ControllerServicer(controller),
        controller_pb2.DESCRIPTOR.services_by_name["ControllerService"],
    )
    controller.start()
    server.start()
    log.info("controller serving on %s:%d", cfg.controller.host, server.port)
    return server, controller
