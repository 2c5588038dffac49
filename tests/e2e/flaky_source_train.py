"""`python -m torchtitan.train` with one more dataset, `flaky`: the shipped train documents cut to 200 characters,
whose reads raise OSError from document FLAKY_FAIL_FROM on, on rank FLAKY_RANK only (a stream whose connection
dropped for good). The time of its first failure is written to FLAKY_STAMP. Launched as a script by torchrun."""

import os
import sys
import time

from torchtitan.datasets import sources
from torchtitan.train import main


class FlakySource(sources.DocumentSource):
    resumable = True

    def __init__(self, split):
        self.inner, self.name = sources.open_documents("stdlib_docs", None, split), "flaky"
        self.fail_from = int(os.environ["FLAKY_FAIL_FROM"])
        self.failing = os.environ.get("RANK", "0") == os.environ["FLAKY_RANK"]

    def iter_from(self, doc_index):
        for i, doc in enumerate(self.inner.iter_from(doc_index), doc_index):
            if self.failing and i >= self.fail_from:
                if not os.path.exists(os.environ["FLAKY_STAMP"]):
                    with open(os.environ["FLAKY_STAMP"], "w") as f:
                        f.write(str(time.time()))
                raise OSError("connection reset by peer")
            yield doc[:200]


sources.DATASETS["flaky"] = lambda dataset_path, split: FlakySource(split)

if __name__ == "__main__":
    sys.exit(main())
