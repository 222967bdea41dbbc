"""``relayrl bench episodes``: agentic episodes' generation throughput when one environment server is slow.

One rollout worker (``relayrl rollout serve``, hf engine, builtin:tiny-chat's model built here without its
pretraining) and the controller's episode runner (relayrl/episodes, in this process) play GuessNumber episodes
(plain-text guesses, ``TASK``) against environment server processes
(``relayrl env serve relayrl.env.examples.slow:SlowGuessNumber``):
``--servers`` that answer each call after ``--delay-ms``, and one more that answers ``--slow-factor`` times
slower. Rounds alternate (the order flips each round) between

- ``all_fast``: the ``--servers`` fast servers, and
- ``one_slow``: ``--servers`` - 1 fast servers and the slow one,

each round ``--prompts`` groups x ``--n`` episodes, ``environment.max_sessions`` = ``--max-sessions`` per
server. Generation tokens/s = the tokens the policy sampled (loss mask 1) / the round's wall seconds.

Prints one JSON object: the settings, the machine's CPUs and load, each kind of server's measured seconds per
Reset + Step (median of ``PROBES``), each mode's rounds (seconds, sampled tokens, tokens/s, how the episodes
ended) and median tokens/s, ``pair_ratios`` (one_slow / all_fast tokens/s of each round: the pair ran back to
back, under the same load from the rest of the machine), ``ratio`` (their median; issue #27's bar: >= 0.8) and
``ratio_of_medians``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
import yaml
from transformers import AutoTokenizer

from relayrl.bench.record import machine_record, run_sides
from relayrl.client.workers import WorkerRegistry
from relayrl.config import parse_config
from relayrl.data.dataset import PromptRecord
from relayrl.env import EnvironmentClient
from relayrl.env.examples.slow import DELAY_ENV
from relayrl.episodes.runner import EpisodeRunner
from relayrl.models.tiny_chat import write_tiny_chat_model
from relayrl.rpc.channels import open_channel
from relayrl.runtime.ports import free_port
from relayrl.wire.sampling import SamplingParams

SLOW_ENV = "relayrl.env.examples.slow:SlowGuessNumber"
MODES = ("all_fast", "one_slow")
PROBES = 5
TASK = {"prompt": "guess", "answer": "", "tools": False}  # every episode's task row
MAX_TOTAL_TOKENS = 400  # per episode, within the tiny chat model's 512 positions


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="relayrl bench episodes", description=__doc__)
    parser.add_argument("--servers", type=int, default=4, help="environment servers per round")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="a fast server's wait before each answer")
    parser.add_argument("--slow-factor", type=float, default=20.0, help="the slow server waits this many times longer")
    parser.add_argument("--prompts", type=int, default=8, help="groups per round")
    parser.add_argument("--n", type=int, default=8, help="episodes per group")
    parser.add_argument(
        "--max-sessions", type=int, default=32, help="episodes in flight per server (room for a round on the fast ones)"
    )
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens sampled per turn")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per mode")
    parser.add_argument("--threads", default="auto", help="the worker's rollout.threads")
    parser.add_argument("--json", action="store_true", help="print the JSON only (no progress lines)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--workdir", type=Path, help="model, configs and logs (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.servers < 1 or args.rounds < 1 or args.prompts < 1 or args.n < 1:
        parser.error("--servers, --rounds, --prompts and --n must be >= 1")
    return args


class Processes:
    """The worker and environment server processes of the bench; ``stop`` ends them all."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> str:
        """``relayrl <argv> --port P`` logging to ``<name>.log``; returns its address."""
        port = free_port()
        log = (self.workdir / f"{name}.log").open("wb")
        command = [sys.executable, "-m", "relayrl.cli", *argv, "--port", str(port)]
        self.procs.append(
            subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        )
        return f"127.0.0.1:{port}"

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()


def call_seconds(address: str) -> float:
    """Median seconds of a Reset + Step on ``address`` over PROBES episodes."""
    client = EnvironmentClient(address, timeout_s=60)
    times = []
    for i in range(PROBES):
        start = time.perf_counter()
        client.reset(f"probe-{i}", {}, seed=i)
        client.step(f"probe-{i}", {"role": "assistant", "content": "4"})
        times.append(time.perf_counter() - start)
        client.close(f"probe-{i}", "aborted")
    client.disconnect()
    return statistics.median(times)


