"""Scoring windows with the model, however it is laid out, and the harness's metrics from the results.

Windows first become rows (`share_rows`): a window whose tokens equal another's, or are a prefix of
another's in the same task, is read from that one's row instead of being scored on its own (the harness's
hf model reads requests with one input row from one forward; causal attention makes a row's logits at its
first n positions those of its first n tokens). A multiple-choice document whose choices are single tokens
(" A", " B", ...) is one row. Positions that several windows read carry several (label, source) slots.

Two batch shapes. Unpacked (one process, FSDP, TP, EP): one row per batch row, sorted by length and
right-padded to the batch's longest, as the harness batches (plain causal attention, the cheapest). Packed
(pipeline or context parallel, which need rows of exactly the training sequence length): rows are packed into
batch rows of the training sequence length, several per batch row, each its own document (block-causal
attention through `document_ids`, positions restarting at 0 through `positions`), so a short multiple-choice
request costs its own tokens, not a padded row. Labels are each window's targets at its span of its row
(`read_span`) and IGNORE_INDEX elsewhere; `source_ids` give each window of a batch its own source, and the
model's per-source loss sums (the path a data mixture's per-source validation loss takes, through pipeline
stages, context-parallel shards and tensor-parallel logits alike) are then each window's negative
log-likelihood.

Batches are cut the same way on every rank and dealt round-robin over the data-parallel ranks (`shard`):
every rank runs the same number of forward passes (FSDP's gathers and the pipeline's sends pair up), a rank
short of one runs an empty batch, and a rank whose batch could not be built runs padding of that batch's shapes
and source count instead (`_blank`; its error is raised after its last forward, so the other ranks are not left
waiting in a collective; runner.py then has every rank agree that the task failed). Each rank writes its windows' sums into one vector of every window, and one sum over the
data-parallel and context-parallel ranks completes it.
"""

import dataclasses
import math
from collections.abc import Callable

import torch

from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.eval.requests import TaskRequests, Window

# forward_sums(inputs, labels, num_sources) -> [2, num_sources] (summed token loss, token count) per source;
# labels (and inputs["source_ids"]) are [B, S], or [B, S, K] when positions carry K (label, source) slots.
ForwardSums = Callable[[dict, torch.Tensor, int], torch.Tensor]


@dataclasses.dataclass
class Row:
    """One input the model reads, and the windows whose log-likelihoods are read from its logits."""

    tokens: list[int]
    """The longest of its windows' tokens; every other window's tokens are a prefix of these."""
    windows: list[int]
    """Indices of the windows read from this row."""


def share_rows(windows: list[Window], share: bool = True) -> list[Row]:
    """The rows that score `windows`: a window whose tokens equal another's, or are a prefix of another's, is
    read from the longer one's row (causal attention: the logits at a row's first n positions depend on its
    first n tokens only, so they are the shorter window's own). The harness's hf model does the first (one
    row per context + continuation[:-1], `Collator(group_by="contexts")`), for a multiple-choice task whose
    choices are single tokens (" A", " B", ...) one row per document. `share=False`: one row per window.

    Sorted lexicographically, a sequence that is a prefix of others comes right before one of them (every
    sequence between it and an extension starts with it too), so one pass from the end finds them all."""
    if not share:
        return [Row(w.tokens, [i]) for i, w in enumerate(windows)]
    rows: list[Row] = []
    after: list[int] | None = None  # the tokens of the window visited before (the next in sorted order)
    for i in sorted(range(len(windows)), key=lambda i: windows[i].tokens, reverse=True):
        tokens = windows[i].tokens
        if after is not None and tokens == after[:len(tokens)]:
            rows[-1].windows.append(i)  # `after` is in rows[-1], whose tokens start with it
        else:
            rows.append(Row(tokens, [i]))
        after = tokens
    for row in rows:
        row.windows.sort()
    return rows


def read_span(window: Window) -> tuple[int, int]:
    """[start, end) of the positions of its row whose logits predict `window.targets`."""
    n = len(window.tokens)
    return n - len(window.targets), n


def label_slots(row: Row, windows: list[Window]) -> list[int]:
    """The label slot of each of the row's windows (in `row.windows` order): the first slot whose positions
    taken so far do not overlap the window's span; windows that read the same positions (the same token or
    other ones) get other slots."""
    taken: list[list[tuple[int, int]]] = []
    out = []
    for i in row.windows:
        a, b = read_span(windows[i])
        k = next((k for k, spans in enumerate(taken) if all(b <= x or y <= a for x, y in spans)), len(taken))
        if k == len(taken):
            taken.append([])
        taken[k].append((a, b))
        out.append(k)
    return out


