"""The relayrl Python SDK: submit prompts to a running controller and operate it.

    from relayrl.client import RelayClient, SamplingParams

    with RelayClient("127.0.0.1:50051") as client:          # or RELAYRL_CONTROLLER
        for c in client.submit(["3 + 1 ="], SamplingParams(n=4, max_tokens=8), reward_fn="prefix_match"):
            print(c.prompt_id, c.policy_version, c.reward, c.text)
        print(client.status().trainer_step)

``AsyncRelayClient`` offers the same calls as coroutines / async iterators (grpc.aio).
"""

from relayrl.client.aio import AsyncRelayClient
from relayrl.client.options import ClientConfigError, ClientOptions
from relayrl.client.sync import RelayClient
from relayrl.client.types import Completion, Prompt
from relayrl.wire.sampling import SamplingParams

__all__ = [
    "AsyncRelayClient",
    "ClientConfigError",
    "ClientOptions",
    "Completion",
    "Prompt",
    "RelayClient",
    "SamplingParams",
]
