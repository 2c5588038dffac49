"""A throwaway single-host Slurm cluster for tests: munged, slurmctld and one slurmd per emulated node, all
started from a generated config in one folder and stopped by the pids this module started.

Everything lives under the given folder (key, sockets, state, spool, logs), so nothing of the host's own
Slurm or munge setup is read or changed. Runs as root (slurmd must). Several nodes on one host (`nodes>1`)
are slurmd processes started with `-N nodeK`, each with its own NodeName and Port but the same address;
Debian 12's Slurm 22.05 runs them so. `nodes=1` names the node after the host.
"""

import os
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager

PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel")


def missing_programs() -> list[str]:
    return [name for name in PROGRAMS if shutil.which(name) is None and not os.path.exists(f"/usr/sbin/{name}")]


def _program(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(folder: str, *, nodes: int, cpus: int) -> dict:
    """slurm.conf for `nodes` emulated nodes of `cpus` CPUs on this host; returns the paths and ports."""
    host = socket.gethostname()
    paths = {name: os.path.join(folder, name) for name in ("state", "spool", "log", "munge")}
    for path in paths.values():
        os.makedirs(path, exist_ok=True)
    os.chmod(paths["munge"], 0o700)
    munge_socket = os.path.join(paths["munge"], "munge.socket")
    node_names = [host] if nodes == 1 else [f"node{i}" for i in range(1, nodes + 1)]
    lines = [
        "ClusterName=titantest",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={paths['state']}",
        f"SlurmdSpoolDir={paths['spool']}/%n",
        f"SlurmctldPidFile={paths['state']}/slurmctld.pid",
        f"SlurmdPidFile={paths['spool']}/slurmd-%n.pid",
        f"SlurmctldLogFile={paths['log']}/slurmctld.log",
        f"SlurmdLogFile={paths['log']}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",  # no cgroups in containers
        "TaskPlugin=task/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "ReturnToService=2",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MailProg=/bin/true",
        "InactiveLimit=0",
        "KillWait=10",
        "SlurmdTimeout=60",
    ]
    for name in node_names:
        port = f" Port={_free_port()}" if nodes > 1 else ""
        lines.append(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN{port}")
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES")
    conf = os.path.join(folder, "slurm.conf")
    with open(conf, "w") as f:
        f.write("\n".join(lines) + "\n")
    return {"conf": conf, "munge_socket": munge_socket, "nodes": node_names, **paths}


def _wait_for(check, timeout: float, what: str, logs: list[str]) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.5)
    tails = []
    for log in logs:
        if os.path.isfile(log):
            with open(log) as f:
                tails.append(f"--- {log}\n" + "".join(f.readlines()[-20:]))
    raise RuntimeError(f"{what} within {timeout:.0f}s\n" + "\n".join(tails))


@contextmanager
def slurm_cluster(folder: str, *, nodes: int = 1, cpus: int = 2):
    """Starts the cluster; yields the environment for sbatch/squeue (SLURM_CONF set); stops every daemon it
    started, by pid, on exit."""
    cfg = write_config(folder, nodes=nodes, cpus=cpus)
    env = {**os.environ, "SLURM_CONF": cfg["conf"]}
    started: list[subprocess.Popen] = []
    logs = [os.path.join(cfg["log"], "slurmctld.log")] + [
        os.path.join(cfg["log"], f"slurmd-{n}.log") for n in cfg["nodes"]
    ]

    def start(argv):
        out = open(os.path.join(cfg["log"], os.path.basename(argv[0]) + f"-{len(started)}.out"), "w")
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        started.append(proc)
        return proc

    try:
        key = os.path.join(cfg["munge"], "munge.key")
        subprocess.run([_program("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
        os.chmod(key, 0o600)
        start([_program("munged"), "--foreground", "--force", f"--socket={cfg['munge_socket']}", f"--key-file={key}",
               f"--pid-file={cfg['munge']}/munged.pid", f"--seed-file={cfg['munge']}/munged.seed",
               f"--log-file={cfg['log']}/munged.log"])
        _wait_for(lambda: os.path.exists(cfg["munge_socket"]), 30, "munged did not start", [f"{cfg['log']}/munged.log"])
        start([_program("slurmctld"), "-D", "-i", "-f", cfg["conf"]])
        for name in cfg["nodes"]:
            start([_program("slurmd"), "-D", "-f", cfg["conf"], "-N", name])

        def idle():
            out = subprocess.run([_program("sinfo"), "-h", "-o", "%T %D"], env=env, capture_output=True, text=True)
            return out.returncode == 0 and out.stdout.split()[:2] == ["idle", str(len(cfg["nodes"]))]

        _wait_for(idle, 90, f"the {len(cfg['nodes'])} node(s) did not come up idle", logs)
        yield env
    finally:
        for proc in reversed(started):  # slurmd first, munged last
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(started):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
