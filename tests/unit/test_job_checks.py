"""Every malformed input the pre-flight check can judge without starting ranks gets one line and a non-zero
exit from `python -m torchtitan.preflight` (what ./run_train.sh runs before torchrun), never a traceback.
The inputs only ranks can judge are in tests/e2e/test_bad_input.py."""

import pytest

from torchtitan import preflight

TINY = ["--model.flavor", "debugmodel_tiny", "--training.seq_len", "32"]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    (root / "notatok.model").write_text("hello, I am not a SentencePiece model\n")
    (root / "tokenizer.json").write_text('{"version": "1.0", "model": 42}')
    (root / "empty.jsonl").write_text("")
    (root / "a_file").write_text("x")
    (root / "data.csv").write_text("text\nhello\n")
    (root / "shards" / "train").mkdir(parents=True)  # a shard folder written without the validation split
    return root


CASES = [
    # option values out of range (local_batch_size 0 was a ZeroDivisionError)
    (["--training.local_batch_size", "0"], "--training.local_batch_size must be at least 1, got 0"),
    (["--training.global_batch_size", "0"], "--training.global_batch_size must be -1 (local_batch_size x "
                                            "data-parallel degree) or at least 1, got 0"),
    (["--training.seq_len", "0"], "--training.seq_len must be at least 1, got 0"),
    (["--training.dataset", "/nonexistent/shards"], "shard folder /nonexistent/shards does not exist"),
    (["--training.datasets", "stdlib_docs:0.7,/nonexistent/shards:0.3"], "shard folder /nonexistent/shards does not exist"),
    (["--training.datasets", "stdlib_docs:0.7,stdlib_dox:0.3"], "unknown dataset 'stdlib_dox'"),
    (["--training.datasets", "stdlib_docs"], "must be SOURCE:WEIGHT with a positive weight"),
    (["--training.steps", "-5"], "--training.steps must be at least 1, got -5"),
    (["--training.gc_freq", "0"], "--training.gc_freq must be at least 1, got 0"),
    (["--validation.freq", "0"], "--validation.freq must be at least 1, got 0"),
    (["--validation.steps", "0"], "--validation.steps must be -1 (the whole validation split) or at least 1"),
    (["--validation.local_batch_size", "-1"], "--validation.local_batch_size must be at least 1, got -1"),
    (["--optimizer.lr", "-0.001"], "--optimizer.lr must be a number >= 0, got -0.001"),
    (["--optimizer.lr", "nan"], "--optimizer.lr must be a number >= 0, got nan"),
    (["--optimizer.beta2", "1.0"], "--optimizer.beta2 must be in [0, 1), got 1.0"),
    (["--optimizer.eps", "0"], "--optimizer.eps must be a positive number, got 0"),
    (["--optimizer.weight_decay", "-1"], "--optimizer.weight_decay must be a number >= 0, got -1"),
    (["--lr_scheduler.warmup_steps", "-1"], "lr_scheduler.warmup_steps must be >= 0, got -1"),
    (["--lr_scheduler.min_lr_factor", "2"], "lr_scheduler.min_lr_factor must be in [0, 1], got 2"),
    (["--parallelism.pipeline_parallel_microbatch_size", "0"],
     "--parallelism.pipeline_parallel_microbatch_size must be at least 1, got 0"),
    (["--checkpoint.interval", "0"], "--checkpoint.interval must be at least 1, got 0"),
    (["--checkpoint.keep_latest_k", "-2"], "--checkpoint.keep_latest_k must be 0 (keep all) or more, got -2"),
    (["--checkpoint.keep_every_n_steps", "-1"], "--checkpoint.keep_every_n_steps must be 0 (no milestones) or more"),
    (["--checkpoint.keep_every_n_steps", "5", "--checkpoint.keep_latest_k", "0"],
     "--checkpoint.keep_latest_k 0 keeps every checkpoint already; milestones"),
    (["--checkpoint.keep_every_n_steps", "5", "--checkpoint.interval", "2"],
     "--checkpoint.keep_every_n_steps 5 would keep no checkpoint: saves happen every --checkpoint.interval 2"),
    (["--checkpoint.keep_steps", "7,10", "--checkpoint.interval", "2"], "--checkpoint.keep_steps 7 is not a saved step"),
    (["--checkpoint.load_step", "-3"], "--checkpoint.load_step must be -1 (the latest checkpoint) or at least 0"),
    (["--metrics.log_freq", "0"], "--metrics.log_freq must be at least 1, got 0"),
    (["--profiling.profile_freq", "0"], "--profiling.profile_freq must be at least 1, got 0"),
    (["--activation_checkpoint.memory_budget", "1.5"], "--activation_checkpoint.memory_budget must be in [0, 1]"),
    (["--comm.train_timeout_seconds", "0"], "--comm.train_timeout_seconds must be at least 1, got 0"),
    (["--comm.hang_timeout_seconds", "-1"], "--comm.hang_timeout_seconds must be a number >= 0, got -1"),
    (["--training.cpu_kept_heap_growth", "0"], "--training.cpu_kept_heap_growth must be"),
    (["--guard.window", "3"], "--guard.window 3 is too small to judge a spike: the spread (MAD) of fewer than 4 steps"),
    (["--guard.threshold", "-3"], "--guard.threshold must be a positive number (robust standard deviations), got -3"),
    (["--guard.max_events", "-1"], "--guard.max_events must be 0 (stop at the first event) or more, got -1"),
    (["--guard.event_span", "-5"], "--guard.event_span must be 0 (count the events of the whole run) or more steps"),
    (["--guard.enable", "--guard.action", "rollback"], "--guard.action rollback reloads the last checkpoint: add "
                                                       "--checkpoint.enable"),
    # files
    (["--model.tokenizer_path", "{bad}/notatok.model"], "{bad}/notatok.model is not a SentencePiece tokenizer model"),
    (["--model.tokenizer_path", "{bad}/tokenizer.json"], "{bad}/tokenizer.json is not a Hugging Face tokenizer.json"),
    (["--model.tokenizer_path", "{bad}/missing"], "tokenizer path {bad}/missing does not exist"),
    (["--training.dataset", "local", "--training.dataset_path", "{bad}/empty.jsonl"],
     "local dataset file {bad}/empty.jsonl is empty"),
    (["--training.dataset", "local", "--training.dataset_path", "{bad}/nothing.jsonl"],
     "local dataset path {bad}/nothing.jsonl does not exist"),
    (["--training.dataset", "local", "--training.dataset_path", "{bad}/data.csv"],
     "local dataset path {bad}/data.csv must hold json, jsonl, parquet or txt files"),
    (["--training.dataset", "local"], "dataset 'local' needs dataset_path"),
    (["--training.dataset", "{bad}/shards", "--validation.enable"], "shard folder {bad}/shards has no validation/ split"),
    (["--training.dataset", "c5"], "unknown dataset 'c5': did you mean 'c4'"),
    (["--job.dump_folder", "{bad}/a_file/run"], "--job.dump_folder {bad}/a_file/run cannot be created: "
                                                "{bad}/a_file is a file, not a folder"),
    (["--job.dump_folder", "{bad}/a_file"], "{bad}/a_file is a file, not a folder"),
    # layout and model
    (["--parallelism.tensor_parallel_degree", "3"], "world size 2 is not divisible"),
    (["--model.flavor", "nope"], "unknown flavor 'nope'"),
]


@pytest.mark.parametrize("args, message", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_preflight_rejects_with_one_line(bad_files, capsys, args, message):
    args = [a.format(bad=bad_files) for a in args]
    assert preflight.main(["--world-size", "2", *TINY, *args]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert message.format(bad=bad_files) in err[0]


def test_unknown_guard_action_is_a_config_error(capsys):
    assert preflight.main(["--world-size", "2", *TINY, "--guard.action", "undo"]) == 2  # the parser's own line
    assert capsys.readouterr().err.splitlines() == ["error: --guard.action expects one of 'skip', 'rollback', got 'undo'"]


def test_preflight_accepts_the_tiny_recipe(tmp_path, capsys):
    assert preflight.main(["--world-size", "2", *TINY, "--job.dump_folder", str(tmp_path / "new" / "run")]) == 0
    assert capsys.readouterr().err == ""
    assert not (tmp_path / "new").exists()  # judging creates nothing
