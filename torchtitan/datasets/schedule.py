"""Mixture schedules: the weights of a mixture as a function of the training step.

A schedule is phase 0 (the `training.datasets` weights, from step 0) followed by the phases of
`training.mixture_phases`, each written as one string of space-separated fields:

    "step=90000 web:0.4 code:0.3 curated:0.3 ramp=1000"

From step 90,000 the weights move linearly, over 1,000 steps, from those in force at step 89,999 to the
phase's (ramp=0 or no ramp: at once, piecewise-constant). A phase lists the weights of the whole mixture:
a source it does not name gets weight 0 (it is not read in that phase). Sources are named as in
`training.datasets` (a dataset name or a shard folder), or by the name their loss is logged under (a shard
folder's last path component). `training.mixture_anneal` is the annealing preset: a last phase with its
weights, starting at the step where the LR schedule starts decaying (Llama 3 anneals on upsampled
high-quality data while the LR goes to zero).

Weights are normalised per phase. The step -> weights function does not depend on the steps after it, so
a run extended with a new phase keeps the weights (hence the samples) of every step before that phase.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from torchtitan.components.optim.lr_scheduler import decay_steps
from torchtitan.config.job_config import JobConfig


@dataclass(frozen=True)
class Phase:
    start: int  # first step (0-based: optimizer steps taken before it) the phase applies to
    weights: tuple[float, ...]  # one per mixture source, in mixture order, summing to 1
    ramp: int = 0  # steps over which the weights move linearly from the previous phase's to these


def source_weight(entry: str) -> tuple[str, float]:
    """"SOURCE:WEIGHT" -> (source, weight), the weight -1 where it does not parse (a path may hold ':')."""
    source, sep, value = entry.rpartition(":")
    try:
        weight = float(value) if sep and source else -1.0
    except ValueError:
        weight = -1.0
    return source, weight if math.isfinite(weight) else -1.0


def _weights(fields: list[str], names: list[list[str]], what: str) -> tuple[float, ...]:
    """"SOURCE:WEIGHT" fields -> weights in mixture order (unnamed sources 0), normalised."""
    out = [0.0] * len(names)
    for f in fields:
        source, weight = source_weight(f)
        if weight < 0:
            raise ValueError(f"{what}: {f!r} must be SOURCE:WEIGHT with a weight >= 0, e.g. web:0.4")
        index = next((i for i, aliases in enumerate(names) if source in aliases), None)
        if index is None:
            known = ", ".join(aliases[0] for aliases in names)
            raise ValueError(f"{what} names source {source!r}, which is not in --training.datasets ({known})")
        out[index] = weight
    total = sum(out)
    if total <= 0:
        raise ValueError(f"{what} gives no source a positive weight")
    return tuple(w / total for w in out)


def _int_field(field: str, key: str, what: str) -> int:
    try:
        value = int(field[len(key) + 1:])
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{what}: {field!r} must be {key}=N with N a whole number >= 0")
    return value


def parse_phase(text: str, names: list[list[str]]) -> Phase:
    """One `training.mixture_phases` entry; ValueError with one line naming what is wrong."""
    what = f"--training.mixture_phases entry {text!r}"
    start, ramp, weights = None, 0, []
    for field in text.split():
        if field.startswith("step="):
            start = _int_field(field, "step", what)
        elif field.startswith("ramp="):
            ramp = _int_field(field, "ramp", what)
        else:
            weights.append(field)
    if start is None:
        raise ValueError(f"{what} needs step=N, the step it starts at, e.g. 'step=90000 web:0.4 code:0.6 ramp=1000'")
    return Phase(start, _weights(weights, names, what), ramp)


def source_aliases(source: str) -> list[str]:
    """Names a phase may use for a mixture entry: the entry itself and the name its loss is logged under."""
    name = Path(source).name if "/" in source else source
    return [source, name] if name != source else [source]


@dataclass(frozen=True)
class MixtureSchedule:
    """Phases in order, the first starting at step 0."""

    phases: tuple[Phase, ...]

    @staticmethod
    def constant(weights: list[float]) -> MixtureSchedule:
        total = sum(weights)
        return MixtureSchedule((Phase(0, tuple(w / total for w in weights)),))

    def phase_index(self, step: int) -> int:
        return max(i for i, p in enumerate(self.phases) if p.start <= step)

    def weights_at(self, step: int) -> tuple[float, ...]:
        return self.phase_weights(self.phase_index(step), step)

    def phase_weights(self, i: int, step: int) -> tuple[float, ...]:
        """The weights phase i gives `step` (also past the phase's end: they depend on no later phase)."""
        phase = self.phases[i]
        if phase.ramp == 0 or step - phase.start + 1 >= phase.ramp:
            return phase.weights
        before = self.weights_at(phase.start - 1)
        t = max(step - phase.start + 1, 0) / phase.ramp  # the ramp's last step trains on the phase's weights
        return tuple(a + (b - a) * t for a, b in zip(before, phase.weights))


def anneal_start(cfg: JobConfig) -> int:
    """The step the LR schedule starts decaying at (where `training.mixture_anneal` starts)."""
    s = cfg.lr_scheduler
    return cfg.training.steps - decay_steps(
        warmup_steps=s.warmup_steps, total_steps=cfg.training.steps, decay_ratio=s.decay_ratio
    )


def mixture_schedule(cfg: JobConfig, mixture: list[tuple[str, float]]) -> MixtureSchedule:
    """The schedule of `training.datasets` + `mixture_phases` + `mixture_anneal`; ValueError with one line for
    weights that do not parse, an unknown source, or phases out of order."""
    t = cfg.training
    if (t.mixture_phases or t.mixture_anneal) and not t.datasets:
        raise ValueError("--training.mixture_phases / mixture_anneal reweight a mixture: set --training.datasets")
    names = [source_aliases(s) for s, _ in mixture]
    phases = [MixtureSchedule.constant([w for _, w in mixture]).phases[0]]
    phases += [parse_phase(p, names) for p in t.mixture_phases]
    if t.mixture_anneal:
        if cfg.lr_scheduler.decay_ratio is None:
            raise ValueError(
                "--training.mixture_anneal starts where the LR starts decaying, but without "
                "--lr_scheduler.decay_ratio the LR decays from the end of warmup on; set decay_ratio (e.g. 0.1)"
            )
        phases.append(Phase(anneal_start(cfg), _weights(t.mixture_anneal, names, "--training.mixture_anneal")))
    for before, phase in zip(phases, phases[1:]):
        if phase.start <= before.start:
            where = "the LR decay start of --training.mixture_anneal" if phase is phases[-1] and t.mixture_anneal \
                else "--training.mixture_phases"
            raise ValueError(
                f"{where}: a phase starting at step {phase.start} comes after one starting at step {before.start}; "
                f"phases must start at increasing steps (the first after step 0)"
            )
    return MixtureSchedule(tuple(phases))