def pack(rows: list[Row], seq_len: int, batch_size: int) -> list[list[list[int]]]:
    """Batches of packed rows of `rows` indices: rows longest first, each into the first packed row of the
    current batch with room (first-fit), a new batch when none has."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i].tokens))
    batches: list[list[list[int]]] = []
    room: list[int] = []
    for i in order:
        n = len(rows[i].tokens)
        line = next((r for r, free in enumerate(room) if free >= n), None)
        if line is None:
            if not batches or len(batches[-1]) == batch_size:
                batches.append([])
                room = []
            batches[-1].append([])
            room.append(seq_len)
            line = len(room) - 1
        batches[-1][line].append(i)
        room[line] -= n
    return batches


def group(rows: list[Row], token_budget: int) -> list[list[list[int]]]:
    """Batches of one row each per batch row, longest first, as many as fit `token_budget` at the batch's
    longest (the harness's length-sorted batches): no packing, so plain causal attention."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i].tokens))
    batches: list[list[list[int]]] = []
    while order:
        count = max(token_budget // len(rows[order[0]].tokens), 1)
        batches.append([[i] for i in order[:count]])
        order = order[count:]
    return batches


def _slots(lines: list[list[int]], rows: list[Row], windows: list[Window]) -> tuple[list[list[list[int]]], int]:
    """The label slots of the windows of every row of a batch (`label_slots`, per batch row and row), and how
    many slots its positions need (K, at least 1)."""
    slots = [[label_slots(rows[j], windows) for j in line] for line in lines]
    return slots, max((max(s) + 1 for line in slots for s in line), default=1)


def _labels(lines: list[list[int]], rows: list[Row], windows: list[Window], shape: tuple[int, int],
            starts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(labels, source ids, the windows in source order) of a batch: `lines[r]` holds the rows of batch row r,
    starting at the positions `starts[r]`. Each window is its own source, its targets at its span of its row
    in its label slot; [B, S] when no position has two, else [B, S, K]."""
    slots, k = _slots(lines, rows, windows)
    labels = torch.full((*shape, k), IGNORE_INDEX, dtype=torch.long)
    sources = torch.zeros((*shape, k), dtype=torch.long)
    ids: list[int] = []
    for r, line in enumerate(lines):
        for j, at, row_slots in zip(line, starts[r], slots[r]):
            for i, slot in zip(rows[j].windows, row_slots):
                a, b = read_span(windows[i])
                labels[r, at + a:at + b, slot] = torch.tensor(windows[i].targets)
                sources[r, at + a:at + b, slot] = len(ids)
                ids.append(i)
    if k == 1:
        labels, sources = labels.squeeze(-1), sources.squeeze(-1)
    return labels, sources, ids


def batch_tensors(lines: list[list[int]], rows: list[Row], windows: list[Window], seq_len: int, batch_size: int,
                  pad_id: int) -> tuple[dict, torch.Tensor, list[int]]:
    """(inputs {tokens, document_ids, positions, source_ids}, labels, the windows in source order) of one
    packed batch: each row its own document. Empty rows pad the batch to `batch_size`."""
    tokens = torch.full((batch_size, seq_len), pad_id, dtype=torch.long)
    docs = torch.zeros((batch_size, seq_len), dtype=torch.long)
    positions = torch.zeros((batch_size, seq_len), dtype=torch.long)
    starts: list[list[int]] = []
    for r, line in enumerate(lines):
        at = 0
        starts.append([])
        for d, j in enumerate(line, start=1):
            n = len(rows[j].tokens)
            tokens[r, at:at + n] = torch.tensor(rows[j].tokens)
            docs[r, at:at + n] = d
            positions[r, at:at + n] = torch.arange(n)
            starts[-1].append(at)
            at += n
        docs[r, at:] = len(line) + 1  # the padding is a document of its own
        positions[r, at:] = torch.arange(seq_len - at)
    labels, sources, ids = _labels(lines, rows, windows, (batch_size, seq_len), starts)
    inputs = {"tokens": tokens, "document_ids": docs, "positions": positions, "source_ids": sources}
    return inputs, labels, ids


def row_tensors(lines: list[list[int]], rows: list[Row], windows: list[Window], pad_id: int,
                row_multiple: int = 1) -> tuple[dict, torch.Tensor, list[int]]:
    """(inputs {tokens, source_ids}, labels, the windows in source order) of a batch of one row per batch
    row, right-padded to its longest row rounded up to `row_multiple` (tensor parallel's sequence parallel
    splits the sequence over the tp ranks); an empty batch is one padding row (labels all ignored)."""
    length = max((len(rows[line[0]].tokens) for line in lines), default=1)
    length = -(-length // row_multiple) * row_multiple
    tokens = torch.full((max(len(lines), 1), length), pad_id, dtype=torch.long)
    for r, (j,) in enumerate(lines):
        tokens[r, :len(rows[j].tokens)] = torch.tensor(rows[j].tokens)
    labels, sources, ids = _labels(lines, rows, windows, tuple(tokens.shape), [[0]] * len(lines))
    return {"tokens": tokens, "source_ids": sources}, labels, ids


def shard(batches: list, rank: int, degree: int) -> list:
    """This data-parallel rank's batches (round-robin), padded with empty ones to the same count on every rank."""
    count = -(-len(batches) // degree)
    mine = batches[rank::degree]
    return mine + [[]] * (count - len(mine))


def score_windows(windows: list[Window], forward_sums: ForwardSums, *, seq_len: int, batch_size: int,
                  pad_id: int, dp_rank: int = 0, dp_degree: int = 1,
                  reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
                  device: torch.device | str = "cpu", packed: bool = True, row_multiple: int = 1,
                  rows: list[Row] | None = None) -> torch.Tensor:
    """The log-likelihood of every window (float64 [len(windows)]), the same on every rank, scored from
    `rows` (default share_rows(windows)). `packed`: rows of exactly `seq_len` holding several rows each
    (what pipeline stages and context-parallel shards need); else one row per batch row, batches of at most
    batch_size x seq_len tokens (cheaper: plain causal attention), padded to a multiple of `row_multiple`."""
    if rows is None:
        rows = share_rows(windows)
    if packed:
        batches = pack(rows, seq_len, batch_size)
    else:
        batches = group(rows, batch_size * seq_len)
    total = torch.zeros(len(windows), dtype=torch.float32, device=device)
    error = None
    for lines in shard(batches, dp_rank, dp_degree):
        batch = None
        if error is None:
            try:
                batch = _batch(lines, rows, windows, seq_len, batch_size, pad_id, packed, row_multiple)
            except Exception as e:  # noqa: BLE001 - this rank's failure, raised once its forwards have run
                error = e
        if batch is None:
            inputs, labels, sources = _blank(lines, rows, windows, seq_len, batch_size, pad_id, packed, row_multiple)
            ids = []
        else:
            inputs, labels, ids = batch
            sources = max(len(ids), 1)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        sums = forward_sums(inputs, labels.to(device), sources)
        if ids:
            total[torch.tensor(ids, device=device)] += sums[0, :len(ids)].to(total.device)
    if error is not None:
        raise error
    return -reduce_sum(total).double().cpu()


def _batch(lines, rows, windows, seq_len, batch_size, pad_id, packed, row_multiple):
    if packed:
        return batch_tensors(lines, rows, windows, seq_len, batch_size, pad_id)
    return row_tensors(lines, rows, windows, pad_id, row_multiple)


def _blank(lines, rows, windows, seq_len, batch_size, pad_id, packed,
           row_multiple) -> tuple[dict, torch.Tensor, int]:
    """Padding of the shapes `_batch` gives `lines` (tokens, and labels and source ids with their label-slot
    dimension when positions carry several), with as many sources (tensor-parallel ranks run the same
    shapes, pipeline stages sum [2, sources] vectors together), nothing scored: the forward a rank runs in
    place of a batch it could not build. Returns (inputs, labels, number of sources)."""
    if packed:
        shape = (batch_size, seq_len)
    else:
        length = max((len(rows[line[0]].tokens) for line in lines), default=1)
        shape = (max(len(lines), 1), -(-length // row_multiple) * row_multiple)
    tokens = torch.full(shape, pad_id, dtype=torch.long)
    _, k = _slots(lines, rows, windows)
    labels = torch.full((*shape, k) if k > 1 else shape, IGNORE_INDEX, dtype=torch.long)
    inputs = {"tokens": tokens, "source_ids": torch.zeros_like(labels)}
    if packed:
        inputs["document_ids"] = torch.ones_like(tokens)
        inputs["positions"] = torch.arange(shape[1]).expand(shape).contiguous()
    return inputs, labels, max(sum(len(rows[j].windows) for line in lines for j in line), 1)


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
