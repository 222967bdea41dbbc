"""The operator commands (``relayrl submit|status|weights|pause|unpause|drain|scale``) over RelayClient.

Each returns the process exit code: 0 done, 1 the controller refused or was unreachable (the status
code and its message are printed), 2 a usage problem (missing address, unreadable file).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

import grpc
import yaml
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from relayrl.client import ClientConfigError, Completion, Prompt, RelayClient, SamplingParams
from relayrl.client.options import ENV_ADDRESS
from relayrl.client.types import as_prompts
from relayrl.errors import rpc_error_text
from relayrl.ops import k8s, slurm
from relayrl.ops.args import controller_address
from relayrl.ops.render import print_json, status_tables, to_dict, weights_tables
from relayrl.ops.run_record import describe, ended_record, listening, stopped_record
from relayrl.ops.submit_order import InputOrder
from relayrl.runtime.words import counted

out = Console()
err = Console(stderr=True)


def operator_command(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Map client errors to a one-line message and an exit code."""

    @functools.wraps(fn)
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (ClientConfigError, ValueError, OSError) as error:
            err.print(f"[red]relayrl: {error}[/red]", soft_wrap=True)
            return 2
        except grpc.RpcError as error:
            err.print(f"[red]relayrl: {rpc_error_text(error)}[/red]", soft_wrap=True)
            return 1
        except TimeoutError as error:
            err.print(f"[red]relayrl: {error}[/red]", soft_wrap=True)
            return 1

    return run


def connect(args: argparse.Namespace) -> RelayClient:
    """A client of the controller ``controller_address`` finds (--controller, RELAYRL_CONTROLLER, --run)."""
    settings = {"attempts": args.attempts}
    if args.timeout:
        settings["timeout_s"] = settings["submit_timeout_s"] = args.timeout
    return RelayClient(
        controller_address(args.controller, os.environ.get(ENV_ADDRESS), args.run),
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        server_name=args.tls_server_name,
        **settings,
    )


def read_prompts(path: Path) -> list[Prompt]:
    """JSONL: one object per line ({"prompt"|"text", "answer", "id"|"prompt_id", "token_ids"}) or a string. A
    prompt without an id gets ``line-<N>``, its line number, so that every result names its input."""
    items = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON: {error.msg}") from None
            item = {"prompt": item} if isinstance(item, str) else item
            if isinstance(item, dict) and not item.get("id", item.get("prompt_id")):
                item = {**item, "id": f"line-{number}"}
            items.append(item)
    if not items:
        raise ValueError(f"{path}: no prompts")
    try:
        return as_prompts(items)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def result_row(completion: Completion, prompt: Prompt) -> dict:
    """One output line: the completion with its prompt (text, or token ids); ``reward`` null where none was
    computed (no --reward-fn, or a prompt without an answer)."""
    row = completion.to_dict()
    return {"prompt_id": row.pop("prompt_id"), "prompt": prompt.text or list(prompt.token_ids), **row}


@contextlib.contextmanager
def open_sink(path: str | None) -> Iterator[TextIO]:
    """The file at ``path`` (written anew), or stdout."""
    if path is None:
        yield sys.stdout
        return
    with Path(path).open("w") as sink:
        yield sink