def run_config(workdir: Path, model: Path, args: argparse.Namespace, servers: list[str]):
    """The run config the episode runner reads (only its rollout and environment sections matter here)."""
    return parse_config(
        {
            "model": {"path": str(model)},
            "data": {"path": str(workdir / "unused.jsonl")},
            "rollout": {"n": args.n, "max_tokens": args.max_tokens, "temperature": 1.0},
            "environment": {
                "servers": servers,
                "max_sessions": args.max_sessions,
                "max_turns": args.max_turns,
                "max_total_tokens": MAX_TOTAL_TOKENS,
                "step_timeout_s": 60.0,
            },
        }
    )


def run_round(runner: EpisodeRunner, round_index: int, args: argparse.Namespace) -> dict:
    """One round of ``--prompts`` groups; its seconds, sampled tokens, tokens/s and episode ends."""
    records = [PromptRecord(f"{round_index}:{i}", "", [], "") for i in range(args.prompts)]
    start = time.perf_counter()
    result = runner.run(records)
    seconds = time.perf_counter() - start
    episodes = [e for group in result.episodes.values() for e in group]
    sampled = sum(sum(e.mask) for e in episodes)
    return {
        "seconds": round(seconds, 3),
        "sampled_tokens": sampled,
        "tokens_per_s": round(sampled / seconds, 1),
        "episodes": len(episodes),
        "ends": dict(Counter(e.end for e in episodes)),
        "turns_mean": round(statistics.mean(e.turns for e in episodes), 2) if episodes else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="relayrl-bench-episodes-"))
    workdir.mkdir(parents=True, exist_ok=True)
    say = (lambda *_: None) if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    model = write_tiny_chat_model(workdir / "model", seed=0, pretrain=False)
    worker_cfg = {
        "model": {"path": str(model)},
        "data": {"path": str(workdir / "unused.jsonl")},
        "rollout": {"max_batch_size": args.prompts * args.n, "threads": args.threads},
    }
    (workdir / "worker.yaml").write_text(yaml.safe_dump(worker_cfg))
    procs = Processes(workdir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below stops the processes
    delay = args.delay_ms / 1000
    machine = machine_record(None)
    try:
        worker = procs.start("rollout", ["rollout", "serve", "--config", str(workdir / "worker.yaml")])
        serve = ["env", "serve", SLOW_ENV, "--max-sessions", str(args.max_sessions)]
        fast = [procs.start(f"env-fast-{i}", serve, {DELAY_ENV: str(delay)}) for i in range(args.servers)]
        slow = procs.start("env-slow", serve, {DELAY_ENV: str(delay * args.slow_factor)})
        for address in [*fast, slow]:
            EnvironmentClient(address, timeout_s=60).wait_ready(300)
        grpc.channel_ready_future(open_channel(worker)).result(timeout=300)
        say(f"worker {worker}; fast servers {fast}; slow server {slow}")
        probe = {"fast": round(call_seconds(fast[0]), 4), "slow": round(call_seconds(slow), 4)}
        tokenizer = AutoTokenizer.from_pretrained(model)
        registry = WorkerRegistry(3600.0, max_in_flight=16)
        registry.register("w0", worker, "hf", 0)
        server_sets = {"all_fast": fast, "one_slow": [*fast[:-1], slow]}
        runners = {}
        for mode, servers in server_sets.items():
            cfg = run_config(workdir, model, args, servers)
            params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, max_tokens=args.max_tokens)
            runners[mode] = EpisodeRunner(cfg, registry, tokenizer, params, lambda _: TASK)
        for mode in MODES:  # warm-up: the worker's first batches, the channels, each pool's call times
            run_round(runners[mode], -1, args)
        rounds: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else reversed(MODES):
                rounds[mode].append(run_round(runners[mode], r, args))
                say(f"round {r} {mode}: {rounds[mode][-1]}")
        for runner in runners.values():
            runner.close()
    finally:
        procs.stop()
    medians = {mode: statistics.median(x["tokens_per_s"] for x in rounds[mode]) for mode in MODES}
    result = {
        "command": "relayrl bench episodes " + " ".join(argv if argv is not None else sys.argv[2:]),
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "out", "workdir")},
        "machine": machine | {"resolved": run_sides(workdir), "loadavg_at_end": list(os.getloadavg())},
        "env_call_seconds": probe,
        "rounds": rounds,
        "median_tokens_per_s": medians,
        # each round's pair ran back to back, under the same load from the rest of the machine
        "pair_ratios": [round(b["tokens_per_s"] / a["tokens_per_s"], 3) for a, b in zip(*rounds.values())],
        "ratio": round(statistics.median(b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(*rounds.values())), 3),
        "ratio_of_medians": round(medians["one_slow"] / medians["all_fast"], 3),
        "target_ratio": 0.8,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
