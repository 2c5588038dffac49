"""`python -m torchtitan.train` with the background write of one checkpoint stalled once its data files are
written (before its manifest), so a test can SIGKILL the run while that save is in flight (a stand-in for a
node dying mid-write). The step to stall comes from TORCHTITAN_TEST_STALL_STEP; everything else is the real
trainer. The checkpoint folder may be local (`step-N.partial`) or on an object store (`step-N`, no rename)."""

import os
import sys
import time

from torch.distributed.checkpoint.filesystem import FileSystemWriter

STALL = f"step-{os.environ['TORCHTITAN_TEST_STALL_STEP']}"
_real_write_data = FileSystemWriter.write_data


def _write_data(self, plan, planner):
    result = _real_write_data(self, plan, planner)
    if str(self.path).rstrip("/").removesuffix(".partial").endswith(STALL):
        time.sleep(3600)
    return result


FileSystemWriter.write_data = _write_data

if __name__ == "__main__":
    from torchtitan.train import main

    sys.exit(main(sys.argv[1:]))
