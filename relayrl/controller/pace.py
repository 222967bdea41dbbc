"""The run's recent pace for operators (``relayrl status``): reward, samples per second, time left."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from relayrl.v1 import controller_pb2


@dataclass(frozen=True)
class StepReport:
    seconds: float  # the trainer's step_seconds: pull, train, sync, report
    samples: int  # samples generated for the step
    reward: float  # the step's BatchStats.reward_mean


class Pace:
    """The last ``window`` reported steps. samples/s = sum(samples) / sum(seconds);
    ETA = (total - step) x mean(seconds); recent reward = mean(reward)."""

    def __init__(self, window: int = 10) -> None:
        self.steps: deque[StepReport] = deque(maxlen=window)

    def record(self, seconds: float, samples: int, reward: float) -> None:
        self.steps.append(StepReport(seconds, samples, reward))

    def fill(self, status: controller_pb2.StatusResponse, total_steps: int) -> None:
        """Set ``status``'s pace fields (total_steps, recent_reward, samples_per_second, eta_seconds, recent_steps)
        from its trainer_step and state."""
        status.total_steps = total_steps
        status.recent_steps = len(self.steps)
        if status.state == "finished":
            status.eta_seconds = 0.0
        if not self.steps:
            return
        seconds = sum(s.seconds for s in self.steps)
        status.recent_reward = sum(s.reward for s in self.steps) / len(self.steps)
        status.samples_per_second = sum(s.samples for s in self.steps) / seconds if seconds > 0 else 0.0
        if status.state != "finished":
            status.eta_seconds = max(0, total_steps - status.trainer_step) * seconds / len(self.steps)
