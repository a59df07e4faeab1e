"""The launchers in launch/, run on this machine: multi-node torchrun as two local "nodes", the Slurm
script under stand-in scontrol/srun, the PyTorchJob's command under the operator's PET_* variables,
and a hung rank ending the job within parallel.timeout_s with a message instead of a hang."""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from tests.conftest import ROOT, tiny_args

pytestmark = pytest.mark.slow

TRAIN = tiny_args() + ["--train.steps", "3", "--logging.progress", "off"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra) -> dict:
    return {**os.environ, "MESHTRAIN_PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
            **{k: str(v) for k, v in extra.items()}}


def finish(procs: list[subprocess.Popen], timeout: int = 300) -> list[tuple[int, str, str]]:
    return [(p.returncode, *p.communicate(timeout=timeout)) for p in procs]


def test_multinode_script_as_two_local_nodes(tmp_path):
    port = free_port()
    procs = [subprocess.Popen(["bash", "launch/multinode.sh", *TRAIN, "--train.run-dir", str(tmp_path)], cwd=ROOT,
                              env=env(NNODES=2, NODE_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                      NPROC_PER_NODE=2, RDZV_ID="test"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = finish(procs)
    assert all(p.returncode == 0 for p in procs), [r[2][-3000:] for r in results]
    out = "".join(r[1] for r in results)
    assert "(world 4)" in out and "step 3/3" in out


def test_multinode_script_names_a_missing_variable():
    proc = subprocess.run(["bash", "launch/multinode.sh"], cwd=ROOT, env=env(NNODES=2), capture_output=True, text=True)
    assert proc.returncode != 0 and "set NODE_RANK" in proc.stderr


def test_slurm_script_under_stand_in_scontrol_and_srun(tmp_path):
    """srun's contract: run the step once per node with SLURM_NODEID set; scontrol names the hosts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho 127.0.0.1\necho 127.0.0.2\n")
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\nshift  # --kill-on-bad-exit=1\n"
        "for i in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$i \"$@\" & done\nwait\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    spooled = tmp_path / "slurm_script"  # sbatch runs a copy from its spool directory
    spooled.write_text((ROOT / "launch" / "slurm.sbatch").read_text())
    proc = subprocess.run(["bash", str(spooled), *TRAIN, "--train.run-dir", str(tmp_path / "run")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=ROOT,
                                  SLURM_JOB_NODELIST="n[1-2]", SLURM_NNODES=2, SLURM_JOB_ID=42,
                                  SLURM_GPUS_ON_NODE=1, MASTER_PORT=free_port()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(world 2)" in proc.stdout and "step 3/3" in proc.stdout


def test_pytorchjob_command_under_the_operators_environment(tmp_path):
    job = yaml.safe_load((ROOT / "launch" / "pytorchjob.yaml").read_text())
    assert job["kind"] == "PyTorchJob" and job["apiVersion"] == "kubeflow.org/v1"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    (container,) = specs["Worker"]["template"]["spec"]["containers"]
    assert container["command"] == specs["Master"]["template"]["spec"]["containers"][0]["command"]
    # What the training operator injects into the pods of a 2-node job, one process each.
    command = [sys.executable, *container["command"][1:]]
    command = command[:command.index("--config")] + TRAIN + ["--train.run-dir", str(tmp_path)]
    port = free_port()
    procs = [subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env(PET_NNODES=2, PET_NPROC_PER_NODE=1, PET_NODE_RANK=rank,
                                      PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=port))
             for rank in (0, 1)]
    results = finish(procs)
    assert all(p.returncode == 0 for p in procs), [r[2][-3000:] for r in results]
    assert "(world 2)" in results[0][1] and "step 3/3" in results[0][1]


def pid_of_rank(rank: int, run_id: str) -> int | None:
    for proc in pathlib.Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"RANK={rank}".encode() in environ and f"HANG_TEST_ID={run_id}".encode() in environ:
            return int(proc.name)
    return None


def test_a_hung_rank_ends_the_job_within_the_timeout_with_a_message(tmp_path):
    timeout_s = 15
    run_id = f"hang-{os.getpid()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "meshtrain", "train", *tiny_args(), "--train.steps", "100000",
           "--logging.progress", "off", "--parallel.timeout-s", str(timeout_s), "--train.run-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(HANG_TEST_ID=run_id), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):  # wait until training runs
            line = proc.stdout.readline()
            if line.startswith("step 2/"):
                break
        pid = pid_of_rank(1, run_id)
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # rank 1 hangs: alive, silent
        stopped_at = time.monotonic()
        out, err = proc.communicate(timeout=timeout_s + 90)
        elapsed = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert elapsed < timeout_s + 60, elapsed
    assert "[rank 0] a collective did not complete" in err and f"parallel.timeout_s={timeout_s}" in err, err[-3000:]