@operator_command
def cmd_submit(args: argparse.Namespace) -> int:
    prompts = read_prompts(Path(args.prompts))
    by_id = {p.prompt_id: p for p in prompts}
    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    versions, workers, rewards, tokens = Counter(), Counter(), [], 0
    order = None if args.unordered else InputOrder(list(by_id), args.n)
    started = time.monotonic()
    columns = [TextColumn("[bold]submit"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with (
        open_sink(args.out) as sink,
        connect(args) as client,
        Progress(*columns, console=err, transient=True) as progress,
    ):
        task = progress.add_task("completions", total=len(prompts) * args.n)

        def write(completions: list[Completion]) -> None:
            sink.writelines(json.dumps(result_row(c, by_id[c.prompt_id])) + "\n" for c in completions)

        try:
            for completion in client.submit(prompts, params, reward_fn=args.reward_fn, raw=args.raw):
                write(order.add(completion) if order else [completion])
                versions[completion.policy_version] += 1
                workers[completion.worker_id] += 1
                tokens += len(completion.token_ids)
                if completion.reward is not None:
                    rewards.append(completion.reward)
                progress.advance(task)
        finally:
            write(order.rest() if order else [])  # a call that failed part-way: what arrived, in order
    seconds = time.monotonic() - started
    summary = {
        "prompts": len(prompts),
        "completions": sum(workers.values()),
        "rewarded": len(rewards),  # completions with a reward; reward_mean is over these only
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "policy_versions": {str(v): n for v, n in sorted(versions.items())},
        "workers": dict(sorted(workers.items())),
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens / seconds, 1) if seconds > 0 else 0.0,
        "out": args.out or "-",
    }
    console = out if args.out else err  # without --out, stdout carries the completions
    if args.json:
        print_json(console, summary)
    else:
        table = Table(title="submitted", show_header=False)
        for key, value in summary.items():
            table.add_row(key, json.dumps(value) if isinstance(value, dict) else str(value))
        console.print(table)
    return 0


def show(args: argparse.Namespace, response, tables) -> int:
    """``response`` as JSON with --json, else as the tables ``tables(response)`` renders."""
    if args.json:
        print_json(out, response)
    else:
        for table in tables(response):
            out.print(table)
    return 0


@operator_command
def cmd_status(args: argparse.Namespace) -> int:
    if args.watch is not None and not args.watch > 0:
        raise ValueError(f"--watch: must be > 0 seconds, got {args.watch:g}")
    if (record := gone_run(args)) is not None:  # --run of a run whose controller is gone: what its files say
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            out.print(describe(record), soft_wrap=True)
        return 0
    with connect(args) as client:
        if args.watch is None:
            return show(args, client.status(), status_tables)
        watch_status(args, client)
    return 0


def gone_run(args: argparse.Namespace) -> dict | None:
    """With ``--run`` as the only address: the run's record (relayrl.ops.run_record) when ``relayrl up`` ended it
    since its last start, or when nothing listens at its controller.address; None when its controller is to be
    asked."""
    if args.run is None or args.controller or os.environ.get(ENV_ADDRESS):
        return None
    run_dir = Path(args.run)
    if (record := ended_record(run_dir)) is not None:
        return record
    address = controller_address(None, None, args.run)  # ValueError naming --run when there is none
    if listening(address):
        return None
    config = run_dir / "config.yaml"
    steps = (yaml.safe_load(config.read_text()) or {}).get("trainer", {}).get("steps") if config.is_file() else None
    return stopped_record(run_dir, steps)


def watch_status(args: argparse.Namespace, client: RelayClient) -> None:
    """``status --watch``: the status again every ``args.watch`` seconds until the run is finished or failed, or
    SIGINT (Ctrl-C) ends it, always between two frames (a KeyboardInterrupt could land in the client's gRPC call
    or in the channel's close); in place on a terminal, else one after another (--json: one JSON object a line)."""
    interrupted: list[int] = []  # the handler only appends: it may run in the middle of anything, a lock held
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: interrupted.append(signum))
    live = Live(console=out, auto_refresh=False) if out.is_terminal and not args.json else None
    try:
        with live or contextlib.nullcontext():
            while not interrupted:
                status = client.status()
                if args.json:
                    print(json.dumps(to_dict(status)), flush=True)
                elif live is not None:
                    live.update(Group(*status_tables(status)), refresh=True)
                else:
                    out.rule(time.strftime("%H:%M:%S"))
                    show(args, status, status_tables)
                if status.state in ("finished", "failed"):
                    return
                next_frame = time.monotonic() + args.watch
                while not interrupted and time.monotonic() < next_frame:
                    time.sleep(min(0.1, args.watch))
    finally:
        signal.signal(signal.SIGINT, previous)


