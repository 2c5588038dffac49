"""Scoring windows with the model, however it is laid out, and the harness's metrics from the results.

Two batch shapes. Unpacked (one process, FSDP, TP, EP): one window per row, rows sorted by length and
right-padded to the batch's longest, as the harness batches (plain causal attention, the cheapest). Packed
(pipeline or context parallel, which need rows of exactly the training sequence length): windows are packed into rows of the training sequence length, several per row, each its own document
(block-causal attention through `document_ids`, positions restarting at 0 through `positions`), so a short
multiple-choice request costs its own tokens, not a padded row. Labels are the window's targets at its last
positions and IGNORE_INDEX elsewhere; `source_ids` give each window of a batch its own slot, and the model's
per-source loss sums (the path a data mixture's per-source validation loss takes, through pipeline stages,
context-parallel shards and tensor-parallel logits alike) are then each window's negative log-likelihood.

Batches are cut the same way on every rank and dealt round-robin over the data-parallel ranks (`shard`):
every rank runs the same number of forward passes (FSDP's gathers and the pipeline's sends pair up), a rank
short of one runs an empty batch, and so does a rank whose batch could not be built (its error is raised after
its last forward, so the other ranks are not left waiting in a collective; runner.py then has every rank agree
that the task failed). Each rank writes its windows' sums into one vector of every window, and one sum over the
data-parallel and context-parallel ranks completes it.
"""

import math
from collections.abc import Callable

import torch

from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.eval.requests import TaskRequests, Window

# forward_sums(inputs, labels, num_sources) -> [2, num_sources] (summed token loss, token count) per source
ForwardSums = Callable[[dict, torch.Tensor, int], torch.Tensor]


def pack(windows: list[Window], seq_len: int, batch_size: int, pad_id: int) -> list[list[list[int]]]:
    """Batches of rows of window indices: windows longest first, each into the first row of the current batch
    with room (first-fit), a new batch when none has."""
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i].tokens))
    batches: list[list[list[int]]] = []
    room: list[int] = []
    for i in order:
        n = len(windows[i].tokens)
        row = next((r for r, free in enumerate(room) if free >= n), None)
        if row is None:
            if not batches or len(batches[-1]) == batch_size:
                batches.append([])
                room = []
            batches[-1].append([])
            room.append(seq_len)
            row = len(room) - 1
        batches[-1][row].append(i)
        room[row] -= n
    return batches


