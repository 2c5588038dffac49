"""`python -m torchtitan.eval` against lm-evaluation-harness itself, on the same Hugging Face checkpoint.

A tiny random LlamaForCausalLM (2 layers, dim 64, a 64-token window) is saved with save_pretrained, with the
project's tokenizer as Hugging Face files. Five tasks are scored by the harness's Python API
(`lm_eval.simple_evaluate(model="hf", ...)`, float32, CPU, offline, the task files through a TaskManager
include path) and by our entry point on the folder:
- the shipped stdlib_next_line (multiple choice, acc and acc_norm);
- a HellaSwag-shaped multiple-choice task with Jinja templates, a description, 2 few-shot examples from a
  train split (the harness's sampler and seed) and acc_norm;
- a rolling perplexity task whose documents span several 64-token windows (word/byte perplexity, bits per byte);
- a loglikelihood task (a context and its continuation, perplexity);
- an ARC-style task whose choices are the letters A-D: one row per document on our side (shared rows, 12 rows
  for 48 requests), the harness's one-token-continuation cache on its side.
Checked: accuracies identical; every request's log-likelihood within 1e-4 absolute (plus 2 float32 ulps of the
request's total for the rolling documents of ~2,000 nats, below which float32 sums cannot resolve; see
_tolerance); word/byte perplexity, bits per byte and perplexity within 1e-5 relative; the bootstrapped stderrs
(perplexity's against the harness's reported value, the rolling metrics' against the harness's own estimator
on its items) within the bound `_stderr_tolerance` derives (see _check_bootstraps).

Tolerance: both sides sum float32 log-probabilities of at most 64 tokens of ~8 nats each; the two models
(transformers' and ours) differ only in summation order inside the matmuls and softmax, measured at ~1e-5
absolute on a window's sum here, so 1e-4 absolute leaves room without hiding a wrong token (one token off
moves a sum by nats). Perplexities are exp of mean log-likelihoods over ~1,000 tokens: 1e-5 relative.
Checked to fail: with encode_pair no longer moving the context's trailing whitespace into the continuation,
the first shipped request's log-likelihood is 6.7 nats off.
"""

import gzip
import json
import math
import random
import re

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

from torchtitan.eval import __main__ as eval_main  # noqa: E402
from torchtitan.eval.tasks import SHIPPED_DIR  # noqa: E402

CORPUS = SHIPPED_DIR.parent / "stdlib_docs" / "validation.jsonl.gz"
WINDOW = 64
ITERS = 2500  # bootstrap resamples on both sides (the harness's default is 100000)


def _texts() -> list[str]:
    with gzip.open(CORPUS, "rt") as f:
        return [json.loads(line)["text"] for line in f]


