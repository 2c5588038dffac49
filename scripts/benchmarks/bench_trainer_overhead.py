"""Trainer overhead: the trainer's tokens/s vs. a bare PyTorch loop over the same model and work.

Both sides: the same model flavor and initial weights, batch, seq_len, compute dtype (bf16 autocast by
default, as the default CPU recipe), AdamW step and gradient clipping. The trainer side runs its real loop
(data loading from the shipped corpus, token counting, loss scaling, metrics every `log_freq` steps); the
bare side feeds pre-built tensors. The two alternate step by step inside one `trainer.train()` call: after
each trainer step one bare step runs, so both see the same machine conditions. A trainer step's time is its
whole loop iteration (everything outside `train_step` plus `train_step`); medians after a warm-up.

    python scripts/benchmarks/bench_trainer_overhead.py [--flavor debugmodel] [--seq-len 256] [--batch 8] [--steps 60]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch


def build_trainer(args, dump):
    from torchtitan.protocols.train_spec import config_manager
    from torchtitan.trainer import Trainer

    cfg = config_manager().parse_args([
        "--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch), "--training.steps", str(args.warmup + args.steps),
        "--training.mixed_precision_param", args.dtype, "--metrics.log_freq", "10",
        "--lr_scheduler.warmup_steps", "1", "--job.dump_folder", dump,
    ])
    return Trainer(cfg)


def make_bare(trainer, args):
    """A bare loop over an identically initialised copy of the model."""
    model = trainer.spec.model_cls(trainer.model_args)
    model.load_state_dict(trainer.model_parts[0].state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=trainer.cfg.optimizer.lr, betas=(0.9, 0.95),
                            weight_decay=0.1, foreach=True)
    from torchtitan.tools.precision import DTYPES

    inputs, labels = next(iter(trainer.dataloader))
    dtype = DTYPES[args.dtype]
    ctx = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else torch.autocast("cpu", enabled=False)

    def block(n):
        t0 = time.perf_counter()
        for _ in range(n):
            with ctx:
                logits = model(inputs)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    return block


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import logging

    trainer_s, bare_s = [], []
    with tempfile.TemporaryDirectory() as dump:
        trainer = build_trainer(args, dump)
        logging.getLogger("torchtitan").setLevel(logging.WARNING)
        bare = make_bare(trainer, args)
        real_step = trainer.train_step
        last = {"exit": None, "step": 0.0}

        def interleaved(microbatches):
            enter = time.perf_counter()
            if last["exit"] is not None and trainer.train_state.step >= args.warmup:
                trainer_s.append(enter - last["exit"] + last["step"])
                bare_s.append(last["bare"])
            t0 = time.perf_counter()
            out = real_step(microbatches)
            last["step"] = time.perf_counter() - t0
            last["bare"] = bare(1)
            last["exit"] = time.perf_counter()
            return out

        trainer.train_step = interleaved
        trainer.train()
        trainer.close()
    tok = args.batch * args.seq_len
    t_tps, b_tps = [tok / t for t in trainer_s], [tok / t for t in bare_s]
    tm, bm = statistics.median(t_tps), statistics.median(b_tps)
    print(f"model {args.flavor}, batch {args.batch} x seq {args.seq_len}, {args.dtype}, "
          f"threads {torch.get_num_threads()}, {len(t_tps)} steps each after {args.warmup} warm-up (alternating)")
    print(f"{'':>8} {'median tok/s':>13} {'min':>9} {'max':>9}")
    print(f"{'bare':>8} {bm:13,.0f} {min(b_tps):9,.0f} {max(b_tps):9,.0f}")
    print(f"{'trainer':>8} {tm:13,.0f} {min(t_tps):9,.0f} {max(t_tps):9,.0f}")
    print(f"trainer overhead: {100 * (bm / tm - 1):+.1f}% (median step time, trainer vs bare)")


if __name__ == "__main__":
    sys.exit(main())
