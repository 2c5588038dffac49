"""How gloo point-to-point transfers can abort a process, tried one scenario at a time on 2 local ranks (issue 31:
one run in eight of the CP 2 command died with SIGABRT in a rank).

    python scripts/diagnostics/gloo_p2p_probe.py                      # every scenario
    python scripts/diagnostics/gloo_p2p_probe.py same_tag_crossed     # one

Each scenario starts two fresh processes (gloo over loopback) and prints how each rank ended: `ok`, an exception's
first line, or the signal that killed it, with the first line gloo wrote to stderr. What the scenarios test:

- same_tag_in_order: ring attention's backward before the tag fix. Two transfers in flight to the same peer
  under one tag, a bf16 k/v shard and a float32 (dk, dv) partial (twice its bytes), posted in the same order on
  both ranks, 300 times. gloo matches a receive by (peer, tag) first in, first out, so this is safe.
- same_tag_crossed: the same, but rank 1 posts its receives in the other order: the float32 message lands in the
  smaller bf16 receive and gloo's transport thread fails an enforce (`op.preamble.length <= op.nbytes`) that
  nothing catches: SIGABRT. This is the abort the distinct tags of context_parallel.py exclude.
- distinct_tags_crossed: the crossed order with the tags ring attention uses now (0 and 1): each message finds
  its own receive; no abort.
- peer_gone_mid_recv: a rank waits for a message while its peer destroys its process group and exits: the wait
  raises (a Python exception: torchrun reports exit code 1, not a signal).
- exit_with_send_in_flight: a rank exits without waiting for its send or destroying its process group, while
  the peer is still receiving: how the interpreter's exit treats gloo's live threads.
"""

import os
import subprocess
import sys
import time

SCENARIOS = ["same_tag_in_order", "same_tag_crossed", "distinct_tags_crossed", "peer_gone_mid_recv",
             "exit_with_send_in_flight"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPE = (4, 2, 64, 64)  # a [B, H, S/cp, D] k/v shard of the command, roughly


def rank_main(scenario: str, rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    peer = 1 - rank

    if scenario in ("same_tag_in_order", "same_tag_crossed", "distinct_tags_crossed"):
        torch.manual_seed(0)  # the same tensors on both ranks: each must receive exactly what it sent
        kv = torch.randn(SHAPE, dtype=torch.bfloat16)
        dkv = torch.randn(SHAPE, dtype=torch.float32)
        dkv_tag = 1 if scenario == "distinct_tags_crossed" else 0
        crossed = scenario != "same_tag_in_order" and rank == 1
        for _ in range(300 if scenario == "same_tag_in_order" else 3):
            requests = []
            got_kv, got_dkv = torch.empty_like(kv), torch.empty_like(dkv)
            requests.append(dist.isend(kv, peer, tag=0))
            requests.append(dist.isend(dkv, peer, tag=dkv_tag))
            if crossed:  # rank 1 posts the float32 receive first
                requests.append(dist.irecv(got_dkv, peer, tag=dkv_tag))
                requests.append(dist.irecv(got_kv, peer, tag=0))
            else:
                requests.append(dist.irecv(got_kv, peer, tag=0))
                requests.append(dist.irecv(got_dkv, peer, tag=dkv_tag))
            for r in requests:
                r.wait()
            assert torch.equal(got_kv, kv) and torch.equal(got_dkv, dkv)  # both ranks send the same tensors
    elif scenario == "peer_gone_mid_recv":
        if rank == 0:
            time.sleep(1.0)
            dist.destroy_process_group()
            return
        received = torch.empty(SHAPE)
        dist.irecv(received, peer).wait()
    elif scenario == "exit_with_send_in_flight":
        big = torch.randn(64, 2**20)  # 256 MiB: the send is still in flight when rank 0 leaves
        if rank == 0:
            dist.isend(big, peer)
            return  # interpreter exit with the process group alive and the send not waited for
        received = torch.empty_like(big)
        dist.irecv(received, peer).wait()
    dist.destroy_process_group()


def run(scenario: str) -> list[str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), scenario, str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outcomes = []
    for rank, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            outcomes.append(f"rank {rank}: hung (killed after 120 s)")
            continue
        lines = [line for line in err.splitlines() if line.strip()]
        gloo = next((line for line in lines if "terminate called" in line or "enforce fail" in line
                     or "what():" in line), "")
        if p.returncode < 0:
            outcomes.append(f"rank {rank}: killed by signal {-p.returncode}" + (f" ({gloo.strip()[:160]})" if gloo else ""))
        elif p.returncode:
            outcomes.append(f"rank {rank}: exit {p.returncode}: {(lines[-1] if lines else '')[:160]}")
        else:
            outcomes.append(f"rank {rank}: ok")
    return outcomes


def main() -> int:
    if sys.argv[1:2] == ["--rank"]:
        rank_main(sys.argv[3], int(sys.argv[2]), int(sys.argv[4]))
        return 0
    for scenario in sys.argv[1:] or SCENARIOS:
        print(f"{scenario}: " + "; ".join(run(scenario)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
