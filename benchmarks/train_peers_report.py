"""The tables of `benchmarks/train_peers.py`. Pure: rows in, text out (no processes, no I/O).

A row is one contender's run in one round: samples/s over its timed steps, the first losses, the
CPU steal and other processes' CPU over its window (or `error`). Ratios are paired round by round,
so both figures of a ratio come from the same minutes of the machine.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
from typing import Any

# the first losses of a peer agree with accelab's within this relative difference: fp32 eager kernels
# differ only in summation order; compiled or bf16 kernels round differently
LOSS_TOLERANCE = {False: 1e-3, True: 3e-2}


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def rate(row: dict[str, Any]) -> float | None:
    return None if "error" in row else row["samples_per_s"]


def run_line(row: dict[str, Any]) -> str:
    noise = f"steal {pct(row.get('steal'))}, others {row.get('others_cores') or 0:.2f} cores"
    if "error" in row:
        return f"FAILED ({noise}): {row['error'].strip().splitlines()[-1] if row['error'].strip() else ''}"
    losses = " ".join(f"{x:.4f}" for x in row["losses"][:3])
    return f"{row['samples_per_s']:7.1f} samples/s  {noise}  {row['threads']} threads  losses {losses}"


def quietest_round(rows: dict[str, list[dict[str, Any]]]) -> int:
    """The round whose windows had the least steal and other processes' CPU, all contenders summed."""

    def loudness(row: dict[str, Any]) -> float:
        return (row.get("steal") or 0.0) + (row.get("others_cores") or 0.0) / 4

    return min(range(min(map(len, rows.values()))), key=lambda r: sum(loudness(rows[k][r]) for k in rows))