@operator_command
def cmd_weights_status(args: argparse.Namespace) -> int:
    with connect(args) as client:
        return show(args, client.weights_status(), weights_tables)


@operator_command
def cmd_weights_sync(args: argparse.Namespace) -> int:
    with connect(args) as client:
        request = client.sync_weights(force=args.force)
        if args.no_wait:
            if args.json:
                print_json(out, request)
            else:
                out.print(f"weight sync request #{request.sync_request_id} queued (version {request.policy_version})")
            return 0
        weights = client.wait_for_sync(request.sync_request_id, timeout=args.wait_timeout)
    answer = next((s for s in reversed(weights.recent_syncs) if s.sync_request_id >= request.sync_request_id), None)
    if args.json:
        print_json(out, {"request": to_dict(request), "sync": to_dict(answer) if answer else None})
    elif answer is not None and not answer.synced_worker_ids and not answer.failed:
        why = "no step trained yet: version 0 is the base model every worker loads" if not answer.policy_version else ""
        out.print(f"weight sync #{request.sync_request_id}: nothing to push ({why or 'no worker registered'})")
    elif answer is not None:
        left_out = f"; left out: {dict(answer.failed)}" if answer.failed else ""
        out.print(
            f"weight sync #{request.sync_request_id}: version {answer.policy_version} pushed to "
            f"{counted(len(answer.synced_worker_ids), 'worker')} in {answer.seconds:.2f}s ({answer.reason}){left_out}"
        )
    return 0


@operator_command
def cmd_pause(args: argparse.Namespace) -> int:
    with connect(args) as client:
        response = client.pause(args.reason)
    _print_ack(args, response, "paused")
    return 0


@operator_command
def cmd_unpause(args: argparse.Namespace) -> int:
    if getattr(args, "alias_of", None):
        err.print(
            "[dim]relayrl resume is an alias of relayrl unpause (to continue a stopped run: relayrl up CONFIG "
            "--resume)[/dim]"
        )
    with connect(args) as client:
        response = client.unpause()
    _print_ack(args, response, "unpaused")
    return 0


def _print_ack(args: argparse.Namespace, response, verb: str) -> None:
    if args.json:
        print_json(out, response)
        return
    out.print(f"run {verb}; workers acknowledged: {', '.join(response.workers) or 'none'}")
    for worker_id, reason in sorted(response.worker_errors.items()):
        err.print(f"[yellow]{worker_id}: {reason}[/yellow]")


@operator_command
def cmd_drain(args: argparse.Namespace) -> int:
    with connect(args) as client:
        response = client.drain(args.worker)
        if args.wait:
            wait_drained(client, [args.worker], args.wait_timeout)
    if args.json:
        print_json(out, response)
    else:
        done = "its in-flight calls finished" if args.wait else f"{response.in_flight} calls in flight"
        out.print(
            f"{response.worker_id} draining: no new work; {done}. Under `relayrl up` the launcher stops it once "
            "idle and gives up its slot (it is not restarted); elsewhere stop it once Status shows 0 in flight."
        )
    return 0


