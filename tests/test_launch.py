"""The launchers in launch/, run on this machine: multi-node torchrun as two local "nodes", the Slurm
script under stand-in scontrol/srun, the PyTorchJob's command under the operator's PET_* variables,
and a hung rank ending the job within parallel.timeout_s with a message instead of a hang."""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from tests.conftest import ROOT, drain, env, pid_of_rank, tiny_args

pytestmark = pytest.mark.slow

TRAIN = tiny_args() + ["--train.steps", "3", "--logging.progress", "off"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


HUNG_LAYOUTS = {  # name: (ranks, options); rank 1 shares rank 0's tp group in both
    "tp2-dp2": (4, ["--parallel.tp", "2"]),
    "pp2-tp2": (4, ["--parallel.pp", "2", "--parallel.tp", "2", "--model.num-hidden-layers", "4"]),
}


@pytest.mark.parametrize("name", HUNG_LAYOUTS)
def test_a_hung_rank_in_a_multi_dim_layout_ends_the_job_within_the_timeout(tmp_path, name):
    """Every group of the mesh (tp, dp, the flattened ones) carries parallel.timeout_s, not c10d's
    30-minute default: a rank waiting on the stopped one (in its tp, dp or pipeline group) names the
    timeout; which rank notices first depends on the layout."""
    nproc, layout = HUNG_LAYOUTS[name]
    timeout_s = 10
    run_id = f"hang-{name}-{os.getpid()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
           "meshtrain", "train", *tiny_args(), *layout, "--train.micro-batch-size", "1", "--train.steps", "100000",
           "--logging.progress", "off", "--parallel.timeout-s", str(timeout_s), "--train.run-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(HANG_TEST_ID=run_id), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = [], []
    readers = [drain(proc.stdout, out), drain(proc.stderr, err)]
    message = re.compile(r"\[rank \d+\] a collective did not complete")
    pid = None
    try:
        deadline = time.monotonic() + 300
        while not any(line.split()[:2] == ["step", "2/100000"] for _, line in out):  # training runs
            assert proc.poll() is None and time.monotonic() < deadline, "".join(l for _, l in err)[-3000:]
            time.sleep(0.2)
        pid = pid_of_rank(1, run_id)
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # rank 1 hangs: alive, silent
        stopped_at = time.monotonic()
        while not any(message.search(line) for _, line in err) and time.monotonic() < stopped_at + timeout_s + 60:
            time.sleep(0.2)
        said_at = next((t for t, line in err if message.search(line)), None)
    finally:
        if pid is not None:
            try:  # torchrun's SIGTERM, pending while it was stopped, now ends it
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:  # torchrun's SIGKILL got there first
                pass
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        for reader in readers:
            reader.join(timeout=10)
    text = "".join(line for _, line in err)
    assert said_at is not None, f"no rank said {message.pattern!r} within {timeout_s + 60} s of the hang:\n{text[-3000:]}"
    assert said_at - stopped_at < timeout_s + 30, said_at - stopped_at
    assert f"parallel.timeout_s={timeout_s}" in text
    assert proc.returncode != 0
    # The flight recorder: each rank that noticed names its last collective and writes its record.
    named = re.findall(r"\[rank (\d+)\] a collective did not complete.*?This rank's last collective: (gloo:\w+) on "
                       r"group (\S+) \(#\w+\), sequence (\d+).*?are in (\S+) \(compare", text)
    assert named, text[-3000:]
    for rank, op, group, sequence, path in named:
        record = json.loads(pathlib.Path(path).read_text())
        assert pathlib.Path(path) == tmp_path / "flight_recorder" / f"rank{rank}.json"
        last = record["entries"][-1]
        assert (last["profiling_name"], last["process_group"][1], str(last["collective_seq_id"])) == (op, group, sequence)
