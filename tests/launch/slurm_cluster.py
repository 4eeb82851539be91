"""A real one-node Slurm cluster on this machine for the tests: ``munged``, ``slurmctld`` and ``slurmd`` from
Debian's packages (slurm-wlm 22.05 on bookworm: ``apt-get install slurmctld slurmd slurm-client munge``), on loopback,
with their own configuration, key, state and logs in a temporary directory and free ports.

    cluster = SlurmCluster(tmp_dir); env = cluster.start()   # SLURM_CONF etc.; raises SlurmUnavailable
    ...
    cluster.stop()

The daemons run as root (as on a cluster's nodes); :func:`unavailable_reason` says why they cannot start here.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "srun", "sinfo")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot start on this machine (the reason is the message)."""


def unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot be started here, or None."""
    missing = [b for b in DAEMONS + CLIENTS if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    if missing:
        return (f"Slurm/munge binaries missing: {missing} (apt-get install slurmctld slurmd slurm-client munge; "
                ".ci/run does it on Debian)")
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs (tests run as an unprivileged user)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.env: dict[str, str] = {}

    def _write_config(self) -> Path:
        root, node = self.root, socket.gethostname().split(".")[0]
        for d in ("state", "spool", "log"):
            (root / d).mkdir(parents=True, exist_ok=True)
        mem_mb = 2048
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemTotal:"):
                    mem_mb = int(int(line.split()[1]) / 1024 * 0.8)
        except OSError:
            pass
        conf = root / "slurm.conf"
        conf.write_text("\n".join([
            "ClusterName=aligntest",
            f"SlurmctldHost={node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root / 'munge.socket'}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",  # no cgroups in a container
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            "MinJobAge=600",  # ended jobs stay visible to scontrol while the tests look
            "KillWait=5",
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} RealMemory={mem_mb} State=UNKNOWN",
            f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
            "",
        ]))
        return conf

    def start(self, timeout: float = 60.0) -> dict[str, str]:
        reason = unavailable_reason()
        if reason:
            raise SlurmUnavailable(reason)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        conf = self._write_config()
        self.env = {"SLURM_CONF": str(conf)}
        env = {**os.environ, **self.env}
        for var in [v for v in env if v.startswith("SLURM_") and v != "SLURM_CONF"]:
            env.pop(var)  # not inside some outer allocation
        self._check([_binary("munged"), "--force", f"--socket={self.root / 'munge.socket'}",
                     f"--key-file={key}", f"--pid-file={self.root / 'munged.pid'}",
                     f"--log-file={self.root / 'log' / 'munged.log'}", f"--seed-file={self.root / 'munge.seed'}"], env)
        self._check([_binary("slurmctld"), "-c", "-f", str(conf)], env)
        self._check([_binary("slurmd"), "-f", str(conf)], env)
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, check=False)
            state = out.stdout.strip()
            if state in ("idle", "mix", "alloc"):
                return self.env
            time.sleep(0.5)
        self.stop()
        raise SlurmUnavailable(f"the node did not become idle in {timeout:.0f} s (sinfo: {state!r}); logs: "
                               f"{self.root / 'log'}")

    def _check(self, cmd: list[str], env: dict[str, str]) -> None:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=60)
        if out.returncode != 0:
            self.stop()
            raise SlurmUnavailable(f"{Path(cmd[0]).name} did not start ({out.returncode}): "
                                   f"{(out.stderr or out.stdout).strip()[-500:]}")

    def stop(self) -> None:
        for name in ("slurmd", "slurmctld", "munged"):
            pid_file = self.root / f"{name}.pid"
            try:
                pid = int(pid_file.read_text().strip())
            except (OSError, ValueError):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