def wait_drained(client: RelayClient, worker_ids: list[str], timeout_s: float) -> None:
    """Until every listed worker has no Generate call in flight (or is gone); TimeoutError otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = [w.worker_id for w in client.status().workers if w.worker_id in worker_ids and w.in_flight]
        if not busy:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers still busy after {timeout_s:.0f}s: {busy}")
        time.sleep(0.5)


@operator_command
def cmd_scale_rollout(args: argparse.Namespace) -> int:
    if bool(args.k8s_namespace) != bool(args.statefulset):
        raise ValueError("--k8s-namespace and --statefulset go together")
    if args.k8s_namespace and args.slurm_job:
        raise ValueError("--slurm-job and --k8s-namespace exclude each other")
    if args.k8s_namespace:
        return _scale_statefulset(args)
    if args.slurm_job:
        return _scale_slurm(args)
    with connect(args) as client:
        response = client.scale_rollout(args.replicas)
    if args.json:
        print_json(out, response)
    else:
        previous = response.previous or "unset"
        out.print(
            f"desired rollout replicas {previous} -> {response.replicas} ({response.registered} registered); "
            "`relayrl up` starts or drains and stops local workers to match"
        )
    return 0


def cmd_scale_reward(args: argparse.Namespace) -> int:
    with connect(args) as client:
        response = client.scale_scorer(args.name, args.replicas)
    if args.json:
        print_json(out, response)
    else:
        previous = response.previous or "unset"
        out.print(
            f"desired servers of scorer {args.name} {previous} -> {response.replicas} ({response.servers} called now); "
            "`relayrl up` starts or stops local scorers to match (on a GPU node, one no free GPU is left for is not "
            "started: its console says so)"
        )
    return 0


def _scale_statefulset(args: argparse.Namespace) -> int:
    """Drain the pods a scale-down removes (when a controller is reachable), then patch the StatefulSet."""
    drained: list[str] = []
    if args.controller or os.environ.get(ENV_ADDRESS) or args.run:
        with connect(args) as client:
            client.scale_rollout(args.replicas)
            ids = [w.worker_id for w in client.status().workers]
            drained = k8s.workers_beyond(ids, args.statefulset, args.replicas)
            for worker_id in drained:
                client.drain(worker_id)
            wait_drained(client, drained, args.drain_timeout)
    previous = k8s.scale_statefulset(args.k8s_namespace, args.statefulset, args.replicas)
    result = {
        "namespace": args.k8s_namespace,
        "statefulset": args.statefulset,
        "previous": previous,
        "replicas": args.replicas,
        "drained": drained,
    }
    if args.json:
        print_json(out, result)
    else:
        out.print(
            f"statefulset {args.k8s_namespace}/{args.statefulset}: replicas {previous} -> {args.replicas}"
            + (f" (drained first: {', '.join(drained)})" if drained else "")
        )
    return 0


def _scale_slurm(args: argparse.Namespace) -> int:
    """Start extra rollout steps in a relayrl.sbatch het job, or drain and stop the highest extra ones."""
    try:
        job = slurm.find_job(args.slurm_job, args.slurm_run_dir)
        extras = slurm.extra_workers(job)
        todo = slurm.plan(args.replicas, job.base_tasks, list(extras))
        args.controller = args.controller or job.controller
        started: list[dict] = []
        stopped: list[str] = []
        with connect(args) as client:
            client.status()  # reachable before anything starts or stops
            if todo.start:
                taken = slurm.ports_in_use(job)
                started = [slurm.launch(job, k, taken_ports=taken) for k in todo.start]
            if todo.stop:
                stopped = [f"{slurm.STEP_NAME}-{k}" for k in todo.stop]
                for worker_id in stopped:
                    try:
                        client.drain(worker_id)
                    except grpc.RpcError as error:
                        if error.code() != grpc.StatusCode.NOT_FOUND:  # not registered: nothing in flight
                            raise
                wait_drained(client, stopped, args.drain_timeout)
                slurm.stop_steps(job, {k: extras[k] for k in todo.stop}, args.drain_timeout)
            response = client.scale_rollout(args.replicas)  # the count now running, recorded
    except slurm.SlurmError as error:
        err.print(f"[red]relayrl: {error}[/red]")
        return 1
    result = {
        "job_id": job.job_id,
        "run_dir": str(job.run_dir),
        "controller": args.controller,
        "previous": response.previous,
        "replicas": args.replicas,
        "job_workers": job.base_tasks,
        "started": started,
        "stopped": stopped,
    }
    if args.json:
        print_json(out, result)
    else:
        what = [f"started {s['worker_id']} on {s['node']}:{s['port']} (log {s['log']})" for s in started]
        what += [f"drained and stopped {w}" for w in stopped]
        out.print(
            f"slurm job {job.job_id}: rollout workers {response.previous or 'unset'} -> {args.replicas} "
            f"({job.base_tasks} of the job's own step)" + "".join(f"\n  {line}" for line in what)
        )
    return 0