def _write_tasks(folder) -> None:
    paras = [p.strip() for t in _texts() for p in t.split("\n\n") if 60 < len(p.strip()) < 400]
    rnd = random.Random(0)
    mc = []
    for p in paras[:40]:
        words = p.split()
        cut = len(words) // 2
        others = [rnd.choice(paras).split() for _ in range(3)]
        endings = [" ".join(words[cut:cut + 8])] + [" ".join(o[len(o) // 2:len(o) // 2 + rnd.randint(3, 10)]) for o in others]
        rnd.shuffle(endings)
        mc.append({"ctx": " ".join(words[:cut]), "topic": words[0], "endings": endings,
                   "label": str(endings.index(" ".join(words[cut:cut + 8])))})
    with open(folder / "ll_test.jsonl", "w") as f:
        for p in paras[40:52]:
            words = p.split()
            f.write(json.dumps({"ctx": " ".join(words[:len(words) // 2]),
                                "ending": " " + " ".join(words[len(words) // 2:][:8])}) + "\n")
    (folder / "ll_next.yaml").write_text(f"""\
task: ll_next
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'll_test.jsonl'}
output_type: loglikelihood
test_split: test
doc_to_text: ctx
doc_to_target: ending
metric_list:
  - metric: perplexity
""")
    for split, rows in (("train", mc[:10]), ("test", mc[10:22])):
        with open(folder / f"mc_{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    (folder / "mc_norm.yaml").write_text(f"""\
task: mc_norm
dataset_path: json
dataset_kwargs:
  data_files:
    train: {folder / 'mc_train.jsonl'}
    test: {folder / 'mc_test.jsonl'}
output_type: multiple_choice
training_split: train
test_split: test
description: "Complete the docstring.\\n\\n"
doc_to_text: "{{{{topic}}}}: {{{{ctx}}}}"
doc_to_target: "{{{{label}}}}"
doc_to_choice: "{{{{endings}}}}"
num_fewshot: 2
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    with open(folder / "roll_test.jsonl", "w") as f:
        for t in _texts()[:3]:
            f.write(json.dumps({"page": t[:700]}) + "\n")
    (folder / "rolling.yaml").write_text(f"""\
task: rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'roll_test.jsonl'}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{page}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")
    with open(folder / "letters_test.jsonl", "w") as f:  # ARC-style: the choices are single-token labels
        for i, p in enumerate(paras[40:52]):
            f.write(json.dumps({"question": p[:120], "label": i % 4}) + "\n")
    (folder / "letters.yaml").write_text(f"""\
task: letters
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'letters_test.jsonl'}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: label
doc_to_choice: ["A", "B", "C", "D"]
""")
    shipped = (SHIPPED_DIR / "stdlib_next_line.yaml").read_text()
    (folder / "stdlib_next_line.yaml").write_text(
        shipped.replace("test: stdlib_next_line.jsonl", f"test: {SHIPPED_DIR / 'stdlib_next_line.jsonl'}"))


def _hf_folder(path):
    """A random Llama with the shipped tokenizer, saved as a Hugging Face folder at `path`; returns the model
    (also used by tests/distributed/test_eval_entry_layouts.py)."""
    from torchtitan.components.tokenizer.backends import build_tokenizer
    from torchtitan.components.tokenizer.hf_export import save_hf_tokenizer

    config = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=WINDOW, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, bos_token_id=2000, eos_token_id=2001)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # weights large enough that the choices' log-likelihoods differ
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    save_hf_tokenizer(build_tokenizer(None), str(path))
    return model


def _harness(folder, tasks_dir, names):
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={folder},dtype=float32,max_length={WINDOW}", tasks=names,
        task_manager=TaskManager(include_path=str(tasks_dir)), device="cpu", batch_size=4, log_samples=True,
        bootstrap_iters=ITERS, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    lls, items = {}, {}
    for name in names:
        samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
        flat = []
        for s in samples:
            for r in s["resps"]:
                flat.append(r[0][0] if isinstance(r[0], (list, tuple)) else r[0])
        lls[name] = flat
        items[name] = samples
    return out["results"], lls, items


def test_scores_equal_the_harness(tmp_path, monkeypatch):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    tasks_dir, ckpt = tmp_path / "tasks", tmp_path / "hf"
    tasks_dir.mkdir()
    _write_tasks(tasks_dir)
    _hf_folder(ckpt)
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")  # the harness's bootstrap in this process (the same draws)
    names = ["stdlib_next_line", "mc_norm", "rolling", "ll_next", "letters"]
    ours_file = tmp_path / "ours.json"
    rc = eval_main.main([str(ckpt), "--output", str(ours_file), "--training.seq_len", str(WINDOW),
                         "--training.mixed_precision_param", "float32",  # the harness runs dtype=float32
                         "--eval.local_batch_size", "4", "--eval.limit", "24", "--eval.bootstrap_iters", str(ITERS),
                         "--eval.tasks", ",".join(str(tasks_dir / f"{n}.yaml") for n in names)])
    assert rc == 0
    ours = json.loads(ours_file.read_text())
    # The shipped task's documents beyond the 24 we score: the harness scores the file; compare the first 24.
    results, theirs, samples = _harness(ckpt, tasks_dir, names)

    for name in names:
        a, b = ours["loglikelihoods"][name], theirs[name][:len(ours["loglikelihoods"][name])]
        assert len(a) == len(b) > 0, name
        for x, y in zip(a, b):
            assert abs(x - y) <= _tolerance(y), f"{name}: a request's log-likelihood {x} differs by {x - y:.3g} from the harness's"
    m = ours["metrics"]
    for metric in ("acc", "acc_norm"):
        assert m[f"eval/mc_norm/{metric}"] == results["mc_norm"][f"{metric},none"], metric
    assert m["eval/letters/acc"] == results["letters"]["acc,none"]
    # The letters' four requests of a document read one row (the harness reads them from one forward too).
    assert m["eval/letters/requests"] == 48 and m["eval/letters/rows"] == 12, m
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        want = results["rolling"][f"{metric},none"]
        assert math.isclose(m[f"eval/rolling/{metric}"], want, rel_tol=1e-5), (metric, m[f"eval/rolling/{metric}"], want)
    want = results["ll_next"]["perplexity,none"]
    assert math.isclose(m["eval/ll_next/perplexity"], want, rel_tol=1e-5), (m["eval/ll_next/perplexity"], want)
    # Not a vacuous comparison: the model tells the choices apart, the windows roll.
    assert len(set(round(x, 3) for x in ours["loglikelihoods"]["mc_norm"])) > 20
    _check_bootstraps(m, ours["loglikelihoods"], results, samples)


def _check_bootstraps(m, ours, results, samples):
    """The bootstrapped stderrs. `perplexity` (loglikelihood task): the harness's reported value. The rolling
    metrics: lm-eval 0.4.13 reports N/A (its list of bootstrappable aggregates leaves out weighted_perplexity
    and bits_per_byte), so its own `bootstrap_stderr` is called on its own per-document items. Both within the
    bound `_stderr_tolerance` derives from the two sides' log-likelihood differences; and on our
    log-likelihoods, its estimator gives ours to float64 rounding (the same draws: ITERS = 2500 is 2 chunks of
    1000 seeded 0 and 1, the last 500 dropped)."""
    from lm_eval.api import metrics as hm

    ll_items = [s["perplexity"] for s in samples["ll_next"]]
    key = "eval/ll_next/perplexity_stderr"
    assert abs(m[key] - results["ll_next"]["perplexity_stderr,none"]) <= _stderr_tolerance(
        ours["ll_next"], ll_items, [1] * len(ll_items), "perplexity"), (m[key], results["ll_next"])
    assert math.isclose(m[key], hm.bootstrap_stderr(hm.perplexity, ours["ll_next"], ITERS), rel_tol=1e-12)
    docs = [s["doc"]["page"] for s in samples["rolling"]]
    for metric, agg in (("word_perplexity", hm.weighted_perplexity), ("byte_perplexity", hm.weighted_perplexity),
                        ("bits_per_byte", hm.bits_per_byte)):
        assert results["rolling"][f"{metric}_stderr,none"] == "N/A"
        theirs = [tuple(s[metric]) for s in samples["rolling"]]
        units = [u for _, u in theirs]
        assert units == [len(re.split(r"\s+", d)) if metric == "word_perplexity" else len(d.encode()) for d in docs]
        got = m[f"eval/rolling/{metric}_stderr"]
        assert abs(got - hm.bootstrap_stderr(agg, theirs, ITERS)) <= _stderr_tolerance(
            ours["rolling"], [ll for ll, _ in theirs], units, metric), metric
        mine = list(zip(ours["rolling"], units))
        assert math.isclose(got, hm.bootstrap_stderr(agg, mine, ITERS), rel_tol=1e-12), metric


def _stderr_tolerance(ours: list[float], theirs: list[float], units: list[int], metric: str) -> float:
    """How far two bootstrapped stderrs may be apart when the documents' log-likelihoods differ (ours vs the
    harness's) but the resamples are the same. A replicate's statistic is a ratio sum ll / sum units over the
    drawn documents, which moves by at most b = max_i |dll_i| / units_i; exp(-ratio) = p_r then by at most
    m_r = p_r e^b (e^b - 1), bits per byte by m_r = b / ln 2. The sample standard deviation is a seminorm over
    the R replicates divided by sqrt(R - 1), so it moves by at most sqrt(sum m_r^2 / (R - 1)) (triangle
    inequality). The p_r are our replicates, drawn as the harness draws them (chunk i of min(1000, ITERS) draws
    from random.Random(i)). 1% on top for float64 rounding of the sums."""
    b = max(abs(x - y) / u for x, y, u in zip(ours, theirs, units))
    chunk, n = min(1000, ITERS), len(ours)
    moves = []
    for i in range(ITERS // chunk):
        rnd = random.Random(i)
        for _ in range(chunk):
            idx = rnd.choices(range(n), k=n)
            p = math.exp(-sum(ours[j] for j in idx) / sum(units[j] for j in idx))
            moves.append(b / math.log(2) if metric == "bits_per_byte" else p * math.exp(b) * math.expm1(b))
    return 1.01 * math.sqrt(sum(x * x for x in moves) / (len(moves) - 1)) + 1e-12


def _tolerance(ll: float) -> float:
    """1e-4 absolute, widened to float32's own resolution for long documents: the harness rounds each window's
    sum to float32 (as we do), and one unit in the last place of a 2,000-nat sum is 1.2e-4, so two sides that
    each round correctly can differ by an ulp or two there. 2 ulps of the total (4 * 2^-24 relative) on top."""
    return 1e-4 + 4 * 2.0**-24 * abs(ll)
