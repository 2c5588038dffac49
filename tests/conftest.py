"""Suite-wide fixtures and hooks.

- The local S3 server (tests/s3_server.py) and the storage a checkpoint test runs against, so one test proves a
  behaviour on a local folder and on an object store.
- `TT_TOLERANCE_LOG=path.jsonl` records every `torch.testing.assert_close` the suite makes: the test, the
  tolerance it asked for and the largest relative and absolute differences it saw (passing or not), in the
  ranks that tests/multiprocess.py starts too. Run the suite once per kernel set (default, and with the AVX2
  caps of README's Tests section) and `python scripts/diagnostics/tolerance_margins.py LOG...` lists the
  comparisons whose observed difference comes closest to their tolerance: how the tolerances in
  tests/tolerances.py are checked on each CPU kind.
"""

import json
import os
import uuid

import pytest
import torch

@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on a loopback port, started once per test session; its endpoint and dummy credentials
    are put in the environment (as a user would for a real store), so the ranks a test starts inherit them."""
    pytest.importorskip("s3fs", reason="object-storage tests need s3fs (pip install 'torchtitan[test]')")
    pytest.importorskip("moto.server", reason="object-storage tests need moto[server] (pip install 'torchtitan[test]')")
    from tests.s3_server import S3Server, environment

    server = S3Server()
    saved = {k: os.environ.get(k) for k in environment(server.endpoint)}
    os.environ.update(environment(server.endpoint))
    yield server
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


class Store:
    """Where a test's checkpoints live: `root(dump_folder)` is the checkpoint folder, `argv` the options that
    put it there (none locally; --checkpoint.folder s3://<fresh bucket>/checkpoint on the S3 server)."""

    def __init__(self, kind: str, bucket: str | None = None):
        self.kind, self.bucket = kind, bucket
        self.url = f"s3://{bucket}/checkpoint" if bucket else None
        self.argv = ["--checkpoint.folder", self.url] if self.url else []

    def root(self, dump_folder) -> str:
        return self.url or os.path.join(str(dump_folder), "checkpoint")


@pytest.fixture(params=["local", "s3"])
def store(request):
    if request.param == "local":
        return Store("local")
    server = request.getfixturevalue("s3_server")
    from tests.s3_server import make_bucket

    bucket = f"test-{uuid.uuid4().hex[:12]}"
    make_bucket(server.endpoint, bucket)
    return Store("s3", bucket)


_LOG = os.environ.get("TT_TOLERANCE_LOG")


# torch.testing.assert_close's defaults when a test gives no tolerance (its documented table).
_DEFAULTS = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
             torch.float64: (1e-7, 1e-7)}


def _differences(actual, expected, rtol, atol) -> dict | None:
    """Largest relative and absolute difference, and `usage`: max |a - e| / (atol + rtol |e|), which fails the
    comparison above 1."""
    try:
        a, e = torch.as_tensor(actual).detach(), torch.as_tensor(expected).detach()
        if a.shape != e.shape or a.numel() == 0 or not a.is_floating_point():
            return None
        if rtol is None or atol is None:
            rtol, atol = _DEFAULTS.get(a.dtype, (0.0, 0.0))
        a, e = a.double().cpu(), e.double().cpu()
        diff = (a - e).abs()
        finite = torch.isfinite(diff)
        if not finite.any():
            return None
        diff, e = diff[finite], e[finite]
        nonzero = e != 0
        rel = float((diff[nonzero] / e[nonzero].abs()).max()) if nonzero.any() else 0.0
        bound = atol + rtol * e.abs()
        usage = float((diff / bound).max()) if bool((bound > 0).all()) else float("inf") if diff.max() > 0 else 0.0
        return {"rtol": rtol, "atol": atol, "rel": rel, "abs": float(diff.max()), "usage": usage}
    except (TypeError, ValueError, RuntimeError):
        return None  # nested containers and non-numeric inputs: not recorded


def recording_assert_close(original, test: str):
    """`original` (torch.testing.assert_close) that also appends its tolerance and differences to the log."""

    def recording(actual, expected, *args, **kwargs):
        found = _differences(actual, expected, kwargs.get("rtol"), kwargs.get("atol"))
        try:
            return original(actual, expected, *args, **kwargs)
        finally:
            if found is not None:  # usage > 1 in a passing test: a negative control's expected failure
                with open(_LOG, "a") as f:
                    f.write(json.dumps({"test": test, **found}) + "\n")

    return recording


def record_in_rank() -> None:
    """In a rank forked by tests/multiprocess.py (a fresh interpreter): record its comparisons under the test
    that started it (pytest's PYTEST_CURRENT_TEST, handed down with the environment)."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    if _LOG and test:
        torch.testing.assert_close = recording_assert_close(torch.testing.assert_close, test)


@pytest.fixture(autouse=True)
def _record_tolerances(request, monkeypatch):
    if _LOG:
        monkeypatch.setattr(torch.testing, "assert_close",
                            recording_assert_close(torch.testing.assert_close, request.node.nodeid))
    yield