def paired(mine: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[float]:
    """Their samples/s over mine, round by round (the same minutes of the machine)."""
    return [b / a for x, y in zip(mine, theirs) if (a := rate(x)) and (b := rate(y))]


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def model_section(model: str, found: dict[str, Any]) -> list[str]:
    spec, rows, chosen = found["spec"], found["rows"], found["contenders"]
    quiet = quietest_round(rows)
    lines = [
        f"### {model}: digits at {spec['image_size']} px, global batch {spec['batch_size']}, "
        f"{spec['max_steps']} optimizer steps per run (the first {spec['timing_warmup']} left out), "
        f"lr {spec['lr']:g} cosine ({spec['warmup_steps']} warm-up), AdamW weight decay {spec['weight_decay']:g} "
        f"(accelab's groups), clip {spec['max_grad_norm']:g}, {spec['threads']} threads",
        "",
        "| contender | samples/s per round | median | quietest round | steal per window | ratio to accelab "
        "(same plan, paired) |",
        "|---|---|---|---|---|---|",
    ]
    for key, c in chosen.items():
        mine = rows[key]
        ratios = paired(rows[c["versus"]], mine) if c["versus"] in rows else []
        rates = [v for r in mine if (v := rate(r))]
        each = f" ({', '.join(fmt(x, 2) for x in ratios)})" if ratios else ""
        lines.append(
            f"| {c['label']} | {', '.join(fmt(rate(r)) for r in mine)} | {fmt(median(rates))} "
            f"| {fmt(rate(mine[quiet]))} | {', '.join(pct(r.get('steal')) for r in mine)} | "
            f"{fmt(median(ratios), 2)}{each} |"
        )
    lines += [f"(quietest round: {quiet + 1}; samples/s measured inside each process over its timed steps)", ""]
    return lines + loss_lines(rows, chosen) + verdict_lines(rows, chosen)


def loss_lines(rows: dict[str, list[dict[str, Any]]], chosen: dict[str, Any]) -> list[str]:
    lines = ["first 3 losses, round 1 (same init and data order for every contender):"]
    for key, c in chosen.items():
        row, ref = rows[key][0], rows[c["versus"]][0] if c["versus"] in rows else None
        if "error" in row:
            lines.append(f"  {c['label']}: failed")
            continue
        shown = " ".join(f"{x:.5f}" for x in row["losses"][:3])
        if key == c["versus"] or ref is None or "error" in ref:
            lines.append(
                f"  {c['label']}: {shown}" + ("" if key == c["versus"] else f"  (no {c['versus']} run to compare)")
            )
            continue
        diff = max(abs(a - b) / abs(b) for a, b in zip(row["losses"][:3], ref["losses"][:3]))
        ok = diff <= LOSS_TOLERANCE[c["compile"] or c["precision"] == "bf16"]
        lines.append(
            f"  {c['label']}: {shown}  (max rel. diff to {c['versus']} {diff:.1e}: {'agree' if ok else 'DIFFER'})"
        )
    return lines + [""]


def verdict_lines(rows: dict[str, list[dict[str, Any]]], chosen: dict[str, Any]) -> list[str]:
    lines = ["accelab at the same plan, its samples/s over each peer's (median of paired rounds):"]
    for key, c in chosen.items():
        if c["kind"] == "accelab" or c["versus"] not in rows:
            continue
        ratios = [1 / r for r in paired(rows[c["versus"]], rows[key])]
        got = median(ratios)
        mark = "-" if got is None else "OK" if got >= 1.0 else "within 3%" if got >= 0.97 else "MISSED"
        lines.append(f"  [{mark}] {fmt(got, 2)}x over {c['label']} (rounds: {', '.join(fmt(x, 2) for x in ratios)})")
    return lines + [""]


def target_summary(
    model: str, trainer: dict[str, Any], accelab: dict[str, Any], target: float | None, plan: str
) -> dict[str, Any]:
    from accelab.train.convergence import Eval, time_to_target

    runs = {
        "HF Trainer, defaults": trainer,
        f"accelab train --plan {plan}": accelab,
    }
    failed = {name: run["error"] for name, run in runs.items() if "error" in run}
    if failed:
        return {"model": model, "errors": failed}
    curves = {name: [Eval.of(e) for e in run["evals"]] for name, run in runs.items()}
    goal = target if target is not None else next(iter(curves.values()))[-1].accuracy
    assert goal is not None
    return {
        "model": model,
        "target_accuracy": goal,
        "target_from": "--target-accuracy" if target is not None else "HF Trainer's final accuracy",
        "runs": {
            name: {
                "time_to_target_s": time_to_target(curves[name], goal, "accuracy"),
                "final_accuracy": curves[name][-1].accuracy,
                "train_s": curves[name][-1].wall_s,
                "evals": [(e.step, round(e.wall_s, 2), e.accuracy) for e in curves[name]],
                "settings": settings(run),
                "steal": run.get("steal"),
                "others_cores": run.get("others_cores"),
            }
            for name, run in runs.items()
        },
    }


def reached(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds:.1f} s"


def settings(run: dict[str, Any]) -> str:
    """What a time-to-target run trained with: accelab's from its Result's plan, Trainer's from its spec."""
    plan = run.get("plan") or {}
    precision = plan.get("precision") or run.get("precision")
    compiled = plan.get("compile", "off") != "off" if plan else run.get("compile")
    batch = plan.get("batch_size") or run.get("batch_size")
    return f"{precision}, {'compiled' if compiled else 'eager'}, batch {batch}, {run.get('threads')} threads/process"


def target_lines(target: dict[str, Any] | None, opts: argparse.Namespace) -> list[str]:
    if target is None:
        return [
            "time to target: skipped (no --tuned-plan). To run it:",
            f"  accelab train --tune --model {opts.target_model} --dataset digits --out train.yaml",
            "  python benchmarks/train_peers.py --rounds 0 --tuned-plan train.yaml   # that section alone",
        ]
    if "errors" in target:
        return ["time to target: failed", *(f"  {name}: {err}" for name, err in target["errors"].items())]
    lines = [
        f"### time to target, {target['model']}: eval accuracy {target['target_accuracy']:.4f} "
        f"({target['target_from']}), training wall time with evaluations excluded",
        "",
        "| run | settings | time to target | final accuracy | all epochs | steal, others (cores) |",
        "|---|---|---|---|---|---|",
    ]
    for name, run in target["runs"].items():
        lines.append(
            f"| {name} | {run['settings']} | {reached(run['time_to_target_s'])} | {run['final_accuracy']:.4f} | "
            f"{run['train_s']:.1f} s | "
            f"{pct(run['steal'])}, {fmt(run['others_cores'], 2)} |"
        )
    times = [run["time_to_target_s"] for run in target["runs"].values()]
    if all(times):
        lines.append(f"time to target, HF Trainer's over accelab's tuned plan's: {times[0] / times[1]:.2f}x")
    return lines


def report(found: dict[str, Any], target: dict[str, Any] | None, opts: argparse.Namespace, argv: list[str]) -> str:
    lines = [
        f"accelab train against HF Trainer and accelerate's README loop; {opts.rounds} round(s), contenders "
        f"A B C ... C B A, each run a fresh process; {os.cpu_count()} CPU cores",
        "",
    ]
    for model, data in found.items():
        lines += model_section(model, data)
    lines += target_lines(target, opts)
    return "\n".join([*lines, "", f"reproduce: python benchmarks/train_peers.py {shlex.join(argv)}"])
