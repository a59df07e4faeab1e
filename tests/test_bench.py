"""The benchmarks run end to end (tiny sizes) and produce their tables, so they cannot rot.
They assert what a run must produce, never how fast it was."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.batch import COMMAND, Job, command_result
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_pipeline_bubble_bench_measures_every_rank(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "pipeline_bubble.py"), "--hidden", "64", "--layers", "4",
           "--seq-len", "32", "--steps", "1", "--warmup", "1", "--microbatches", "4",
           "--only", "1F1B", "ZBVZeroBubble", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "pipeline_bubble.json").read_text())
    assert set(results) == {"1F1B", "ZBVZeroBubble"}
    for result in results.values():
        assert [r["rank"] for r in result["ranks"]] == [0, 1]
        assert all(0 < r["busy_s"] <= r["step_s"] for r in result["ranks"])
    assert "| 1F1B | 1 |" in (tmp_path / "pipeline_bubble.md").read_text()


def test_hf_io_bench_runs_side_by_side(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "hf_io.py"), "--hidden", "128", "--layers", "2", "--vocab", "512",
           "--shard-mb", "1", "--ranks", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "hf_io.json").read_text())
    assert result["import_s"] > 0 and result["export_s"] > 0 and result["plain_read_s"] > 0
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert all(r["local_shard_bytes"] > 0 for r in result["ranks"])
    assert "| meshtrain export, 2 ranks" in (tmp_path / "hf_io.md").read_text()
    assert not (tmp_path / "src").exists()  # the generated checkpoint is cleaned up


def test_cp_memory_bench_shows_per_rank_activations(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "cp_memory.py"), "--seq-len", "256", "--hidden", "64",
           "--layers", "2", "--cps", "1", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "cp_memory.json").read_text())
    assert [r["tokens"] for r in results["2"]["ranks"]] == [128, 128]
    assert all(r["saved_bytes"] > 0 for cp in ("1", "2") for r in results[cp]["ranks"])


# The three longest benchmarks run as command jobs (tests/batch.py): in the background from the session's
# start, beside the batches and the foreground tests; each test reads its command's output.
COMPARE = Job("bench/compare", 0, COMMAND, (
    sys.executable, str(ROOT / "bench" / "compare.py"), "--hidden", "64", "--layers", "2", "--seq-len", "64",
    "--global-batch", "8", "--micro-batch", "2", "--steps", "1", "--warmup", "1", "--repeats", "1",
    "--skip", "1 rank compiled"),  # compiling is the parity tests' (tests/test_parallel.py)
    prepare=lambda directory: ("--out", str(directory / "out")))


@pytest.mark.job(COMPARE)
def test_compare_bench_sets_every_layout_beside_its_minimum(batches):
    tmp_path = batches.result(COMPARE) / "out"
    proc = command_result(tmp_path.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "compare.json").read_text())
    speed = result["throughput"]
    assert set(speed) == {"transformers 1 rank", "meshtrain 1 rank", "meshtrain 1 rank selective AC",
                          "meshtrain 1 rank full AC", "meshtrain dp2",
                          "meshtrain dp2 reduce_last", "meshtrain dp2 reduce_last_unsharded", "meshtrain tp2",
                          "meshtrain pp2"}
    assert all(s["tokens_per_s"] > 0 and s["vs_transformers"] > 0 for s in speed.values())
    parts = {(name, p["part"]): p for name, c in result["communication"].items() for p in c["parts"]}
    # layouts whose communication is at its floor must stay there: a regression shows as a ratio above 1
    for key in [("tp2", "TP"), ("tp2+sp", "TP"), ("pp2", "PP")]:
        assert parts[key]["ratio"] == pytest.approx(1.0, abs=0.02), (key, parts[key])
    # the EP minimum assumes uniform routing; a random router sends a binomial share off-rank
    assert parts[("ep2", "EP all-to-all")]["ratio"] == pytest.approx(1.0, abs=0.15)
    assert parts[("dp2", "FSDP")]["ratio"] >= 1.0 and parts[("cp2", "CP ring")]["ratio"] >= 1.0
    # accumulating without a reduce-scatter per micro-batch (2 here), then without re-gathering too
    fsdp = [parts[(name, "FSDP")] for name in ("dp2", "dp2 reduce_last", "dp2 reduce_last_unsharded")]
    assert fsdp[0]["ratio"] > fsdp[1]["ratio"] > fsdp[2]["ratio"] >= 1.0, [f["ratio"] for f in fsdp]
    assert fsdp[1]["calls"]["_reduce_scatter_base"] * 2 == fsdp[0]["calls"]["_reduce_scatter_base"]
    # float8 all-gathers: fewer bytes than dp2's for the same calls, against a floor that counts 1 B per weight
    float8 = parts[("dp2 float8", "FSDP")]
    assert float8["calls"] == fsdp[0]["calls"] and float8["rank0_bytes"] < fsdp[0]["rank0_bytes"]
    assert float8["ratio"] >= 1.0
    # what selective and full checkpointing keep, beside no checkpointing
    options = result["options"]
    assert 0 < options["1 rank full AC"]["activation_ratio"] < options["1 rank selective AC"]["activation_ratio"] < 1
    assert "1 rank compiled" not in options and "1 rank compiled" not in result["memory"]  # --skip
    for name, ranks in result["memory"].items():
        assert all(r["ratio"] == pytest.approx(1.0, rel=0.02) for r in ranks), name
    assert "| tp2 | TP | all_reduce" in (tmp_path / "compare.md").read_text()


IMAGE_LACKS = {"tyro", "docstring_parser", "typeguard", "torchdata", "torchao", "datasets", "wandb", "meshtrain"}
"""What the lent GPU machine's image does not have (../shared/REFERENCE.md section 7), meshtrain included."""


