"""Evaluation tasks: the harness's rolling windows and context building, bad task files refused by the
pre-flight check in one line, a task failing mid-run reported while the others are scored."""

import json

import pytest
import torch

from torchtitan import preflight
from torchtitan.eval.requests import encode_pair, rolling_windows
from torchtitan.eval.runner import Evaluator
from torchtitan.eval.tasks import load_task

TINY = ["--model.flavor", "debugmodel_tiny4", "--training.seq_len", "32", "--training.local_batch_size", "4",
        "--training.steps", "1", "--training.mixed_precision_param", "float32", "--eval.enable"]


def _task(tmp_path, body: str, docs: list[dict], name="t") -> str:
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {name}.jsonl\n"
                    f"test_split: test\n{body}")
    return str(path)


MC = "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_target: label\ndoc_to_choice: choices\n"


def test_rolling_windows_are_the_harness_windows():
    lm_eval_utils = pytest.importorskip("lm_eval.utils")
    tokens = list(range(100, 137))
    for length in (1, 5, 8, 37, 40):
        ours = [(w.tokens, w.targets) for w in rolling_windows(tokens, 7, length, 0)]
        theirs = [lm_eval_utils.make_disjoint_window(p)
                  for p in lm_eval_utils.get_rolling_token_windows(tokens, 7, length, 1)]
        # Theirs is (context, continuation); the model reads (context + continuation)[-(L + 1):][:-1].
        assert ours == [((a + b)[-(length + 1):][:-1], b) for a, b in theirs], length


def test_trailing_space_moves_to_the_continuation():
    from torchtitan.components.tokenizer.backends import build_tokenizer

    tok = build_tokenizer(None)
    ctx, cont = encode_pair(tok, "Answer: ", "yes")
    assert ctx == tok.encode("Answer:", bos=True, eos=False)
    assert ctx + cont == tok.encode("Answer: yes", bos=True, eos=False)


def test_fewshot_contexts_use_the_harness_sampler(tmp_path):
    docs = [{"q": f"q{i}", "choices": ["a", "b"], "label": i % 2} for i in range(6)]
    path = _task(tmp_path, MC + "num_fewshot: 2\ndescription: 'D. '\n", docs)
    task = load_task(path)
    contexts = task.contexts(1234)
    import random

    rnd = random.Random(1234)  # the harness: n + 1 drawn from the scored split, the document itself left out
    shots = [d for d in rnd.sample(docs, 3) if d != docs[0]][:2]
    assert contexts[0] == "D. " + "".join(f"{s['q']} {s['choices'][s['label']]}\n\n" for s in shots) + "q0"


