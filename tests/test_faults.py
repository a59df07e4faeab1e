"""Faults a user's machine throws at a job, tried for real: a killed launcher, a second job in the
same run dir, a read-only file system, a full disk. Each ends with a message naming the cause, and
nothing that looks like a finished checkpoint is left behind."""

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, drain, env, pid_of_rank, tiny_args

pytestmark = pytest.mark.slow

TRAIN = [*tiny_args(), "--logging.progress", "off"]


def torchrun_cmd(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "meshtrain", "train", *TRAIN, *args]


def raw_traceback(stderr: str) -> bool:
    """A traceback through meshtrain's code (torchrun's own report of a failed rank is not one)."""
    return f'File "{ROOT / "meshtrain"}' in stderr


def alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for_step(proc: subprocess.Popen, out: list, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not any(line.split()[:1] == ["step"] and line.split()[1].startswith(f"{step}/") for _, line in out):
        assert proc.poll() is None and time.monotonic() < deadline, f"the job ended or stalled (rc {proc.returncode})"
        time.sleep(0.2)


@contextlib.contextmanager
def background_job(cmd: list[str], run_id: str):
    """The job running, its output collected; killed with its ranks at the end whatever happened."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(HANG_TEST_ID=run_id), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = [], []
    readers = [drain(proc.stdout, out), drain(proc.stderr, err)]
    try:
        yield proc, out, err
    finally:
        for rank in range(8):
            if (pid := pid_of_rank(rank, run_id)) is not None:
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
        for reader in readers:
            reader.join(timeout=10)


def test_ranks_die_with_a_killed_launcher(tmp_path):
    run_id = f"orphan-{os.getpid()}"
    with background_job(torchrun_cmd(2, "--train.steps", "100000", "--train.run-dir", str(tmp_path)), run_id) as (
            proc, out, err):
        wait_for_step(proc, out, 2)
        ranks = [pid_of_rank(r, run_id) for r in (0, 1)]
        assert None not in ranks
        proc.kill()  # SIGKILL: torchrun cannot pass anything on to its ranks
        deadline = time.monotonic() + 20
        while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = [pid for pid in ranks if alive(pid)]
    assert not survivors, f"ranks {survivors} still ran 20 s after their launcher was killed"


def test_a_second_job_in_a_running_jobs_run_dir_or_checkpoint_dir_is_refused_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    first_cmd = [sys.executable, "-m", "meshtrain", "train", *TRAIN, "--train.steps", "100000",
                 "--train.run-dir", str(run_dir), "--checkpoint.interval", "100000"]
    second = [sys.executable, "-m", "meshtrain", "train", *TRAIN, "--train.steps", "2", "--train.run-dir", str(run_dir)]
    # its own run dir, but the first job's checkpoints: it would resume from them and delete the old ones
    third = [*second[:-1], str(tmp_path / "other"), "--checkpoint.dir", str(run_dir / "checkpoints")]
    with background_job(first_cmd, f"lock-{os.getpid()}") as (proc, out, err):
        wait_for_step(proc, out, 2)
        refused = [subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
                   for cmd in (second, third)]
        assert proc.poll() is None, "the first job must not be disturbed"
        proc.kill()
        proc.wait(timeout=60)
    assert [r.returncode for r in refused] == [2, 2], refused[0].stderr[-3000:] + refused[1].stderr[-3000:]
    assert f"train.run_dir={run_dir} is in use by another meshtrain job (pid {proc.pid} on" in refused[0].stderr
    assert (f"checkpoint.dir={run_dir / 'checkpoints'} is in use by another meshtrain job (pid {proc.pid} on"
            in refused[1].stderr)
    assert "Fix: wait for that job or stop it, or give this one another checkpoint.dir" in refused[1].stderr
    assert not any("Traceback" in r.stderr for r in refused)
    # The lock ends with its holder, even one killed with SIGKILL: no stale lock to clear by hand.
    after = subprocess.run(second, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert after.returncode == 0, after.stderr[-3000:]


@pytest.fixture
def mount_tmpfs(tmp_path):
    """mount_tmpfs(name, size_kib, read_only): a small file system of its own under tmp_path."""
    mounted = []

    def mount(name: str, size_kib: int = 1024, read_only: bool = False) -> pathlib.Path:
        point = tmp_path / name
        point.mkdir()
        options = f"size={size_kib}k" + (",ro" if read_only else "")
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True)
        if result.returncode != 0:
            pytest.skip(f"making a read-only or full file system needs mount (root): {result.stderr.decode()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


@pytest.mark.parametrize("field", ["train.run_dir", "checkpoint.dir"])
def test_a_read_only_directory_is_named_by_the_dry_run_and_by_the_ranks(mount_tmpfs, tmp_path, field):
    read_only = mount_tmpfs("ro", read_only=True)
    target = read_only / "sub"
    option = f"--{field.replace('_', '-')}"
    dirs = [option, str(target)] + (["--train.run-dir", str(tmp_path / "run")] if field == "checkpoint.dir" else [])
    dry = subprocess.run([sys.executable, "-m", "meshtrain", "train", *TRAIN, *dirs, "--train.dry-run", "True"],
                         cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert dry.returncode == 2 and f"{field}={target}: {read_only} is on a read-only file system" in dry.stderr, \
        dry.stderr[-3000:]
    job = subprocess.run(torchrun_cmd(2, "--train.steps", "2", *dirs), cwd=ROOT, env=env(), capture_output=True,
                         text=True, timeout=300)
    assert job.returncode != 0
    assert f"{field}={target}: {read_only} is on a read-only file system" in job.stderr, job.stderr[-3000:]
    assert not raw_traceback(job.stderr) and "did not complete" not in job.stderr, job.stderr[-3000:]


def test_a_read_only_default_checkpoint_dir_is_named_by_the_dry_run(mount_tmpfs, tmp_path):
    """checkpoint.dir unset: checkpoints go to run_dir/checkpoints, checked like an explicit one."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    read_only = mount_tmpfs("run/checkpoints", read_only=True)
    dry = subprocess.run([sys.executable, "-m", "meshtrain", "train", *TRAIN, "--train.run-dir", str(run_dir),
                          "--checkpoint.interval", "2", "--train.dry-run", "True"],
                         cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert dry.returncode == 2, dry.stderr[-3000:]
    assert f"checkpoint.dir={read_only}: {read_only} is on a read-only file system" in dry.stderr, dry.stderr[-3000:]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_during_a_checkpoint_is_named_on_every_rank_and_leaves_no_checkpoint(mount_tmpfs, tmp_path,
                                                                                          async_save):
    disk = mount_tmpfs("small", size_kib=64)
    job = subprocess.run(torchrun_cmd(2, "--train.steps", "4", "--train.run-dir", str(tmp_path / "run"),
                                      "--checkpoint.dir", str(disk), "--checkpoint.interval", "2",
                                      "--checkpoint.async-save", str(async_save)),
                         cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert job.returncode != 0
    for rank in (0, 1):
        assert f"[rank {rank}] checkpoint step-000002 was not saved: rank" in job.stderr, job.stderr[-3000:]
    assert "No space left on device" in job.stderr and not raw_traceback(job.stderr), job.stderr[-3000:]
    assert not any((p / "meshtrain.json").exists() for p in disk.iterdir()), list(disk.iterdir())


def test_an_unreadable_data_file_is_named_with_the_fix(tmp_path):
    """Run as an unprivileged user (root reads everything): prepare's input and train's data.path."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("reading as another user needs root and setpriv")
    shared = tmp_path / "shared"
    shared.mkdir()
    for directory in (tmp_path, shared):
        directory.chmod(0o777)  # nobody reaches and writes the run dirs; tmp_path's parents are root's
    with contextlib.suppress(PermissionError):
        for parent in tmp_path.parents:
            if parent != pathlib.Path("/") and not parent.stat().st_mode & 0o001:
                parent.chmod(parent.stat().st_mode | 0o001)
    secret = shared / "secret.txt"
    secret.write_text("text nobody may read\n" * 100)
    secret.chmod(0o000)
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "meshtrain"]
    runs = [subprocess.run([*as_nobody, *cmd], cwd=ROOT, env=env(HOME=str(shared)), capture_output=True, text=True,
                           timeout=300)
            for cmd in (["prepare", "--input", str(secret), "--output", str(shared / "data"), "--workers", "0"],
                        ["train", *TRAIN, "--data.path", str(secret), "--train.run-dir", str(shared / "run")])]
    for proc in runs:
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert (f"meshtrain: error: {secret}: Permission denied. Fix: give this user access to it (chmod/chown) "
                "or use a copy it can access") in proc.stderr, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr


@contextlib.contextmanager
def prepare_writing(tmp_path):
    """`meshtrain prepare` with one tokenizing worker, yielded once it has written its first chunk
    (the worker is then tokenizing the next); every process it started is killed at the end."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):  # 40 documents (a .txt file is one), tokenized one a chunk: ~0.15 s each here
        (src / f"doc{i:02}.txt").write_text(f"document {i} " + "lorem ipsum dolor sit amet " * 50_000 + "\n")
    # A session of its own: Ctrl-C signals the terminal's whole process group, the tokenizing workers
    # too. SIGINT back to its default first, as on a terminal: a shell that runs this suite in the
    # background (`cmd &` without job control) hands every child SIGINT ignored, and Python then
    # installs no KeyboardInterrupt handler (the CI run of this test ended with status 0).
    as_on_a_terminal = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    proc = subprocess.Popen([sys.executable, "-c", as_on_a_terminal, sys.executable, "-m", "meshtrain", "prepare",
                             "--input", str(src), "--output", str(tmp_path / "data"), "--workers", "1",
                             "--chunk-documents", "1"],
                            cwd=ROOT, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline, written = time.monotonic() + 120, tmp_path / "data.bin.incomplete"
        while not (written.exists() and written.stat().st_size > 0) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.02)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def ended(proc: subprocess.Popen) -> str:
    """Its stderr once it has ended, or what is still running in its process group (and holds its
    pipes open) if it has not within a minute."""
    try:
        return proc.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        left = subprocess.run(["ps", "-o", "pid,stat,wchan:20,args", "-g", str(proc.pid)], capture_output=True,
                              text=True).stdout
        pytest.fail(f"still running a minute later:\n{left}")


def test_ctrl_c_during_prepare_says_so_once_and_leaves_nothing_that_opens(tmp_path):
    with prepare_writing(tmp_path) as proc:
        os.killpg(proc.pid, signal.SIGINT)
        stderr = ended(proc)
    assert proc.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "meshtrain prepare: interrupted; nothing incomplete was published"
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no .bin/.idx/.json/.lock left


def test_a_tokenizing_worker_killed_by_the_oom_killer_is_named_and_prepare_publishes_nothing(tmp_path):
    """A multiprocessing.Pool waited forever for the lost chunk."""
    with prepare_writing(tmp_path) as proc:
        workers = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                      text=True).stdout.split()
                   if b"spawn_main" in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        stderr = ended(proc)
    assert proc.returncode == 2, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        f"meshtrain: error: prepare: tokenizing worker 0 (pid {workers[0]}) was killed by signal 9 (SIGKILL: out of "
        "memory?) before answering; nothing was published. Fix: rerun (with fewer --workers or a smaller "
        "--chunk-documents if memory ran out)"), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_short_write_on_a_full_disk_is_named_as_a_full_disk(mount_tmpfs):
    """torch's zip writer reports a write cut short by a full disk as "unexpected pos N vs M"."""
    from meshtrain.checkpoint.checkpointer import _write_failure

    disk = mount_tmpfs("full", size_kib=4096)
    with contextlib.suppress(OSError), open(disk / "filler", "wb") as f:
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    short_write = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")
    assert _write_failure(short_write, disk / "step-000002.incomplete") == (
        f"rank 0 cannot write checkpoint {disk / 'step-000002.incomplete'}: No space left on device. "
        "Fix: free space there or point it at a larger disk")
    (disk / "filler").unlink()  # with room, the same message is not taken for a full disk
    assert "unexpected pos 704 vs 598" in _write_failure(short_write, disk / "step-000002.incomplete")
