"""Sources of packed windows → one global stream of samples (a weighted mixture) → each rank's slice.

Why a global stream: the batch of step s must be the same set of samples whatever the parallel layout, so
that a layout can be compared with a single process exactly and a run can resume under a different
data-parallel degree. Step s is global samples [s*G, (s+1)*G) (G = global batch size); data-parallel rank
r of D keeps the contiguous slice r of G/D samples (its gradient-accumulation microbatches).

Sample k of the stream is a window of seq_len + 1 tokens of source `choice(k)`, the n-th window of that
source where n counts the earlier samples drawn from it. `MixturePlan` makes the choices from the seed, in
blocks of 1000 samples that hold each source's share exactly (largest remainder) in a seeded random order:
deterministic, the same on every rank, and on weight within 1/1000 over any span of whole blocks. Under a
mixture schedule (schedule.py) the blocks restart at every phase and follow its weights.

Two kinds of source:
- `ShardWindows` reads pre-tokenized shards (shards.py): window n is tokens [n*W, (n+1)*W) of the shards'
  stream, read by memory map, so a rank reads only the windows of its own slice.
- `TextWindows` tokenizes documents as it goes; windows must be read in order, so every rank reads (and
  tokenizes) every window of the sources it draws from. Fine for small data; pre-tokenize at scale.

Both cut the same concatenation (BOS doc EOS, BOS doc EOS, ...) into the same windows, so shards and raw
text give identical samples. State: the global sample index at the last step boundary, each source's
position, and how many of the current slice this rank has served — identical on every rank at a step
boundary, so saved once and loadable under any data-parallel degree.
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch.utils.data import IterableDataset

from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer.backends import Tokenizer
from torchtitan.datasets.chat import tokenize_document
from torchtitan.datasets.schedule import MixtureSchedule
from torchtitan.datasets.shards import ShardSet
from torchtitan.datasets.sources import DataSourceError, DocumentSource
from torchtitan.protocols.documents import document_ids_from_bos, positions_in_documents
from torchtitan.tools.logging import logger

# loop: a source that runs out starts over (a new epoch, with a warning); stop: the stream ends with a message
# (training then stops: "the data ran out"); end: the stream ends silently (one validation pass).
ExhaustedPolicy = Literal["loop", "stop", "end"]
MIXTURE_BLOCK = 1000


class SourceExhausted(Exception):
    """A source has no more windows and its policy is not to loop."""


@dataclass
class Window:
    tokens: torch.Tensor  # [W] int64
    trained: torch.Tensor | None = None  # [W] bool: which tokens are training targets; None = all


@dataclass
class StreamPosition:
    """Where a text source stands: the next document to read and the tokens read but not yet packed."""

    doc_index: int = 0
    epoch: int = 0
    buffer: list[int] = field(default_factory=list)
    trained: list[bool] | None = None  # per buffered token, once any document had untrained tokens


@dataclass(frozen=True)
class ReadRetry:
    """How a document source that raises while reading is retried: `retries` times, the k-th after
    `backoff_s` x 2^(k-1) seconds (so at most backoff_s x (2^retries - 1) seconds in all)."""

    retries: int = 3
    backoff_s: float = 1.0


class TextWindows:
    """Tokenizes documents (BOS ... EOS each; chat records with their trained mask) and cuts the
    concatenation into windows of `window` tokens, in order."""

    def __init__(
        self, source: DocumentSource, tokenizer: Tokenizer, window: int, policy: ExhaustedPolicy, name: str = "",
        retry: ReadRetry = ReadRetry(),
    ):
        self.source, self.tokenizer, self.window, self.policy = source, tokenizer, window, policy
        self.retry = retry
        self.name = name or source.name
        self.pos = StreamPosition()
        self.consumed = 0  # windows read so far
        self._docs: Iterator | None = None

    def state(self) -> dict:
        p = self.pos
        state = {"consumed": self.consumed, "doc_index": p.doc_index, "epoch": p.epoch, "buffer": list(p.buffer)}
        if p.trained is not None:
            state["trained"] = list(p.trained)
        return state

    def load(self, state: dict) -> None:
        trained = state.get("trained")
        self.pos = StreamPosition(state["doc_index"], state["epoch"], list(state["buffer"]),
                                  None if trained is None else list(trained))
        self.consumed = state.get("consumed", 0)
        self._docs = None

    def take(self, wanted: list[int], end: int) -> list[Window]:
        """Reads windows up to (excluding) `end`; returns those with index in `wanted` (ascending)."""
        keep, out = set(wanted), []
        while self.consumed < end:
            w = self.next_window()
            if w is None:
                raise SourceExhausted(f"source {self.name} ran out after {self.consumed} windows")
            if self.consumed in keep:
                out.append(w)
            self.consumed += 1
        return out

    def next_window(self) -> Window | None:
        """The next `window` tokens, or None when the source is exhausted (the remainder is dropped)."""
        p = self.pos
        while len(p.buffer) < self.window:
            doc = self._next_document()
            if doc is None:
                return None
            tokens, trained = tokenize_document(doc, self.tokenizer)
            if trained is not None and p.trained is None:
                p.trained = [True] * len(p.buffer)
            if p.trained is not None:
                p.trained.extend(trained if trained is not None else [True] * len(tokens))
            p.buffer.extend(tokens)
        w = Window(torch.tensor(p.buffer[: self.window], dtype=torch.long))
        del p.buffer[: self.window]
        if p.trained is not None:
            w.trained = torch.tensor(p.trained[: self.window], dtype=torch.bool)
            del p.trained[: self.window]
        return w

    def _next_document(self):
        p = self.pos
        for attempt in range(2):
            doc = self._read()
            if doc is not None:
                p.doc_index += 1
                return doc
            if self.policy != "loop" or (attempt == 0 and p.doc_index == 0):
                break
            # One pass is over: start the next epoch from the first document.
            p.epoch += 1
            p.doc_index = 0
            self._docs = None
            logger.warning(f"Dataset {self.name}: starting epoch {p.epoch} (data is being re-used)")
        return None

    def _read(self):
        """The document at pos.doc_index (None at the end); a source that raises is reopened there, with backoff,
        so a recovered read gives the same documents as one that never failed."""
        failures = 0
        while True:
            if self._docs is None:
                self._docs = self.source.iter_from(self.pos.doc_index)
            try:
                return next(self._docs, None)
            except ValueError:
                raise  # a document that does not parse fails the same way on every read: the user's line
            except Exception as e:  # a dropped stream, a vanished file: whatever the source's reader raises
                self._docs = None
                failures += 1
                reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                if failures > self.retry.retries:
                    raise DataSourceError(
                        f"data source {self.name} failed {failures} times in a row reading document "
                        f"{self.pos.doc_index} ({reason}); restarting the run resumes there "
                        f"(more tries: --training.source_retries)"
                    ) from e
                delay = self.retry.backoff_s * 2 ** (failures - 1)
                logger.warning(f"Dataset {self.name}: reading document {self.pos.doc_index} failed ({reason}); "
                               f"retry {failures}/{self.retry.retries} in {delay:g}s")
                time.sleep(delay)


class ShardWindows:
    """Random-access windows of a pre-tokenized shard folder; loops by wrapping the window index."""

    def __init__(self, shards: ShardSet, window: int, policy: ExhaustedPolicy, name: str = ""):
        self.shards, self.window, self.policy = shards, window, policy
        self.name = name or shards.name
        # The tail shorter than a window is dropped each epoch.
        self.windows_per_epoch = shards.num_tokens // window
        if self.windows_per_epoch == 0:
            raise ValueError(
                f"shards {shards.folder} hold {shards.num_tokens} tokens, fewer than one window ({window})"
            )
        self.consumed = 0
        self._warned_epoch = 0

    def state(self) -> dict:
        return {"consumed": self.consumed}

    def load(self, state: dict) -> None:
        self.consumed = state.get("consumed", 0)

    def take(self, wanted: list[int], end: int) -> list[Window]:
        if self.policy != "loop" and end > self.windows_per_epoch:
            raise SourceExhausted(f"source {self.name} ran out after {self.windows_per_epoch} windows")
        epoch = (end - 1) // self.windows_per_epoch
        if epoch > self._warned_epoch:
            self._warned_epoch = epoch
            logger.warning(f"Dataset {self.name}: starting epoch {epoch} (data is being re-used)")
        self.consumed = end
        return [self.read(n) for n in wanted]

    def read(self, n: int) -> Window:
        start = (n % self.windows_per_epoch) * self.window
        return Window(torch.from_numpy(self.shards.tokens(start, self.window)))


class MixturePlan:
    """Which source each global sample comes from: seeded, blockwise exact shares (see the module doc).

    Blocks restart at every phase of the schedule (a phase starts at a step, i.e. at a global-batch boundary),
    and block b of phase i is shuffled by (seed, b, i's first sample) alone (phase 0: (seed, b)), with the
    weights phase i gives the block's middle step. A block cut short by the next phase keeps its first samples,
    so a schedule extended with a new phase draws every earlier sample as before.
    """

    def __init__(self, schedule: MixtureSchedule | list[float], seed: int, global_batch_size: int = 1):
        if not isinstance(schedule, MixtureSchedule):
            if not schedule or any(w < 0 for w in schedule) or sum(schedule) <= 0:
                raise ValueError(f"mixture weights must be >= 0 and not all 0, got {schedule}")
            schedule = MixtureSchedule.constant(list(schedule))
        self.schedule, self.seed, self.global_batch_size = schedule, seed, global_batch_size
        self.num_sources = len(schedule.phases[0].weights)
        self._starts = [p.start * global_batch_size for p in schedule.phases]  # first sample of each phase
        self._cache: dict[tuple[int, int], np.ndarray] = {}

    def _block(self, phase: int, b: int) -> np.ndarray:
        if (phase, b) not in self._cache:
            if len(self._cache) > 4:
                self._cache.clear()
            middle = self._starts[phase] + b * MIXTURE_BLOCK + MIXTURE_BLOCK // 2
            weights = self.schedule.phase_weights(phase, middle // self.global_batch_size)
            shares = np.asarray(weights, dtype=np.float64) / sum(weights) * MIXTURE_BLOCK
            quotas = np.floor(shares).astype(np.int64)
            # Largest remainder: the seats left over go to the largest fractional parts (ties: first source).
            order = np.argsort(-(shares - quotas), kind="stable")
            quotas[order[: MIXTURE_BLOCK - int(quotas.sum())]] += 1
            key = [self.seed, b] if phase == 0 else [self.seed, b, self._starts[phase]]
            template = np.repeat(np.arange(self.num_sources), quotas)
            self._cache[(phase, b)] = np.random.default_rng(key).permutation(template)
        return self._cache[(phase, b)]

    def choices(self, start: int, count: int) -> np.ndarray:
        if self.num_sources == 1:
            return np.zeros(count, dtype=np.int64)  # one source: no draws needed
        out, k, end = [], start, start + count
        while k < end:
            phase = bisect.bisect_right(self._starts, k) - 1
            b = (k - self._starts[phase]) // MIXTURE_BLOCK
            block_start = self._starts[phase] + b * MIXTURE_BLOCK
            stop = min(block_start + MIXTURE_BLOCK, end, *self._starts[phase + 1 : phase + 2])
            out.append(self._block(phase, b)[k - block_start : stop - block_start])
            k = stop
        return np.concatenate(out)


@dataclass(frozen=True)
class SampleFeatures:
    """What a sample carries besides tokens and labels (any of them turns `inputs` into a dict)."""

    document_ids: bool = False  # for block-causal attention within documents
    document_positions: bool = False  # RoPE positions restarting at every document
    source_ids: bool = False  # per-token source index, for the per-source loss (the model never sees it)
    bos_id: int | None = None

    @property
    def as_dict(self) -> bool:
        return self.document_ids or self.document_positions or self.source_ids


def make_sample(window: Window, source_index: int, features: SampleFeatures):
    """(inputs, labels) of a window: inputs = tokens[:-1] (or a dict of it and its features), labels =
    tokens[1:] with IGNORE_INDEX where the target token is not trained (SFT prompts)."""
    inputs, labels = window.tokens[:-1], window.tokens[1:].clone()
    if window.trained is not None:
        labels[~window.trained[1:]] = IGNORE_INDEX
    if not features.as_dict:
        return inputs, labels
    out = {"tokens": inputs}
    if features.document_ids or features.document_positions:
        ids = document_ids_from_bos(inputs, features.bos_id)
        if features.document_ids:
            out["document_ids"] = ids
        if features.document_positions:
            out["positions"] = positions_in_documents(ids)
    if features.source_ids:
        out["source_ids"] = torch.full_like(inputs, source_index)
    return out, labels


WindowSource = TextWindows | ShardWindows


class GlobalBatchSlicer(IterableDataset):
    """Yields (inputs, labels) of this data-parallel rank's slice of each global batch, in order."""

    def __init__(
        self,
        sources: list[WindowSource],
        weights: list[float] | MixtureSchedule,
        *,
        global_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        seed: int = 0,
        features: SampleFeatures = SampleFeatures(),
    ):
        if global_batch_size % dp_degree:
            raise ValueError(f"global batch {global_batch_size} does not divide by data-parallel degree {dp_degree}")
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"mixture sources must have distinct names, got {names}")
        self.sources, self.plan, self.features = sources, MixturePlan(weights, seed, global_batch_size), features
        self.source_names = names
        self.global_batch_size, self.dp_rank, self.dp_degree = global_batch_size, dp_rank, dp_degree
        self.slice_size = global_batch_size // dp_degree
        self._batch_start = self._snapshot(0)  # position before the current global batch
        self._batch_end: dict | None = None  # after it (None: no batch in progress)
        self._yielded = 0  # samples of this rank's slice already handed out
        self._resume_skip = 0

    def _snapshot(self, sample: int) -> dict:
        return {"sample": sample, "sources": {s.name: s.state() for s in self.sources}}

    def __iter__(self) -> Iterator:
        pos = self._batch_start
        for s in self.sources:
            s.load(pos["sources"].get(s.name, {"consumed": 0, "doc_index": 0, "epoch": 0, "buffer": []}))
        sample = pos["sample"]
        skip, self._resume_skip = self._resume_skip, 0
        lo, hi = self.dp_rank * self.slice_size, (self.dp_rank + 1) * self.slice_size
        while True:
            self._batch_start = self._snapshot(sample)
            choices = self.plan.choices(sample, self.global_batch_size)
            mine: list = [None] * self.slice_size
            try:
                for c, source in enumerate(self.sources):
                    where = np.flatnonzero(choices == c)
                    base = source.consumed
                    in_slice = where[(where >= lo) & (where < hi)]
                    wanted = [base + int(np.searchsorted(where, j)) for j in in_slice]
                    for j, w in zip(in_slice, source.take(wanted, base + len(where))):
                        mine[j - lo] = make_sample(w, c, self.features)
            except SourceExhausted as e:
                # Every rank reaches the same verdict: each source checks the end of the whole global batch.
                if self.sources[0].policy == "stop":
                    logger.warning(f"{e}; --training.dataset_exhausted=stop ends the data here")
                return
            sample += self.global_batch_size
            self._batch_end = self._snapshot(sample)
            self._yielded = skip
            for item in mine[skip:]:
                self._yielded += 1
                yield item
            skip = 0
            self._batch_start, self._batch_end, self._yielded = self._batch_end, None, 0

    def tokens_seen(self) -> dict[str, int]:
        """tokens_seen/<source>: the input tokens each source has given the global stream so far (all ranks')."""
        return {f"tokens_seen/{s.name}": s.consumed * (s.window - 1) for s in self.sources}

    def state_dict(self) -> dict:
        """{"sample", "yielded", "sources"}; the sources' positions are one JSON string, so a checkpoint
        stores and restores them whole, whatever sources the loading run reads (DCP loads only the keys of
        the loading side's state dict)."""
        done = self._batch_end is not None and self._yielded == self.slice_size
        pos = self._batch_end if done else self._batch_start
        return {"sample": pos["sample"], "yielded": 0 if done else self._yielded,
                "sources": json.dumps(pos["sources"], sort_keys=True)}

    def load_state_dict(self, state: dict) -> None:
        sources = json.loads(state["sources"])
        unknown = sorted(set(sources) - set(self.source_names))
        if unknown:
            logger.warning(f"data state names sources {unknown} that this run does not read; they are dropped")
        self._batch_start = {"sample": state["sample"], "sources": sources}
        self._batch_end = None
        # Until iteration restarts, state_dict() must report the loaded position, not the previous iterator's.
        self._resume_skip = self._yielded = state["yielded"]
        if self._resume_skip and self._resume_skip >= self.slice_size:
            raise ValueError("data loader state is mid-batch for a different data-parallel layout")