@pytest.mark.parametrize("body, docs, says", [
    ("output_type: multiple_choice\ndoc_to_text: [", [{"q": "x"}], "does not parse as YAML"),
    (MC, [{"q": "x", "choices": [], "label": 0}], "empty choice list"),
    (MC.replace("choices\n", "choices\nmetric_list:\n  - metric: f1\n"), [{"q": "x", "choices": ["a"], "label": 0}],
     "metric 'f1' is not computed for multiple_choice"),
    ("output_type: loglikelihood\ndoc_to_text: q\ndoc_to_target: a\n", [{"q": "x", "a": " word" * 40}],
     "longer than the evaluation window (32"),
    ("output_type: generate_until\n", [{"q": "x"}], "output_type 'generate_until' is not scored here"),
    (MC + "process_docs: !function utils.process\n", [{"q": "x", "choices": ["a"], "label": 0}],
     "`process_docs` is not supported"),
])
def test_bad_task_is_one_preflight_line(tmp_path, capsys, body, docs, says):
    path = _task(tmp_path, body, docs)
    assert preflight.main(["--world-size", "1", *TINY, "--eval.tasks", path]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and says in err, err


def test_unknown_task_name_is_one_line(capsys):
    assert preflight.main(["--world-size", "1", *TINY, "--eval.tasks", "hellaswag"]) == 1
    err = capsys.readouterr().err.strip()
    assert "neither a task file nor a shipped task (stdlib_next_line)" in err and "\n" not in err, err


def test_task_failing_mid_run_is_reported_and_others_scored(tmp_path, caplog):
    from torchtitan.components.tokenizer.backends import build_tokenizer
    from torchtitan.config import JobConfig

    cfg = JobConfig().eval
    cfg.tasks, cfg.limit = ["stdlib_next_line", _task(tmp_path, MC, [{"q": "x", "choices": ["a", "b"], "label": 0}])], 2
    evaluator = Evaluator(cfg, build_tokenizer(None), 64)

    def forward_sums(inputs, labels, n):
        if int(labels.ne(-100).sum()) < 10:  # the one-token task's batch
            raise RuntimeError("boom")
        return torch.zeros(2, n)

    metrics = evaluator.run(forward_sums)
    assert "eval/stdlib_next_line/acc" in metrics and not any(k.startswith("eval/t/") for k in metrics)
    assert "Evaluation of task t failed and is skipped: RuntimeError: boom" in caplog.text


def test_entry_point_on_a_step_checkpoint_equals_the_in_loop_score(tmp_path):
    """`python -m torchtitan.eval` on the DCP step checkpoint of a run scores exactly what the run's own [eval]
    pass scored at that step (one process, float32: the same model and the same packed batches)."""
    from tests.unit.checkpoint_helpers import run
    from torchtitan.eval import __main__ as eval_main

    run_dir = tmp_path / "run"
    assert run(run_dir, "--training.steps", "1", "--checkpoint.enable", "--checkpoint.interval", "1",
               "--eval.enable", "--eval.limit", "6", "--eval.local_batch_size", "2") == 0
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    in_loop = next(m for m in logged if "eval/stdlib_next_line/acc" in m)
    out = tmp_path / "scores.json"
    assert eval_main.main([str(run_dir / "checkpoint" / "step-1"), "--output", str(out)]) == 0
    scores = json.loads(out.read_text())["metrics"]
    for key in ("acc", "acc_norm", "acc_stderr"):
        assert scores[f"eval/stdlib_next_line/{key}"] == in_loop[f"eval/stdlib_next_line/{key}"], key
    assert scores["eval/stdlib_next_line/requests"] == 24


def test_rows_are_shared_by_equal_and_prefix_inputs():
    from torchtitan.eval.requests import Window
    from torchtitan.eval.scoring import share_rows

    tokens = [[1, 2, 3], [1, 2], [1, 2, 4], [1], [2], [1, 2, 3], [3, 1]]
    rows = share_rows([Window(t, t[-1:], i) for i, t in enumerate(tokens)])
    assert sorted((r.tokens, r.windows) for r in rows) == [([1, 2, 3], [0, 1, 3, 5]), ([1, 2, 4], [2]), ([2], [4]),
                                                           ([3, 1], [6])]


def test_blank_batch_has_the_real_batch_shapes():
    """The padding a rank runs in place of a batch it could not build has the shapes of that batch, the
    label-slot dimension K included (4 letter choices read one position: K = 4), and as many sources: the
    tensor-parallel ranks, pipeline stages and loss parallel run one batch's shapes and collectives together."""
    from torchtitan.eval.requests import Window
    from torchtitan.eval.scoring import _batch, _blank, group, pack, share_rows

    context = [5, 6, 7, 8]  # each letter is predicted at the context's last position
    windows = [Window(context, [c], i) for i, c in enumerate([11, 12, 13, 14])]  # " A" ... " D"
    windows += [Window([1, 2, 3, 4, 5, 6], [4, 5, 6], 4), Window([9, 9], [9], 5)]
    rows = share_rows(windows)
    for packed in (False, True):
        batches = pack(rows, 16, 2) if packed else group(rows, 2 * 16)
        for lines in batches + [[]]:
            inputs, labels, ids = _batch(lines, rows, windows, 16, 2, 0, packed, 4)
            blank_inputs, blank_labels, sources = _blank(lines, rows, windows, 16, 2, 0, packed, 4)
            assert {k: v.shape for k, v in blank_inputs.items()} == {k: v.shape for k, v in inputs.items()}
            assert blank_labels.shape == labels.shape and sources == max(len(ids), 1), (packed, lines)
            assert blank_labels.eq(-100).all()
        assert any(labels.dim() == 3 and labels.shape[-1] == 4 for labels in
                   [_batch(lines, rows, windows, 16, 2, 0, packed, 4)[1] for lines in batches]), packed


def _tiny_model():
    from torchtitan.components.checkpoint.offline_model import build_cpu_model
    from torchtitan.protocols.train_spec import config_manager

    cfg = config_manager().parse_args(["--model.flavor", "debugmodel_tiny4"])
    model, _, tokenizer, args = build_cpu_model(cfg)
    with torch.no_grad():  # weights large enough that the choices' log-likelihoods differ by nats
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return model.eval(), tokenizer, args


def test_shared_rows_score_as_unshared(tmp_path, monkeypatch):
    """ARC-style single-letter choices (" A" ... " D": each document's four requests read the same input, its
    context) are one row per document, and a choice whose tokens are a prefix of another's (" blue" of " blue
    sky and sea") is read from the longer one's row; every request's log-likelihood equals the one scored on
    its own row, unpacked and packed, within float32 rounding. Negative control: reading one position early."""
    from tests.tolerances import contraction_width, logits_tol
    from torchtitan.config import JobConfig
    from torchtitan.eval import scoring
    from torchtitan.eval.runner import plain_forward_sums

    letters = [{"q": f"Question {i}: which letter comes {i} after A?\nAnswer:", "choices": list("ABCD"), "label": i % 4}
               for i in range(5)]
    prefix = [{"q": f"The colour of line {i} is", "choices": ["blue", "blue sky and sea", "red"], "label": 0}
              for i in range(3)]
    cfg = JobConfig().eval
    cfg.tasks = [_task(tmp_path, MC, letters, "letters"), _task(tmp_path, MC, prefix, "prefix")]
    model, tokenizer, args = _tiny_model()
    evaluator = Evaluator(cfg, tokenizer, 64)
    metrics = evaluator.run(plain_forward_sums(model))
    assert metrics["eval/letters/requests"] == 20 and metrics["eval/letters/rows"] == 5, metrics
    assert metrics["eval/prefix/requests"] == 9 and metrics["eval/prefix/rows"] == 6, metrics

    forward = plain_forward_sums(model)
    with torch.no_grad():
        longest = max((w for r in evaluator.tasks for w in r.windows), key=lambda w: len(w.tokens))
        logits = model(torch.tensor([longest.tokens]))
    # Shared and unshared rows differ in length and batch shape only: the matmuls' and attention's summation
    # order. Each request sums <= 4 token log-probabilities, each a logit minus the log-sum-exp (each off by at
    # most the logits' tolerance): 2 x 4 logits tolerances.
    tol = 8 * logits_tol(logits, args.n_layers, contraction_width(model, 64))["atol"]

    def score(reqs, packed, share=True):
        return scoring.score_windows(reqs.windows, forward, seq_len=64, batch_size=4, pad_id=tokenizer.eos_id,
                                     packed=packed, rows=scoring.share_rows(reqs.windows, share))

    alone = {}
    for reqs in evaluator.tasks:
        alone[reqs.task.name] = score(reqs, packed=False, share=False)
        assert alone[reqs.task.name].abs().min() > 0.1  # real log-likelihoods, not zeros
        for packed in (False, True):
            diff = (score(reqs, packed) - alone[reqs.task.name]).abs().max()
            assert diff <= tol, (reqs.task.name, packed, float(diff), tol)
    # Negative control: the shared rows read one position early are caught.
    monkeypatch.setattr(scoring, "read_span", lambda w: (len(w.tokens) - len(w.targets) - 1, len(w.tokens) - 1))
    for reqs in evaluator.tasks:
        assert (score(reqs, packed=False) - alone[reqs.task.name]).abs().max() > 100 * tol, reqs.task.name
