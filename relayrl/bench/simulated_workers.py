"""Simulated rollout workers for ``relayrl bench controller``: no engine, no model, instant canned answers.

One process serves many simulated worker ids (``sim-<process>-w<index>``), each its own ``RolloutService``
endpoint (a ``grpc.aio`` server on its own loopback port, so the controller holds one channel and one
connection per worker as it would in a real fleet), all on one event loop. What the controller can observe
mirrors the real worker (``relayrl/rollout/worker.py`` behind ``relayrl/services/rollout_server.py``):

- ``Generate`` refuses ``FAILED_PRECONDITION`` when ``min_policy_version`` is newer than the worker's version,
  else streams one ``GenerateResponse`` holding a ``Completion`` per sample (all finish at once), each stamped
  with the worker's version and id;
- every worker heartbeats ``RegisterWorker`` with its version every ``--heartbeat-s``, then as often as the
  controller's answer asks (``heartbeat_interval_s``, as ``Heartbeat``), skipping a beat while a dispatch it
  answered in full (``renews_registration``) renewed its registration within the interval (``Registration``);
- ``Pause`` makes ``Generate`` answer ``UNAVAILABLE`` ("worker <id> is paused") until ``Resume``;
- ``Stats`` answers the controller's poll.

A completion is canned (after ``--generate-s`` seconds per call, 0 by default): its first token is a digit
drawn at random (so rewards on the digits task vary within a group and dynamic sampling has groups to drop),
then filler words up to the response length, then EOS. Weight updates are simulated too: the simulated
trainer writes each new version into a ``VersionFile`` that every simulated worker reads (the real path,
UpdateWeights + broadcast, is what ``relayrl bench weightsync`` measures).

Run as ``python -m relayrl.bench.simulated_workers --controller ADDR --index I --count N --responses JSON
--version-file F`` (``canned_responses`` gives the responses); it prints ``ready`` once every worker's server
is listening. It imports neither torch nor transformers, so it starts fast.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import mmap
import os
import random
import struct
from pathlib import Path

import grpc

from relayrl.services.registration import Registration
from relayrl.v1 import common_pb2, controller_pb2, controller_pb2_grpc, rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)
_VERSION = struct.Struct("<q")


class VersionFile:
    """One int64 policy version in a small shared file: the simulated trainer writes, simulated workers read."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.exists() or path.stat().st_size < _VERSION.size:
            path.write_bytes(_VERSION.pack(0))
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, _VERSION.size)

    def read(self) -> int:
        return _VERSION.unpack_from(self._map)[0]

    def write(self, version: int) -> None:
        _VERSION.pack_into(self._map, 0, version)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)


def canned_responses(tokenizer, response_tokens: int) -> list[list[int]]:
    """Ten responses, one per leading digit: ``"<d> is is ... <eos>"`` of ``response_tokens`` tokens."""
    filler = [tokenizer.convert_tokens_to_ids("is")]  # a word of the tiny demo vocabulary (relayrl.models.tiny)
    responses = []
    for digit in range(10):
        ids = tokenizer.encode(str(digit), add_special_tokens=False)
        ids += filler * max(0, response_tokens - 1 - len(ids))
        responses.append([*ids, tokenizer.eos_token_id])
    return responses


