"""Pass / warn / fail / cannot tell, from each figure's 95% interval against documented lines. Pure.

A rule has a pass line and a warn line. Its figure's interval (`quality.intervals`) decides:
- wholly on the good side of the pass line: pass;
- wholly between the two lines: warn;
- wholly beyond the warn line: fail;
- across a line: "cannot tell" at this sample size, with the outcomes still possible and about
  how many samples would tell (`intervals.samples_to_tell`).
The verdict of a plan is the worst over its rules: certain when every rule's outcomes leave
one answer (a rule that surely fails makes the plan fail whatever the others say), else
"cannot tell" with the range of outcomes (`possible`). So a verdict made at one sample size is
not contradicted at a larger one, up to the 5% an interval misses by; a figure whose true
value sits on a line stays "cannot tell" at every size. A plan none of whose judged figures was
measured is "cannot tell" too, never a pass.

Levels (`--tolerance strict|balanced|loose`, default balanced); `--tolerance
balanced,mean_kl=0.002` sets one rule's line (no warn band). Lines, pass / warn:

| task           | figure              | strict         | balanced      | loose         |
|----------------|---------------------|----------------|---------------|---------------|
| generation     | mean_kl <=          | 0.002 / 0.005  | 0.005 / 0.015 | 0.015 / 0.05  |
| generation     | top1_agreement >=   | 0.97 / 0.95    | 0.95 / 0.92   | 0.92 / 0.85   |
| generation     | perplexity_ratio <= | 1.01 / 1.02    | 1.02 / 1.05   | 1.05 / 1.10   |
| classification | top1_agreement >=   | 0.99 / 0.97    | 0.95 / 0.90   | 0.90 / 0.80   |
| classification | top5_overlap >=     | 0.95 / 0.90    | 0.90 / 0.80   | 0.80 / 0.60   |
| classification | accuracy_change >=  | -0.002 / -0.01 | -0.01 / -0.03 | -0.03 / -0.08 |
| embeddings     | cosine_mean >=      | 0.999 / 0.995  | 0.99 / 0.95   | 0.95 / 0.90   |

Where the generation lines come from (GENERATION_SOURCE): llama.cpp's published scoreboard
for LLaMA 3 8B against FP16 on Wikitext-2 (tools/perplexity/README.md, revision f364eb6f):
mean KLD q8_0 0.0014, q6_K 0.0055, q5_K_M 0.011, q4_K_M 0.031, q4_0 0.072; same top token
q8_0 97.7%, q6_K 96.0%, q4_K_M 91.9%; PPL ratio q8_0 1.0004, q6_K 1.0035, q5_K_M 1.009,
q4_K_M 1.028, q4_0 1.075. Balanced passes a mean KL as small as a 6-bit k-quant's, warns up to a
5-bit one's and fails the 4-bit territory; strict passes 8-bit closeness; loose passes 5-bit and
fails beyond 4-bit. The other two lines follow the KL's for a small model: SmolLM2-135M reads
with more near-ties than an 8B model (perplexity ~18 on this text), so at the same KL its top
token flips more often (its Q8_0: KL 0.004, top-1 0.96) and its perplexity moves more (1.008);
and the perplexity ratio is the noisiest figure on a few thousand positions (about +-0.5% at
32 windows), so its lines sit one quantization step looser than the KL's. The mean KL decides
first: on SmolLM2 its interval is the tightest (about +-10% of the estimate at 32 windows).
The classifier and encoder lines are this project's earlier point thresholds, now applied to
intervals (encoders: on the mean cosine, where they were on the minimum, which has no interval:
the minimum is reported).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from accelab.quality.intervals import UNBOUNDED, Interval, samples_to_tell, wilson_samples_to_tell

Outcome = Literal["pass", "warn", "fail"]
Verdict = Literal["pass", "warn", "fail", "cannot tell"]
Direction = Literal[">=", "<="]
OUTCOMES: tuple[Outcome, ...] = ("pass", "warn", "fail")
CANNOT_TELL: Verdict = "cannot tell"
GENERATION_SOURCE = (
    "llama.cpp's scoreboard for LLaMA 3 8B vs FP16 (tools/perplexity/README.md): pass ~ q6_K, "
    "warn ~ q5_K_M, fail ~ 4-bit"
)
PROJECT_SOURCE = "accelab's thresholds for this task (quality/verdict.py)"


@dataclass(frozen=True, kw_only=True, slots=True)
class Rule:
    metric: str
    direction: Direction
    passing: float
    warning: float

    def level(self, value: float) -> Outcome:
        ok = (lambda limit: value >= limit) if self.direction == ">=" else (lambda limit: value <= limit)
        return "pass" if ok(self.passing) else "warn" if ok(self.warning) else "fail"

    def outcomes(self, interval: Interval) -> tuple[Outcome, Outcome]:
        """(best, worst) outcome over the interval; the same twice when the interval decides."""
        ends = sorted((self.level(interval.low), self.level(interval.high)), key=OUTCOMES.index)
        return ends[0], ends[1]

    def possible(self, interval: Interval) -> frozenset[Outcome]:
        """Every outcome the interval leaves (no warn where the rule has no warn band)."""
        best, worst = (OUTCOMES.index(o) for o in self.outcomes(interval))
        return frozenset(o for o in OUTCOMES[best : worst + 1] if o != "warn" or self.passing != self.warning)

    def lines(self) -> tuple[float, ...]:
        return (self.passing,) if self.passing == self.warning else (self.passing, self.warning)

    def describe(self) -> str:
        band = "" if self.passing == self.warning else f", warn {self.direction} {self.warning:g}"
        return f"pass {self.direction} {self.passing:g}{band}"


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
    "strict": {"cosine_mean": (">=", 0.999, 0.995)},
    "balanced": {"cosine_mean": (">=", 0.99, 0.95)},
    "loose": {"cosine_mean": (">=", 0.95, 0.90)},
}
_GENERATION = {
    "strict": {
        "mean_kl": ("<=", 0.002, 0.005),
        "top1_agreement": (">=", 0.97, 0.95),
        "perplexity_ratio": ("<=", 1.01, 1.02),
    },
    "balanced": {
        "mean_kl": ("<=", 0.005, 0.015),
        "top1_agreement": (">=", 0.95, 0.92),
        "perplexity_ratio": ("<=", 1.02, 1.05),
    },
    "loose": {
        "mean_kl": ("<=", 0.015, 0.05),
        "top1_agreement": (">=", 0.92, 0.85),
        "perplexity_ratio": ("<=", 1.05, 1.10),
    },
}
TOLERANCES: dict[str, dict[str, dict]] = {
    "image-classification": _CLASSIFICATION,
    "feature-extraction": _EMBEDDINGS,
    "text-generation": _GENERATION,
    "image-text-to-text": _GENERATION,
}
SOURCES = {
    "image-classification": PROJECT_SOURCE,
    "feature-extraction": PROJECT_SOURCE,
    "text-generation": GENERATION_SOURCE,
    "image-text-to-text": GENERATION_SOURCE,
}
LEVELS = ("strict", "balanced", "loose")


def rules_for(task: str, tolerance: str = "balanced") -> tuple[Rule, ...]:
    """Rules of a level, with `metric=value` overrides: "balanced,mean_kl=0.002"."""
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


@dataclass(frozen=True, kw_only=True, slots=True)
class Judgement:
    verdict: Verdict
    possible: tuple[Outcome, ...]  # the outcomes the intervals leave (one when decided)
    lines: tuple[str, ...]  # one per rule
    samples_needed: int | None = None  # cannot tell: about the --samples that would tell (None: none would)

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "label": label({"verdict": self.verdict, "possible": self.possible}),
            "possible": list(self.possible),
            "rules": list(self.lines),
            "samples_needed": self.samples_needed,
        }


def judge(task: str, figures: dict[str, Any], tolerance: str = "balanced") -> Judgement:
    """The verdict over the rules whose figure was measured (`metrics.compare`'s figures)."""
    sample = figures.get("sample") or {}
    n, per_sample = int(sample.get("n", 0)), max(1, int(sample.get("per_sample", 1)))
    overall: set[Outcome] = {"pass"}  # the plan's outcome is the worst of its rules' outcomes
    lines, needs = [], []
    for rule in rules_for(task, tolerance):
        interval = _interval(figures, rule.metric)
        if interval is None:
            continue
        low, high = rule.outcomes(interval)
        overall = {max(a, b, key=OUTCOMES.index) for a in overall for b in rule.possible(interval)}
        wilson = rule.metric in (sample.get("wilson") or ())
        need = _units_to_tell(rule, interval, n, wilson=wilson) if low != high else None
        if low != high:
            needs.append(need)
        lines.append(_line(rule, interval, low, high, need, sample, per_sample))
    if not lines:  # nothing judged is no pass: e.g. an engine that returned no log-probabilities
        return Judgement(verdict=CANNOT_TELL, possible=OUTCOMES, lines=("no figure its rules judge was measured",))
    possible = tuple(o for o in OUTCOMES if o in overall)
    if len(possible) == 1:
        return Judgement(verdict=possible[0], possible=possible, lines=tuple(lines))
    # every undecided rule must clear its lines; one whose estimate sits on a line never does
    needed = None if not needs or None in needs else max(x for x in needs if x is not None)
    samples = None if needed is None else -(-needed // per_sample)
    return Judgement(verdict=CANNOT_TELL, possible=possible, lines=tuple(lines), samples_needed=samples)


def _interval(figures: dict[str, Any], metric: str) -> Interval | None:
    value = (figures.get("metrics") or {}).get(metric)
    if value is None:
        return None
    low, high = (figures.get("intervals") or {}).get(metric) or [value, value]
    return Interval(
        value=float(value),
        low=UNBOUNDED[0] if low is None else float(low),
        high=UNBOUNDED[1] if high is None else float(high),
    )


def _units_to_tell(rule: Rule, interval: Interval, n: int, *, wilson: bool = False) -> int | None:
    """The units that clear every line the interval crosses (the nearest line takes the most)."""
    crossed = [line for line in rule.lines() if interval.low < line < interval.high]
    if not crossed:  # the interval ends on a line: one more unit tells
        return n + 1
    if wilson:
        needs = [wilson_samples_to_tell(interval.value, line, n) for line in crossed]
    else:
        needs = [samples_to_tell(interval, line, n) for line in crossed]
    return None if None in needs else max(x for x in needs if x is not None)


def _line(
    rule: Rule,
    interval: Interval,
    low: Outcome,
    high: Outcome,
    need: int | None,
    sample: dict[str, Any],
    per_sample: int,
) -> str:
    figure = f"{rule.metric}={interval.value:.4g} ({_end(interval.low)}-{_end(interval.high)})"
    if low == high:
        return f"{figure} {low} ({rule.describe()})"
    unit = sample.get("unit", "samples")
    tell = (
        f"about {need} {unit} (--samples {-(-need // per_sample)}) would tell"
        if need is not None
        else "its estimate sits on a line: no sample size tells"
    )
    left = [o for o in OUTCOMES if o in rule.possible(interval)]
    return f"{figure} cannot tell: {', '.join(left[:-1])} or {left[-1]} ({rule.describe()}); {tell}"


def _end(x: float) -> str:
    return "?" if x in UNBOUNDED else f"{x:.4g}"


def label(quality: dict[str, Any] | None) -> str | None:
    """The verdict in a word or three: "pass", "cannot tell (pass or warn)", "cannot tell (pass,
    warn or fail)"; None: not checked."""
    if not quality:
        return None
    verdict = quality.get("verdict")
    possible = list(quality.get("possible") or [])
    if verdict == CANNOT_TELL and len(possible) > 1:
        return f"{CANNOT_TELL} ({', '.join(possible[:-1])} or {possible[-1]})"
    return verdict


def outcomes_of(text: str | None) -> tuple[Outcome, ...]:
    """The outcomes a verdict label leaves: "pass" -> (pass,), "cannot tell (warn or fail)" ->
    (warn, fail); None or an unknown word -> (): not checked."""
    if not text:
        return ()
    return tuple(o for o in OUTCOMES if o in text.replace(CANNOT_TELL, ""))


def tune_exclusion(text: str | None, level: str) -> str | None:
    """Why `accelab tune` leaves a plan out for its quality verdict label under `--quality
    level`, or None to keep it. A gate keeps only what its check has shown acceptable: a plan
    that could still fail (that could warn, under strict) is left out, "cannot tell" included;
    the verdict's line says how many samples would tell."""
    outcomes = outcomes_of(text)
    if level == "off" or not outcomes:
        return None
    bad = ("warn", "fail") if level == "strict" else ("fail",)
    if not any(o in bad for o in outcomes):
        return None
    if len(outcomes) == 1:
        return f"quality {'failed' if outcomes[0] == 'fail' else 'warned (strict)'}"
    return f"quality {text}: it may {' or '.join(o for o in outcomes if o in bad)} ({level})"
