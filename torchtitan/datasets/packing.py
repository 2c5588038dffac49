"""Documents → one global stream of packed token windows → each data-parallel rank's slice of every step.

Why a global stream: the batch of step s must be the same set of samples whatever the parallel layout, so
that a layout can be compared with a single process exactly and a run can resume under a different
data-parallel degree. Every rank therefore reads the same stream of windows; step s is windows
[s*G, (s+1)*G) of it (G = global batch size) and rank r of D keeps the contiguous slice r of G/D windows.
The price is that every rank tokenizes the whole global batch; for pretraining-scale data, pre-tokenize.

The state (the stream position at the last global-batch boundary and how many of the current slice were
already yielded) is the same on every rank at a step boundary, so it can be saved once and loaded under any
data-parallel layout.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils.data import IterableDataset

from torchtitan.components.tokenizer import Tokenizer
from torchtitan.datasets.sources import DocumentSource
from torchtitan.tools.logging import logger


@dataclass
class StreamPosition:
    """Where the token stream stands: the next document to read and the tokens read but not yet packed."""

    doc_index: int = 0
    epoch: int = 0
    buffer: list[int] = field(default_factory=list)


class TokenWindowStream:
    """Tokenizes documents (BOS ... EOS each) and cuts the concatenation into windows of `window` tokens."""

    def __init__(self, source: DocumentSource, tokenizer: Tokenizer, window: int, infinite: bool):
        self.source, self.tokenizer, self.window, self.infinite = source, tokenizer, window, infinite
        self.pos = StreamPosition()
        self._docs: Iterator[str] | None = None

    def seek(self, pos: StreamPosition) -> None:
        self.pos = StreamPosition(pos.doc_index, pos.epoch, list(pos.buffer))
        self._docs = None

    def snapshot(self) -> StreamPosition:
        return StreamPosition(self.pos.doc_index, self.pos.epoch, list(self.pos.buffer))

    def next_window(self) -> list[int] | None:
        """The next `window` tokens, or None when a finite stream is exhausted (the remainder is dropped)."""
        while len(self.pos.buffer) < self.window:
            text = self._next_document()
            if text is None:
                return None
            self.pos.buffer.extend(self.tokenizer.encode(text, bos=True, eos=True))
        out = self.pos.buffer[: self.window]
        del self.pos.buffer[: self.window]
        return out

    def _next_document(self) -> str | None:
        for attempt in range(2):
            if self._docs is None:
                self._docs = self.source.iter_from(self.pos.doc_index)
            text = next(self._docs, None)
            if text is not None:
                self.pos.doc_index += 1
                return text
            if not self.infinite or (attempt == 0 and self.pos.doc_index == 0):
                break
            # One pass is over: start the next epoch from the first document.
            self.pos.epoch += 1
            self.pos.doc_index = 0
            self._docs = None
            logger.warning(f"Dataset {self.source.name}: starting epoch {self.pos.epoch} (data is being re-used)")
        return None


class GlobalBatchSlicer(IterableDataset):
    """Yields (input, label) pairs of this data-parallel rank's slice of each global batch, in order.

    input = window[:-1], label = window[1:], windows being seq_len + 1 tokens long.
    """

    def __init__(
        self,
        source: DocumentSource,
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        infinite: bool = True,
    ):
        if global_batch_size % dp_degree:
            raise ValueError(f"global batch {global_batch_size} does not divide by data-parallel degree {dp_degree}")
        self.stream = TokenWindowStream(source, tokenizer, seq_len + 1, infinite)
        self.global_batch_size, self.dp_rank, self.dp_degree = global_batch_size, dp_rank, dp_degree
        self.slice_size = global_batch_size // dp_degree
        self._batch_start = StreamPosition()  # stream position before the current global batch
        self._batch_end: StreamPosition | None = None  # after it (None: no batch in progress)
        self._yielded = 0  # samples of this rank's slice already handed out
        self._resume_skip = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.stream.seek(self._batch_start)
        skip, self._resume_skip = self._resume_skip, 0
        while True:
            self._batch_start = self.stream.snapshot()
            windows = [self.stream.next_window() for _ in range(self.global_batch_size)]
            if windows[-1] is None:
                return  # a finite stream ran out: an incomplete global batch is dropped on every rank alike
            self._batch_end = self.stream.snapshot()
            lo = self.dp_rank * self.slice_size
            mine = windows[lo + skip : lo + self.slice_size]
            self._yielded = skip
            skip = 0
            for w in mine:
                self._yielded += 1
                t = torch.tensor(w, dtype=torch.long)
                yield t[:-1], t[1:]
            self._batch_start, self._batch_end, self._yielded = self._batch_end, None, 0

    def state_dict(self) -> dict:
        done = self._batch_end is not None and self._yielded == self.slice_size
        pos = self._batch_end if done else self._batch_start
        return {
            "doc_index": pos.doc_index,
            "epoch": pos.epoch,
            "buffer": list(pos.buffer),
            "yielded": 0 if done else self._yielded,
        }

    def load_state_dict(self, state: dict) -> None:
        self._batch_start = StreamPosition(state["doc_index"], state["epoch"], list(state["buffer"]))
        self._batch_end = None
        # Until iteration restarts, state_dict() must report the loaded position, not the previous iterator's.
        self._resume_skip = self._yielded = state["yielded"]
        if self._resume_skip and self._resume_skip >= self.slice_size:
            raise ValueError("data loader state is mid-batch for a different data-parallel layout")
