"""Bootstrapped standard errors of the perplexity-like metrics, by lm-evaluation-harness's estimator.

The harness (lm_eval/api/metrics.py, `bootstrap_stderr`) resamples the per-document items with replacement,
in chunks of min(1000, iters) draws, the i-th chunk from `random.Random(i)` (`choices(items, k=len(items))`
per draw; iters // chunk chunks, so a remainder is dropped), recomputes the metric's aggregate on every
resample, and reports the sample standard deviation (Bessel-corrected) of those replicates. The same seeds and
the same draws here give the same replicates, so the same numbers.

Items and aggregates, as the harness defines them:
- `perplexity` (loglikelihood tasks): the request's log-likelihood; exp(-mean).
- `word_perplexity`, `byte_perplexity` (rolling): (document log-likelihood, its words | UTF-8 bytes);
  exp(-sum ll / sum units). `bits_per_byte`: -sum ll / sum bytes / ln 2.
lm-eval 0.4.13 bootstraps `perplexity` only (its list of bootstrappable aggregates leaves out
weighted_perplexity and bits_per_byte, so it reports N/A for the rolling ones); the same estimator is applied
to the rolling aggregates here, which is what its bootstrap would give for them.
"""

import math
import random
import re

from torchtitan.eval.requests import TaskRequests


def bootstrap_stderr(statistic, n: int, iters: int) -> float:
    """Sample standard deviation of `statistic(indices)` over the harness's resamples of range(n): chunks of
    min(1000, iters) draws, chunk i drawn from random.Random(i). NaN with fewer than 2 items or replicates."""
    chunk = min(1000, iters)
    if n < 2 or chunk < 1 or iters // chunk * chunk < 2:
        return float("nan")
    population = range(n)
    replicates = []
    for i in range(iters // chunk):
        rnd = random.Random(i)
        for _ in range(chunk):
            replicates.append(statistic(rnd.choices(population, k=n)))
    mean = sum(replicates) / len(replicates)
    return math.sqrt(sum((r - mean) ** 2 for r in replicates) / (len(replicates) - 1))


def _ratio(values: list[float], units: list[int]):
    def statistic(idx: list[int]) -> float:  # summed in draw order, as the harness sums its resample
        return sum(values[i] for i in idx) / sum(units[i] for i in idx)

    return statistic


def task_stderrs(reqs: TaskRequests, lls: list[float], iters: int) -> dict[str, float]:
    """{"<metric>_stderr": value} for the task's bootstrapped metrics (perplexity, word/byte perplexity, bits
    per byte); {} when iters is 0 or the task has none (multiple choice has closed-form stderrs)."""
    task = reqs.task
    if iters <= 0 or task.output_type == "multiple_choice":
        return {}
    if task.output_type == "loglikelihood":
        mean_ll = _ratio(lls, [1] * len(lls))
        return {"perplexity_stderr": bootstrap_stderr(lambda idx: math.exp(-mean_ll(idx)), len(lls), iters)}
    words = [len(re.split(r"\s+", text)) for text in reqs.pairs]
    nbytes = [len(text.encode("utf-8")) for text in reqs.pairs]
    out = {}
    for m in task.metrics:
        per_unit = _ratio(lls, words if m == "word_perplexity" else nbytes)
        if m == "bits_per_byte":
            statistic = lambda idx, f=per_unit: -f(idx) / math.log(2)  # noqa: E731
        else:
            statistic = lambda idx, f=per_unit: math.exp(-f(idx))  # noqa: E731
        out[f"{m}_stderr"] = bootstrap_stderr(statistic, len(lls), iters)
    return out