def image_like_python(tmp_path: pathlib.Path) -> pathlib.Path:
    """A Python that holds this venv's packages less those the GPU image lacks: a plain venv whose one
    .pth names a folder of links to the rest (the image has torch, transformers, pip, ...)."""
    import sysconfig
    import venv

    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    packages = tmp_path / "image-packages"
    packages.mkdir()
    for entry in site.iterdir():
        stem = entry.name.split("-")[0].split(".")[0].lower()
        if stem not in IMAGE_LACKS and not stem.startswith("__editable__") and entry.suffix != ".pth":
            (packages / entry.name).symlink_to(entry)
    venv.create(tmp_path / "image", with_pip=False)
    (pathlib.Path(sysconfig.get_paths(vars={"base": str(tmp_path / "image")})["purelib"]) / "image.pth").write_text(
        str(packages) + "\n")
    return tmp_path / "image" / "bin" / "python"


def gpu_check_offline(python: pathlib.Path, wheels: pathlib.Path, site: pathlib.Path, *args: str):
    """bench/gpu_check.sh as the lent machine runs it: no network (a new network namespace, loopback
    only), the image's python, the wheels carried beside the tree."""
    script = f"ip link set lo up && exec bash {ROOT / 'bench' / 'gpu_check.sh'} " + " ".join(f"'{a}'" for a in args)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GPU_CHECK_PYTHON": str(python), "GPU_CHECK_WHEELS": str(wheels),
           "GPU_CHECK_SITE": str(site)}
    env.pop("PYTHONPATH", None)
    return subprocess.run(["unshare", "--net", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env)


def offline_gpu_check(directory: pathlib.Path) -> tuple[str, ...]:
    """The command line of bench/gpu_check.sh --tiny as the lent machine runs it (gpu_check_offline), on an
    image-like Python made in ``directory``."""
    python = image_like_python(directory)
    script = (f"ip link set lo up && exec bash {ROOT / 'bench' / 'gpu_check.sh'} --tiny --variants "
              f"'meshtrain eager,meshtrain compile+float8' --out {directory / 'out'}")
    return ("env", "-u", "PYTHONPATH", "OMP_NUM_THREADS=1", f"GPU_CHECK_PYTHON={python}",
            f"GPU_CHECK_WHEELS={ROOT / '.whl'}", f"GPU_CHECK_SITE={directory / 'site'}", "unshare", "--net", "sh", "-c",
            script)


GPU_CHECK = Job("bench/gpu_check", 0, COMMAND, prepare=offline_gpu_check)


@pytest.mark.job(GPU_CHECK)
def test_gpu_check_runs_its_plumbing_at_toy_sizes_on_cpu(batches):
    """The GPU check's own run needs a GPU; here bench/gpu_check.sh runs --tiny offline on an image-like
    Python, installing what it lacks from the wheels bench/gpu_wheels.sh made (launch/setup_env.sh),
    and every piece but the compile row runs on CPU: transformers' eager loop, meshtrain's jobs, a
    refusal reported, the first-step losses, document masking and the SDPA operators."""
    tmp_path = batches.result(GPU_CHECK)
    python = tmp_path / "image" / "bin" / "python"
    assert subprocess.run([str(python), "-c", "import tyro"], capture_output=True).returncode != 0
    proc = command_result(tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "installing tyro docstring_parser typeguard torchdata torchao from" in proc.stdout
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    for model in ("llama-1.2b (tiny)", "qwen3-moe-small (tiny)"):
        jobs = result[model]
        assert jobs["transformers eager"]["tokens_per_s"] > 0 and jobs["meshtrain eager"]["tokens_per_s"] > 0
        assert "needs CUDA float8 tensor cores" in jobs["meshtrain compile+float8"]["refused"]
        losses = jobs["first_step_loss"]
        assert losses["meshtrain"] == pytest.approx(losses["transformers"], rel=1e-5)
    assert all(result["document_masking"][mode]["tokens_per_s"] > 0 for mode in ("on", "off"))
    assert "scaled_dot_product" in result["sdpa"]["causal"] and "scaled_dot_product" in result["sdpa"]["boolean mask"]
    table = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "| llama-1.2b (tiny) | meshtrain eager |" in table and "| document-masked |" in table


def test_gpu_check_without_its_wheels_says_what_to_do(tmp_path):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    proc = gpu_check_offline(image_like_python(tmp_path), empty, tmp_path / "site", "--tiny")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"gpu_check: the image lacks tyro docstring_parser typeguard torchdata torchao and {empty}/ holds no wheels: "
        f"run 'bash bench/gpu_wheels.sh' where the network is and carry {empty} with the tree"]


DATA_SCALE = Job("bench/data_scale", 0, COMMAND, (
    sys.executable, str(ROOT / "bench" / "data_scale.py"), "--sizes-gb", "0.002", "0.004", "--ranks", "2",
    "--steps", "2", "--prepare-mb", "0.5"), prepare=lambda directory: ("--out", str(directory / "out")))


@pytest.mark.job(DATA_SCALE)
def test_data_scale_bench_measures_memory_loader_and_prepare(batches):
    tmp_path = batches.result(DATA_SCALE) / "out"
    proc = command_result(tmp_path.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "data_scale.json").read_text())
    for size in ("0.002", "0.004"):
        assert [r["rss"]["RssAnon"] > 0 for r in result[size]["ranks"]] == [True, True]
        assert all(0 < r["load_s"] < r["step_s"] for r in result[size]["ranks"])
    assert result["0.004"]["tokens"] == 2 * result["0.002"]["tokens"]
    assert result["prepare"]["tokens"] > 0 and result["prepare"]["encode_batch_tokens_per_s"] > 0
    assert "| 0.004 GB |" in (tmp_path / "data_scale.md").read_text()