class SimulatedWorker(rollout_pb2_grpc.RolloutServiceServicer):
    """One simulated worker id: answers Generate instantly with canned completions."""

    def __init__(
        self, worker_id: str, versions: VersionFile, responses: list[list[int]], seed: int, generate_s: float = 0.0
    ) -> None:
        self.worker_id = worker_id
        self.generate_s = generate_s
        self.versions = versions
        self.responses = responses
        self.logprobs = [[-0.5] * len(r) for r in responses]
        self.rng = random.Random(seed)
        self.generated_tokens = 0
        self.paused = False
        self.registration = Registration()

    async def Generate(self, request, context):
        if self.paused:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is paused")
        version = self.versions.read()
        if request.min_policy_version > version:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"min_policy_version: worker has version {version} < {request.min_policy_version}",
            )
        if self.generate_s:
            await asyncio.sleep(self.generate_s)
        completions = []
        for prompt in request.prompts:
            for index in range(request.params.n):
                digit = self.rng.randrange(10)
                self.generated_tokens += len(self.responses[digit])
                completions.append(
                    common_pb2.Completion(
                        prompt_id=prompt.prompt_id,
                        sample_index=index,
                        token_ids=self.responses[digit],
                        logprobs=self.logprobs[digit],
                        finish_reason=common_pb2.FINISH_REASON_STOP,
                        policy_version=version,
                        worker_id=self.worker_id,
                    )
                )
        yield rollout_pb2.GenerateResponse(completions=completions)  # all finish at once, as in one engine step
        if request.renews_registration:
            self.registration.renew()

    async def Pause(self, request, context):
        self.paused = True
        return rollout_pb2.PauseResponse()

    async def Resume(self, request, context):
        self.paused = False
        return rollout_pb2.ResumeResponse()

    async def Stats(self, request, context):
        return rollout_pb2.StatsResponse(
            worker_id=self.worker_id,
            state="serving",
            policy_version=self.versions.read(),
            generated_tokens=self.generated_tokens,
        )


async def heartbeat(controller: str, workers: list[tuple[SimulatedWorker, str]], interval_s: float) -> None:
    """RegisterWorker for every worker once per interval, spread evenly over it: ``interval_s`` until the
    controller answers with its ``heartbeat_interval_s``, then that (as ``Heartbeat`` does). As a real worker
    (one thread per worker, 5 s deadline) each worker has at most one beat in flight: a slow answer delays that
    worker's next beat only, and an overloaded controller is not sent more."""
    async with grpc.aio.insecure_channel(controller) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        in_flight: dict[str, asyncio.Task] = {}
        warned = False

        async def beat(worker: SimulatedWorker, address: str) -> None:
            nonlocal warned, interval_s
            request = controller_pb2.RegisterWorkerRequest(
                worker_id=worker.worker_id, address=address, policy_version=worker.versions.read()
            )
            try:
                response = await stub.RegisterWorker(request, timeout=5)
                interval_s = response.heartbeat_interval_s or interval_s
            except grpc.aio.AioRpcError as err:
                if not warned:
                    log.warning("RegisterWorker failed (%s); retrying", err.code().name)
                    warned = True
            finally:
                del in_flight[worker.worker_id]

        loop = asyncio.get_running_loop()
        next_beat = loop.time()
        while True:
            for worker, address in workers:
                renewed = worker.registration.renewed_for(interval_s) > 0
                if worker.worker_id not in in_flight and not renewed:
                    in_flight[worker.worker_id] = asyncio.create_task(beat(worker, address))
                next_beat += interval_s / len(workers)
                await asyncio.sleep(max(0.0, next_beat - loop.time()))


async def serve(args: argparse.Namespace) -> None:
    versions = VersionFile(args.version_file)
    responses = json.loads(args.responses)
    workers, servers = [], []
    for i in range(args.count):
        worker_id, seed = f"sim-{args.index}-w{i:04d}", args.index * 100_003 + i
        worker = SimulatedWorker(worker_id, versions, responses, seed, args.generate_s)
        server = grpc.aio.server()
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        workers.append((worker, f"127.0.0.1:{port}"))
        servers.append(server)
    print("ready", flush=True)
    await heartbeat(args.controller, workers, args.heartbeat_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m relayrl.bench.simulated_workers", description=__doc__)
    parser.add_argument("--controller", required=True, help="controller address")
    parser.add_argument("--index", type=int, required=True, help="this simulator's index (in worker ids)")
    parser.add_argument("--count", type=int, required=True, help="simulated workers in this process")
    parser.add_argument("--responses", required=True, help="the canned responses' token ids, a JSON list of lists")
    parser.add_argument("--version-file", required=True)
    parser.add_argument("--heartbeat-s", type=float, default=1.0)
    parser.add_argument("--generate-s", type=float, default=0.0, help="each Generate call waits this long first")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s [simulated-workers] %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
