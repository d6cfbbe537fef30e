"""Pass / warn / fail against documented tolerances. Pure.

Levels (`--tolerance strict|balanced|loose`, default balanced), per task; each rule passes at
its first threshold, warns up to its second, and fails beyond. `--tolerance
balanced,cosine_min=0.995` tightens one rule. The thresholds:

| task             | metric             | strict        | balanced      | loose         |
|------------------|--------------------|---------------|---------------|---------------|
| classification   | top1_agreement >=  | 0.99 / 0.97   | 0.95 / 0.90   | 0.90 / 0.80   |
| classification   | top5_overlap >=    | 0.95 / 0.90   | 0.90 / 0.80   | 0.80 / 0.60   |
| classification   | accuracy_change >= | -0.002/-0.01  | -0.01 / -0.03 | -0.03 / -0.08 |
| embeddings       | cosine_min >=      | 0.999 / 0.995 | 0.99 / 0.95   | 0.95 / 0.90   |
| generation       | perplexity_change <= | 0.005 / 0.02 | 0.03 / 0.10  | 0.10 / 0.25   |
| generation       | prefix_agreement >=  | 0.90 / 0.70  | 0.50 / 0.25  | 0.25 / 0.10   |
| generation       | token_agreement >=   | 0.95 / 0.80  | 0.60 / 0.35  | 0.35 / 0.15   |

Why the agreements are loose for generation: greedy decoding amplifies any rounding change
once two logits are close, and after the first divergence the texts differ completely while
both stay fluent; perplexity on held-out text is the measure of the model getting worse. The
two agreements catch what perplexity alone misses: a plan whose every prompt diverges at once
(prefix), or whose tokens after a divergence no longer match at all (token agreement: the share
of positions with the reference's token, at least the prefix share, so its bar is higher).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Verdict = Literal["pass", "warn", "fail"]
Direction = Literal[">=", "<="]


@dataclass(frozen=True, kw_only=True, slots=True)
class Rule:
    metric: str
    direction: Direction
    passing: float
    warning: float

    def judge(self, value: float) -> Verdict:
        ok = (lambda limit: value >= limit) if self.direction == ">=" else (lambda limit: value <= limit)
        return "pass" if ok(self.passing) else "warn" if ok(self.warning) else "fail"


def _rules(spec: dict[str, tuple[Direction, float, float]]) -> tuple[Rule, ...]:
    return tuple(Rule(metric=m, direction=d, passing=p, warning=w) for m, (d, p, w) in spec.items())


_CLASSIFICATION = {
    "strict": {
        "top1_agreement": (">=", 0.99, 0.97),
        "top5_overlap": (">=", 0.95, 0.90),
        "accuracy_change": (">=", -0.002, -0.01),
    },
    "balanced": {
        "top1_agreement": (">=", 0.95, 0.90),
        "top5_overlap": (">=", 0.90, 0.80),
        "accuracy_change": (">=", -0.01, -0.03),
    },
    "loose": {
        "top1_agreement": (">=", 0.90, 0.80),
        "top5_overlap": (">=", 0.80, 0.60),
        "accuracy_change": (">=", -0.03, -0.08),
    },
}
_EMBEDDINGS = {
    "strict": {"cosine_min": (">=", 0.999, 0.995)},
    "balanced": {"cosine_min": (">=", 0.99, 0.95)},
    "loose": {"cosine_min": (">=", 0.95, 0.90)},
}
_GENERATION = {
    "strict": {
        "perplexity_change": ("<=", 0.005, 0.02),
        "prefix_agreement": (">=", 0.90, 0.70),
        "token_agreement": (">=", 0.95, 0.80),
    },
    "balanced": {
        "perplexity_change": ("<=", 0.03, 0.10),
        "prefix_agreement": (">=", 0.50, 0.25),
        "token_agreement": (">=", 0.60, 0.35),
    },
    "loose": {
        "perplexity_change": ("<=", 0.10, 0.25),
        "prefix_agreement": (">=", 0.25, 0.10),
        "token_agreement": (">=", 0.35, 0.15),
    },
}
TOLERANCES: dict[str, dict[str, dict]] = {
    "image-classification": _CLASSIFICATION,
    "feature-extraction": _EMBEDDINGS,
    "text-generation": _GENERATION,
    "image-text-to-text": _GENERATION,
}
LEVELS = ("strict", "balanced", "loose")


def rules_for(task: str, tolerance: str = "balanced") -> tuple[Rule, ...]:
    """Rules of a level, with `metric=value` overrides: "balanced,cosine_min=0.995"."""
    level, *overrides = [part.strip() for part in tolerance.split(",") if part.strip()] or ["balanced"]
    if "=" in level:
        overrides, level = [level, *overrides], "balanced"
    if level not in LEVELS:
        raise ValueError(f"--tolerance level {level!r} is not one of {', '.join(LEVELS)}")
    table = dict(TOLERANCES[task][level])
    for item in overrides:
        metric, _, raw = item.partition("=")
        if metric not in table:
            raise ValueError(f"--tolerance {metric}=... is not a rule for {task}; rules are: {', '.join(table)}")
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"--tolerance {metric}={raw!r} needs a number") from None
        direction, _, _ = table[metric]
        table[metric] = (direction, value, value)  # an explicit limit has no warn band
    return _rules(table)


def judge(task: str, metrics: dict[str, float | None], tolerance: str = "balanced") -> tuple[Verdict, list[str]]:
    """The worst verdict over the rules whose metric was measured, and one line per rule."""
    order = {"pass": 0, "warn": 1, "fail": 2}
    worst: Verdict = "pass"
    lines = []
    for rule in rules_for(task, tolerance):
        value = metrics.get(rule.metric)
        if value is None:
            continue
        verdict = rule.judge(value)
        lines.append(f"{rule.metric}={value:.4g} {verdict} (pass {rule.direction} {rule.passing:g})")
        if order[verdict] > order[worst]:
            worst = verdict
    return worst, lines
