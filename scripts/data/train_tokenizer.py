"""Train the shipped byte-level BPE tokenizer on the shipped ``stdlib_docs`` train split.

Usage::

    python scripts/data/train_tokenizer.py [--corpus DIR] [--out FILE] [--vocab-size 2000]

Text is pre-tokenised with the Llama 3 regex, identical words are counted once with their
frequency, and the most frequent adjacent token pair is merged until the requested number of
regular tokens exists. Ties are broken by the pair's bytes, so the result does not depend on
dict ordering or hash seeds. The output is a tiktoken-format file (``base64(bytes) rank`` per
line): ranks 0..255 are the single bytes, then one rank per merge in the order learned.
Special tokens are not stored; ``torchtitan.components.tokenizer.backends`` appends them.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import heapq
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import regex

# Same pre-tokenisation pattern as Meta's Llama 3 tokenizer; tiktoken compiles it in Rust.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

Pair = tuple[int, int]


def read_texts(path: Path) -> Iterator[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def count_words(texts: Iterable[str]) -> Counter[bytes]:
    pattern = regex.compile(LLAMA3_PATTERN)
    counts: Counter[bytes] = Counter()
    for text in texts:
        counts.update(m.encode("utf-8") for m in pattern.findall(text))
    return counts


class BpeTrainer:
    """Incremental BPE: pair counts are updated only for words that contain the merged pair."""

    def __init__(self, word_counts: Counter[bytes]) -> None:
        # Sorted so word indices (and therefore every later step) are deterministic.
        items = sorted(word_counts.items())
        self.words: list[list[int]] = [list(w) for w, _ in items]
        self.freqs: list[int] = [c for _, c in items]
        self.vocab: list[bytes] = [bytes([b]) for b in range(256)]
        self.token_id: dict[bytes, int] = {t: i for i, t in enumerate(self.vocab)}
        self.pair_counts: Counter[Pair] = Counter()
        # Word indices that may contain a pair; stale entries are tolerated and re-checked.
        self.pair_words: dict[Pair, set[int]] = {}
        for w, word in enumerate(self.words):
            for pair in zip(word, word[1:]):
                self.pair_counts[pair] += self.freqs[w]
                self.pair_words.setdefault(pair, set()).add(w)
        self.heap: list[tuple[int, bytes, bytes, Pair]] = []
        for pair, count in self.pair_counts.items():
            self._push(pair, count)
        heapq.heapify(self.heap)

    def _push(self, pair: Pair, count: int) -> None:
        # Max count first; on ties the smaller (left bytes, right bytes) wins.
        heapq.heappush(self.heap, (-count, self.vocab[pair[0]], self.vocab[pair[1]], pair))

    def _best_pair(self) -> Pair | None:
        while self.heap:
            neg_count, _, _, pair = heapq.heappop(self.heap)
            # Lazy deletion: an entry is valid only if it still carries the current count.
            if -neg_count == self.pair_counts.get(pair, 0) and neg_count < 0:
                return pair
        return None

    def _merge(self, pair: Pair, new_id: int) -> None:
        changed: Counter[Pair] = Counter()
        for w in sorted(self.pair_words.pop(pair, ())):
            old = self.words[w]
            new: list[int] = []
            i = 0
            while i < len(old):
                if i + 1 < len(old) and old[i] == pair[0] and old[i + 1] == pair[1]:
                    new.append(new_id)
                    i += 2
                else:
                    new.append(old[i])
                    i += 1
            if len(new) == len(old):
                continue  # stale index entry: this word no longer holds the pair
            freq = self.freqs[w]
            for p in zip(old, old[1:]):
                changed[p] -= freq
            for p in zip(new, new[1:]):
                changed[p] += freq
                self.pair_words.setdefault(p, set()).add(w)
            self.words[w] = new
        for p, delta in changed.items():
            if delta:
                self.pair_counts[p] += delta
                if self.pair_counts[p] <= 0:
                    del self.pair_counts[p]
                else:
                    self._push(p, self.pair_counts[p])
        self.pair_counts.pop(pair, None)

    def train(self, vocab_size: int) -> list[bytes]:
        """Return the token byte strings in rank order, ``vocab_size`` of them (or fewer if the
        corpus runs out of pairs)."""
        while len(self.vocab) < vocab_size:
            pair = self._best_pair()
            if pair is None:
                break
            merged = self.vocab[pair[0]] + self.vocab[pair[1]]
            # Two different pairs can spell the same bytes (ab+c, a+bc); reuse the existing
            # token then, because a tiktoken file must map each byte string to one rank.
            new_id = self.token_id.get(merged)
            if new_id is None:
                new_id = len(self.vocab)
                self.vocab.append(merged)
                self.token_id[merged] = new_id
            self._merge(pair, new_id)
        return list(self.vocab)


def write_tiktoken(path: Path, tokens: list[bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="ascii", newline="\n") as f:
        for rank, token in enumerate(tokens):
            f.write(f"{base64.b64encode(token).decode('ascii')} {rank}\n")


def check_round_trip(tokens: list[bytes], texts: Iterable[str]) -> int:
    """Encode/decode every text with tiktoken itself; return how many were checked."""
    import tiktoken

    enc = tiktoken.Encoding(
        "stdlib_bpe",
        pat_str=LLAMA3_PATTERN,
        mergeable_ranks={t: r for r, t in enumerate(tokens)},
        special_tokens={},
    )
    n = 0
    for text in texts:
        ids = enc.encode(text, disallowed_special=())
        if enc.decode(ids) != text:
            raise AssertionError(f"round trip failed on document {n}: {text[:80]!r}")
        n += 1
    return n


def main() -> None:
    repo = Path(__file__).resolve().parents[2]
    assets = repo / "torchtitan" / "assets"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=assets / "stdlib_docs")
    parser.add_argument("--out", type=Path, default=assets / "tokenizer" / "stdlib_bpe.tiktoken")
    parser.add_argument("--vocab-size", type=int, default=2000, help="regular tokens, bytes included")
    args = parser.parse_args()

    counts = count_words(read_texts(args.corpus / "train.jsonl.gz"))
    print(f"{len(counts):,} distinct pre-tokenised words, {sum(counts.values()):,} in total")
    tokens = BpeTrainer(counts).train(args.vocab_size)
    if len(tokens) != args.vocab_size:
        raise SystemExit(f"corpus only supports {len(tokens)} tokens, asked for {args.vocab_size}")
    write_tiktoken(args.out, tokens)
    checked = check_round_trip(tokens, read_texts(args.corpus / "validation.jsonl.gz"))
    print(f"wrote {len(tokens)} tokens to {args.out}; {checked} validation documents round-trip")


if __name__ == "__main__":
    main()
