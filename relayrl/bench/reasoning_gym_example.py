"""``relayrl bench reasoning-gym``: a task no one here wrote, ``relayrl up examples/reasoning-gym-smollm2.yaml``
(SmolLM2-135M-Instruct on reasoning-gym's ``chain_sum``, scored by its last number), measured as ``relayrl bench
addition`` measures its example: the same JSON (reward of the first and last 10 steps, the held-out set's greedy
accuracy before and after training, every eval and step) and ``--png`` the run's reward.png. The accuracy is
``pass@1``, the share of greedy answers at full marks (``last_number`` is 0 or 1, so it is ``mean@1`` too; a
reasoning-gym ``score_answer`` gives partial credit, which ``mean@1`` would count). The held-out set is the same
task from another seed (docs/libraries.md)."""

from __future__ import annotations

from relayrl.bench import addition
from relayrl.bench.example_run import ROOT

CONFIG = ROOT / "examples" / "reasoning-gym-smollm2.yaml"
COMMAND = (
    "relayrl bench reasoning-gym --out bench/results/reasoning-gym-smollm2.json --png docs/reasoning-gym-smollm2.png"
)


def main(argv: list[str] | None = None) -> int:
    return addition.main(argv, bench="reasoning-gym", config=CONFIG, command=COMMAND, metric="pass@1")
