"""Does a training plan still learn like the baseline, and how soon does it reach the baseline's
eval score? Pure: no torch, no I/O.

Each run (a baseline seed or a candidate plan) is a `Curve`: the mean training loss of every
optimizer step, the global batch, and the evals the worker recorded along the way.

1. Samples, not steps. Plans may differ in global batch, so curves are compared on samples seen
   (step i, counted from 1, has seen i x global batch samples).
2. Smoothing. One step's loss is the mean over one batch, so it is noisy. Each curve is smoothed
   by a centred moving mean over a window of `Band.window` samples (WINDOW_SHARE of the baseline's
   run, at least one step): a plan at 4x the batch averages 4x fewer steps, so both average the
   same amount of data and keep about the same noise. A mean rather than a median: the mean over
   a window of steps is the loss over those samples, and it keeps a loss spike visible.
3. Common grid. Each smoothed curve is interpolated linearly onto GRID_POINTS evenly spaced
   sample counts that every baseline seed covers; a candidate is judged on the grid points
   within its own run.
4. The band (`Band.of`, 2+ baseline seeds): at each grid point, the seeds' mean
   +- max(SPREAD x their standard deviation, FLOOR x the mean). The seeds' variance is pooled
   over the grid points within POOL of the grid on either side: two seeds' curves cross here
   and there, and the pointwise spread there is near zero although the seed-to-seed spread
   changes slowly along a run (on synthetic pairs of seeds, pooling cut the share of fresh
   baseline seeds judged "slower" from ~2% to ~0.3%). SPREAD is 3 because a standard deviation
   from two or three seeds is a rough estimate and a new seed of the baseline should fall
   inside; the floor (2% of the loss) keeps two nearly equal seeds (same data order,
   deterministic kernels) from giving a band so thin that any noise leaves it.
5. The verdict (`judge`), the first rule that applies:
   - "diverges": a non-finite loss; or the final smoothed loss is above the first (no learning);
     or far above the band: at the last compared point the loss is above the band's top by more
     than FAR x the baseline's drop in loss over the compared range (it kept less than half of
     the progress);
   - "slower to converge": above the band's top at SLOWER_SHARE or more of the grid points of the
     late part (samples past LATE_FROM of the compared range);
   - "converges like the baseline": otherwise. Below the band is fine: learning faster is not a
     fault.
6. Eval scores: `target_score` (the baseline's final score) and `time_to_target` (training wall
   time until a run's evals reach it: the headline figure, beside samples/s); the candidate's
   score against the baseline seeds', with an interval, is `eval_interval.eval_difference`.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

import numpy as np

Label = Literal["converges like the baseline", "slower to converge", "diverges"]
Metric = Literal["accuracy", "loss", "perplexity"]
HIGHER_IS_BETTER: dict[Metric, bool] = {"accuracy": True, "loss": False, "perplexity": False}
METRICS: tuple[Metric, ...] = get_args(Metric)

WINDOW_SHARE = 0.05  # smoothing window, as a share of the baseline's samples
GRID_POINTS = 50
SPREAD = 3.0  # band half-width in seed standard deviations
POOL = 0.1  # the seeds' variance is averaged over this share of the grid on either side
FLOOR = 0.02  # least band half-width, as a share of the band's centre
LATE_FROM = 0.5  # the late part: the second half of the compared samples
SLOWER_SHARE = 0.5  # share of the late part above the band that makes "slower to converge"
FAR = 0.5  # "far above": above the top by more than this share of the baseline's drop
MIN_POINTS = 4  # grid points a candidate must cover to be judged


@dataclass(frozen=True, kw_only=True, slots=True)
class Eval:
    """One evaluation during training. `wall_s`: training wall time up to it, eval time excluded."""

    step: int
    wall_s: float
    loss: float
    accuracy: float | None = None
    perplexity: float | None = None
    eval_samples: int = 0  # the eval set's size (the worker's "samples")

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> Eval:
        missing = [key for key in ("step", "wall_s", "loss") if record.get(key) is None]
        if missing:
            raise ValueError(f"eval record {dict(record)} lacks {', '.join(missing)}: the worker must record them")
        return cls(
            step=int(record["step"]),
            wall_s=float(record["wall_s"]),
            loss=float(record["loss"]),
            accuracy=_optional_float(record.get("accuracy")),
            perplexity=_optional_float(record.get("perplexity")),
            eval_samples=int(record.get("samples") or 0),
        )

    def score(self, metric: Metric) -> float:
        value = {"accuracy": self.accuracy, "loss": self.loss, "perplexity": self.perplexity}[_metric(metric)]
        if value is None:
            raise ValueError(f"the eval at step {self.step} recorded no {metric}; pick one it has: {self._has()}")
        return value

    def _has(self) -> str:
        return " | ".join(m for m in METRICS if getattr(self, m) is not None)


@dataclass(frozen=True, kw_only=True, slots=True)
class Curve:
    """One run: per optimizer step the mean training loss, the global batch, and its evals."""

    losses: tuple[float, ...]
    global_batch: int
    evals: tuple[Eval, ...] = ()

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise ValueError(f"global_batch={self.global_batch} must be at least 1 (samples per optimizer step)")
        if not self.losses:
            raise ValueError("a curve needs the training loss of at least one optimizer step; none was recorded")

    @classmethod
    def of(cls, losses: Sequence[float], global_batch: int, evals: Sequence[Mapping[str, Any]] = ()) -> Curve:
        """From what the training worker records (its summary's "losses" and "evals")."""
        return cls(losses=tuple(float(x) for x in losses), global_batch=global_batch, evals=tuple(map(Eval.of, evals)))

    @property
    def samples(self) -> np.ndarray:
        """Samples seen after each step: [steps]."""
        return np.arange(1, len(self.losses) + 1, dtype=float) * self.global_batch

    def first_non_finite(self) -> int | None:
        """The index of the first NaN or infinite loss, None when all are finite."""
        bad = np.flatnonzero(~np.isfinite(np.asarray(self.losses)))
        return int(bad[0]) if bad.size else None

    def smoothed(self, window: float) -> np.ndarray:
        """Centred moving mean over `window` samples (at least one step), cut short at both ends."""
        values = np.asarray(self.losses, dtype=float)
        half = max(1, round(window / self.global_batch)) // 2
        sums = np.concatenate([[0.0], np.cumsum(values)])
        index = np.arange(len(values))
        lo, hi = np.maximum(index - half, 0), np.minimum(index + half + 1, len(values))
        return (sums[hi] - sums[lo]) / (hi - lo)

    def on_grid(self, grid: np.ndarray, window: float) -> np.ndarray:
        """The smoothed loss at each sample count of `grid` (inside this run), linearly interpolated."""
        return np.interp(grid, self.samples, self.smoothed(window))

    def final(self, metric: Metric) -> float:
        if not self.evals:
            raise ValueError("this run recorded no evals; train it with evals (--eval-every) to get a score")
        return self.evals[-1].score(metric)


@dataclass(frozen=True, kw_only=True, slots=True)
class Band:
    """The baseline's smoothed loss on a grid of samples seen, with the seeds' spread around it."""

    grid: tuple[float, ...]  # samples seen
    center: tuple[float, ...]  # the seeds' mean
    low: tuple[float, ...]
    high: tuple[float, ...]
    window: float  # the smoothing window, in samples, for every curve judged against this band
    seeds: int

    @classmethod
    def of(
        cls,
        baselines: Sequence[Curve],
        *,
        spread: float = SPREAD,
        floor: float = FLOOR,
        points: int = GRID_POINTS,
        window_share: float = WINDOW_SHARE,
    ) -> Band:
        if len(baselines) < 2:
            raise ValueError(
                f"the convergence band needs the baseline's seed-to-seed spread: got {len(baselines)} seed(s); "
                "run the baseline with 2 or more seeds"
            )
        for i, curve in enumerate(baselines):
            bad = curve.first_non_finite()
            if bad is not None:
                raise ValueError(
                    f"baseline seed {i} has a non-finite loss at step {bad + 1}: the baseline itself diverged; "
                    "fix its learning rate before judging plans against it"
                )
        start = max(curve.global_batch for curve in baselines)
        end = min(curve.samples[-1] for curve in baselines)
        if end <= start:
            raise ValueError(f"the baseline runs cover {end:,.0f} samples: train them for more than one step")
        window = float(max(window_share * end, start))
        grid = np.linspace(start, end, points)
        curves = np.stack([curve.on_grid(grid, window) for curve in baselines])  # [seeds, points]
        center = curves.mean(axis=0)
        spread_sd = np.sqrt(_pooled(curves.var(axis=0, ddof=1), reach=round(POOL * points)))
        half = np.maximum(spread * spread_sd, floor * np.abs(center))
        return cls(
            grid=tuple(grid.tolist()),
            center=tuple(center.tolist()),
            low=tuple((center - half).tolist()),
            high=tuple((center + half).tolist()),
            window=window,
            seeds=len(baselines),
        )


def _pooled(variance: np.ndarray, reach: int) -> np.ndarray:
    """The mean of the variance over the grid points within `reach` of each point (fewer at the ends)."""
    kernel = np.ones(2 * reach + 1)
    return np.convolve(variance, kernel, "same") / np.convolve(np.ones_like(variance), kernel, "same")


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    label: Label
    reason: str  # one line, with the numbers
    samples: int  # the last compared point (or where the loss stopped being finite)
    loss: float | None  # the candidate's smoothed loss there (None: not finite)
    band_low: float  # the band there
    band_high: float
    late_share_above: float | None  # share of the late part's grid points above the band

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def judge(
    candidate: Curve,
    band: Band,
    *,
    late_from: float = LATE_FROM,
    slower_share: float = SLOWER_SHARE,
    far: float = FAR,
) -> Verdict:
    """The candidate's loss curve against the baseline's band (the rules in the module docstring)."""
    bad = candidate.first_non_finite()
    if bad is not None:
        return _not_finite(candidate, band, bad)
    grid = np.asarray(band.grid)
    inside = _covered(candidate, grid)
    grid, center = grid[inside], np.asarray(band.center)[inside]
    high, low = np.asarray(band.high)[inside], np.asarray(band.low)[inside]
    smooth = candidate.smoothed(band.window)
    loss = np.interp(grid, candidate.samples, smooth)
    late = grid >= grid[0] + late_from * (grid[-1] - grid[0])
    share = float(np.mean(loss[late] > high[late]))
    where = f"loss {loss[-1]:#.3g} at {grid[-1]:,.0f} samples, band {low[-1]:#.3g}-{high[-1]:#.3g}"

    def verdict(label: Label, reason: str) -> Verdict:
        return Verdict(
            label=label,
            reason=reason,
            samples=round(grid[-1]),
            loss=float(loss[-1]),
            band_low=float(low[-1]),
            band_high=float(high[-1]),
            late_share_above=share,
        )

    if smooth[-1] > smooth[0]:
        start, end = f"{smooth[0]:#.3g}", f"{smooth[-1]:#.3g}"
        return verdict("diverges", f"no learning: smoothed loss {end} at the end, above its start {start}; {where}")
    drop = float(center[0] - center[-1])
    if drop > 0 and loss[-1] - high[-1] > far * drop:
        rule = f"more than {far:.0%} of the baseline's drop ({drop:#.3g}) above its top"
        return verdict("diverges", f"far above the band: {where}, {rule}")
    above = f"above the band at {share:.0%} of the late part"
    if share >= slower_share:
        return verdict("slower to converge", f"{where}; {above} (rule: {slower_share:.0%})")
    if loss[-1] < low[-1]:
        return verdict("converges like the baseline", f"{where}; below the band: learns faster")
    return verdict("converges like the baseline", f"{where}; {above}")


def _covered(candidate: Curve, grid: np.ndarray) -> np.ndarray:
    """The grid points within the candidate's run: [points] bool; ValueError when fewer than MIN_POINTS."""
    inside = (grid >= candidate.samples[0]) & (grid <= candidate.samples[-1])
    if inside.sum() < MIN_POINTS:
        raise ValueError(
            f"the plan's run covers {candidate.samples[0]:,.0f}-{candidate.samples[-1]:,.0f} samples, the "
            f"baseline's {grid[0]:,.0f}-{grid[-1]:,.0f}: train the plan for as many samples as the baseline"
        )
    return inside


def _not_finite(candidate: Curve, band: Band, bad: int) -> Verdict:
    samples = (bad + 1) * candidate.global_batch
    return Verdict(
        label="diverges",
        reason=f"loss {candidate.losses[bad]} at step {bad + 1} ({samples:,} samples): training diverged",
        samples=samples,
        loss=None,
        band_low=float(np.interp(samples, band.grid, band.low)),
        band_high=float(np.interp(samples, band.grid, band.high)),
        late_share_above=None,
    )


def target_score(baselines: Sequence[Curve], metric: Metric) -> float:
    """The baseline's final eval score, the mean over its seeds: the target of `time_to_target`.
    Half the baseline seeds end short of their own mean, so expect None from some of them."""
    if not baselines:
        raise ValueError("a target score needs at least one baseline run")
    return statistics.fmean(curve.final(metric) for curve in baselines)


def time_to_target(evals: Sequence[Eval], target: float, metric: Metric) -> float | None:
    """Training wall time until the evals reach `target` (accuracy at or above it; loss or
    perplexity at or below), None when no eval does.

    Linearly interpolated between the last eval short of the target and the first that reaches
    it: evals are spaced in steps, so plans at different speeds or batches are evaluated at
    different wall times, and reading the time off the first eval would charge each plan for its
    own eval spacing. When the first eval already reaches it, its wall time (nothing earlier to
    interpolate from: an upper bound)."""
    sign = 1.0 if HIGHER_IS_BETTER[_metric(metric)] else -1.0
    gap_before, wall_before = None, 0.0
    for ev in evals:
        gap = sign * (ev.score(metric) - target)  # >= 0: reached
        if gap >= 0:
            if gap_before is None:
                return ev.wall_s
            return wall_before + (ev.wall_s - wall_before) * -gap_before / (gap - gap_before)
        gap_before, wall_before = gap, ev.wall_s
    return None


def _metric(metric: str) -> Metric:
    if metric not in HIGHER_IS_BETTER:
        raise ValueError(f"metric={metric!r} is not one of {' | '.join(METRICS)}")
    return metric  # narrowed to Metric by the membership test


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
