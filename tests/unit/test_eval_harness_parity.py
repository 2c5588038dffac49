"""`python -m torchtitan.eval` against lm-evaluation-harness itself, on the same Hugging Face checkpoint.

A tiny random LlamaForCausalLM (2 layers, dim 64, a 64-token window) is saved with save_pretrained, with the
project's tokenizer as Hugging Face files. Three tasks are scored by the harness's Python API
(`lm_eval.simple_evaluate(model="hf", ...)`, float32, CPU, offline, the task files through a TaskManager
include path) and by our entry point on the folder:
- the shipped stdlib_next_line (multiple choice, acc and acc_norm);
- a HellaSwag-shaped multiple-choice task with Jinja templates, a description, 2 few-shot examples from a
  train split (the harness's sampler and seed) and acc_norm;
- a rolling perplexity task whose documents span several 64-token windows (word/byte perplexity, bits per byte).
Checked: accuracies identical; every request's log-likelihood within 1e-4 absolute (plus 2 float32 ulps of the
request's total for the rolling documents of ~2,000 nats, below which float32 sums cannot resolve; see
_tolerance); word/byte perplexity and bits per byte within 1e-5 relative.

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

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

from torchtitan.eval import __main__ as eval_main  # noqa: E402
from torchtitan.eval.tasks import SHIPPED_DIR  # noqa: E402

CORPUS = SHIPPED_DIR.parent / "stdlib_docs" / "validation.jsonl.gz"
WINDOW = 64


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
    shipped = (SHIPPED_DIR / "stdlib_next_line.yaml").read_text()
    (folder / "stdlib_next_line.yaml").write_text(
        shipped.replace("test: stdlib_next_line.jsonl", f"test: {SHIPPED_DIR / 'stdlib_next_line.jsonl'}"))


def _hf_folder(path) -> None:
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


def _harness(folder, tasks_dir, names):
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={folder},dtype=float32,max_length={WINDOW}", tasks=names,
        task_manager=TaskManager(include_path=str(tasks_dir)), device="cpu", batch_size=4, log_samples=True,
        bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    lls = {}
    for name in names:
        samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
        flat = []
        for s in samples:
            for r in s["resps"]:
                flat.append(r[0][0] if isinstance(r[0], (list, tuple)) else r[0])
        lls[name] = flat
    return out["results"], lls


def test_scores_equal_the_harness(tmp_path, monkeypatch):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    tasks_dir, ckpt = tmp_path / "tasks", tmp_path / "hf"
    tasks_dir.mkdir()
    _write_tasks(tasks_dir)
    _hf_folder(ckpt)
    names = ["stdlib_next_line", "mc_norm", "rolling"]
    ours_file = tmp_path / "ours.json"
    rc = eval_main.main([str(ckpt), "--output", str(ours_file), "--training.seq_len", str(WINDOW),
                         "--training.mixed_precision_param", "float32",  # the harness runs dtype=float32
                         "--eval.local_batch_size", "4", "--eval.limit", "24",
                         "--eval.tasks", ",".join(str(tasks_dir / f"{n}.yaml") for n in names)])
    assert rc == 0
    ours = json.loads(ours_file.read_text())
    # The shipped task's documents beyond the 24 we score: the harness scores the file; compare the first 24.
    results, theirs = _harness(ckpt, tasks_dir, names)

    for name in names:
        a, b = ours["loglikelihoods"][name], theirs[name][:len(ours["loglikelihoods"][name])]
        assert len(a) == len(b) > 0, name
        for x, y in zip(a, b):
            assert abs(x - y) <= _tolerance(y), f"{name}: a request's log-likelihood {x} differs by {x - y:.3g} from the harness's"
    m = ours["metrics"]
    for metric in ("acc", "acc_norm"):
        assert m[f"eval/mc_norm/{metric}"] == results["mc_norm"][f"{metric},none"], metric
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        want = results["rolling"][f"{metric},none"]
        assert math.isclose(m[f"eval/rolling/{metric}"], want, rel_tol=1e-5), (metric, m[f"eval/rolling/{metric}"], want)
    # Not a vacuous comparison: the model tells the choices apart, the windows roll.
    assert len(set(round(x, 3) for x in ours["loglikelihoods"]["mc_norm"])) > 20


def _tolerance(ll: float) -> float:
    """1e-4 absolute, widened to float32's own resolution for long documents: the harness rounds each window's
    sum to float32 (as we do), and one unit in the last place of a 2,000-nat sum is 1.2e-4, so two sides that
    each round correctly can differ by an ulp or two there. 2 ulps of the total (4 * 2^-24 relative) on top."""
    return 1e-4 + 4 * 2.0**-24 * abs(ll)