def batch_tensors(rows: list[list[int]], windows: list[Window], seq_len: int, batch_size: int,
                  pad_id: int) -> tuple[dict, torch.Tensor, int]:
    """(inputs {tokens, document_ids, positions, source_ids}, labels, number of windows) of one packed batch;
    source i is the batch's i-th window in row order. Empty rows pad the batch to `batch_size`."""
    tokens = torch.full((batch_size, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((batch_size, seq_len), IGNORE_INDEX, dtype=torch.long)
    docs = torch.zeros((batch_size, seq_len), dtype=torch.long)
    positions = torch.zeros((batch_size, seq_len), dtype=torch.long)
    sources = torch.zeros((batch_size, seq_len), dtype=torch.long)
    slot = 0
    for r, row in enumerate(rows):
        at = 0
        for d, i in enumerate(row, start=1):
            w = windows[i]
            n = len(w.tokens)
            tokens[r, at:at + n] = torch.tensor(w.tokens)
            labels[r, at + n - len(w.targets):at + n] = torch.tensor(w.targets)
            docs[r, at:at + n] = d
            positions[r, at:at + n] = torch.arange(n)
            sources[r, at:at + n] = slot
            slot += 1
            at += n
        docs[r, at:] = len(row) + 1  # the padding is a document of its own
        positions[r, at:] = torch.arange(seq_len - at)
    inputs = {"tokens": tokens, "document_ids": docs, "positions": positions, "source_ids": sources}
    return inputs, labels, max(slot, 1)


def group(windows: list[Window], token_budget: int) -> list[list[list[int]]]:
    """Batches of one window per row, longest first, as many rows as fit `token_budget` at the batch's
    longest row (the harness's length-sorted batches): no packing, so plain causal attention."""
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i].tokens))
    batches: list[list[list[int]]] = []
    while order:
        rows = max(token_budget // len(windows[order[0]].tokens), 1)
        batches.append([[i] for i in order[:rows]])
        order = order[rows:]
    return batches


def row_tensors(rows: list[list[int]], windows: list[Window], pad_id: int,
                row_multiple: int = 1) -> tuple[dict, torch.Tensor, int]:
    """(inputs {tokens, source_ids}, labels, number of windows) of a batch of one window per row, right-padded
    to its longest row rounded up to `row_multiple` (tensor parallel's sequence parallel splits the sequence
    over the tp ranks); an empty batch is one padding row (labels all ignored)."""
    length = max((len(windows[r[0]].tokens) for r in rows), default=1)
    length = -(-length // row_multiple) * row_multiple
    tokens = torch.full((max(len(rows), 1), length), pad_id, dtype=torch.long)
    labels = torch.full_like(tokens, IGNORE_INDEX)
    sources = torch.zeros_like(tokens)
    for r, (i,) in enumerate(rows):
        w = windows[i]
        n = len(w.tokens)
        tokens[r, :n] = torch.tensor(w.tokens)
        labels[r, n - len(w.targets):n] = torch.tensor(w.targets)
        sources[r] = r
    return {"tokens": tokens, "source_ids": sources}, labels, max(len(rows), 1)


def shard(batches: list, rank: int, degree: int) -> list:
    """This data-parallel rank's batches (round-robin), padded with empty ones to the same count on every rank."""
    count = -(-len(batches) // degree)
    mine = batches[rank::degree]
    return mine + [[]] * (count - len(mine))


def score_windows(windows: list[Window], forward_sums: ForwardSums, *, seq_len: int, batch_size: int,
                  pad_id: int, dp_rank: int = 0, dp_degree: int = 1,
                  reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
                  device: torch.device | str = "cpu", packed: bool = True, row_multiple: int = 1) -> torch.Tensor:
    """The log-likelihood of every window (float64 [len(windows)]), the same on every rank. `packed`: rows of
    exactly `seq_len` holding several windows (what pipeline stages and context-parallel shards need); else
    one window per row, batches of at most batch_size x seq_len tokens (cheaper: plain causal attention), rows
    padded to a multiple of `row_multiple`."""
    if packed:
        batches = pack(windows, seq_len, batch_size, pad_id)
    else:
        batches = group(windows, batch_size * seq_len)
    total = torch.zeros(len(windows), dtype=torch.float32, device=device)
    error = None
    for rows in shard(batches, dp_rank, dp_degree):
        batch = None
        if error is None:
            try:
                batch = _batch(rows, windows, seq_len, batch_size, pad_id, packed, row_multiple)
            except Exception as e:  # noqa: BLE001 - this rank's failure, raised once its forwards have run
                error = e
        inputs, labels, n = batch or _blank(rows, windows, seq_len, batch_size, pad_id, packed, row_multiple)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        sums = forward_sums(inputs, labels.to(device), n)
        ids = [i for row in rows for i in row]
        if ids and batch is not None:
            total[torch.tensor(ids, device=device)] += sums[0, :len(ids)].to(total.device)
    if error is not None:
        raise error
    return -reduce_sum(total).double().cpu()


def _batch(rows, windows, seq_len, batch_size, pad_id, packed, row_multiple):
    if packed:
        return batch_tensors(rows, windows, seq_len, batch_size, pad_id)
    return row_tensors(rows, windows, pad_id, row_multiple)


def _blank(rows, windows, seq_len, batch_size, pad_id, packed, row_multiple):
    """Padding of the shape `_batch` gives `rows`, with as many sources (tensor-parallel ranks run the same
    shapes, pipeline stages sum [2, sources] vectors together), nothing scored: the forward a rank runs in place
    of a batch it could not build."""
    if packed:
        shape = (batch_size, seq_len)
    else:
        length = max((len(windows[r[0]].tokens) for r in rows), default=1)
        shape = (max(len(rows), 1), -(-length // row_multiple) * row_multiple)
    tokens = torch.full(shape, pad_id, dtype=torch.long)
    inputs = {"tokens": tokens, "source_ids": torch.zeros_like(tokens)}
    if packed:
        inputs["document_ids"] = torch.ones_like(tokens)
        inputs["positions"] = torch.arange(shape[1]).expand(shape).contiguous()
    return inputs, torch.full_like(tokens, IGNORE_INDEX), max(sum(len(row) for row in rows), 1)


# ---- the harness's metrics ------------------------------------------------------------------------------
def _mean_and_stderr(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var) / math.sqrt(n)


def request_loglikelihoods(reqs: TaskRequests, window_ll: torch.Tensor) -> list[float]:
    out = [0.0] * len(reqs.pairs)
    for w, ll in zip(reqs.windows, window_ll.tolist()):
        out[w.request] += ll
    return out


def task_metrics(reqs: TaskRequests, lls: list[float]) -> dict[str, float]:
    """{metric: value, metric_stderr: value} as lm-evaluation-harness aggregates them: acc/acc_norm/acc_bytes
    means with the sample standard error; perplexity exp(-mean ll); word/byte perplexity exp(-sum ll / sum
    words|bytes), bits_per_byte -sum ll / sum bytes / ln 2 (their stderrs are bootstrapped: bootstrap.py)."""
    task = reqs.task
    out: dict[str, float] = {}
    if task.output_type == "multiple_choice":
        per_doc: dict[int, list[float]] = {}
        for doc, ll in zip(reqs.doc_of_request, lls):
            per_doc.setdefault(doc, []).append(ll)
        scores: dict[str, list[float]] = {m: [] for m in task.metrics}
        for doc_index, doc_lls in sorted(per_doc.items()):
            doc = task.docs[doc_index]
            choices = task.choices(doc)
            gold = task.gold(doc)
            norms = {"acc": [1.0] * len(choices), "acc_norm": [float(len(c)) for c in choices],
                     "acc_bytes": [float(len(c.encode("utf-8"))) for c in choices]}
            for m in task.metrics:
                values = [ll / d for ll, d in zip(doc_lls, norms[m])]
                pred = max(range(len(values)), key=lambda j: (values[j], -j))  # the first maximum, as argmax
                scores[m].append(1.0 if pred == gold else 0.0)
        for m, values in scores.items():
            out[m], out[f"{m}_stderr"] = _mean_and_stderr(values)
    elif task.output_type == "loglikelihood":
        out["perplexity"] = math.exp(-sum(lls) / len(lls))
    else:
        import re

        total = sum(lls)
        words = sum(len(re.split(r"\s+", text)) for text in reqs.pairs)
        nbytes = sum(len(text.encode("utf-8")) for text in reqs.pairs)
        for m in task.metrics:
            if m == "word_perplexity":
                out[m] = math.exp(-total / words)
            elif m == "byte_perplexity":
                out[m] = math.exp(-total / nbytes)
            else:
                out[m] = -total / nbytes / math.log(2)
    return out
