"""What ``meshtrain train ARGS`` does on each rank, on the batch's process group: resolve, plan, train
(commands.train.train), with the job's directory as the run dir (metrics.jsonl, checkpoints/)."""

from meshtrain.cli import parse
from meshtrain.commands.train import plan, resolve, train
from meshtrain.config import JobConfig


def run(args, out, runtime) -> None:
    cfg = resolve(parse(JobConfig, [*args, "--train.run-dir", str(out)], "meshtrain train"))
    train(cfg, plan(cfg), runtime)
