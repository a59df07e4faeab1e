"""Metrics dashboards beside metrics.jsonl: TensorBoard and Weights & Biases, from rank 0 only.

Each gets the resolved config and the layout line once, then every step's metrics (loss, grad
norm, lr, tokens/s, MFU, memory, MoE load, phase times when measured). Both packages are optional
extras; asking for one that is not installed is an error before training starts, not a warning
after it.
"""

from __future__ import annotations

import pathlib

import yaml

from meshtrain.config import LoggingConfig
from meshtrain.errors import ConfigError


class TensorBoard:
    def __init__(self, run_dir: pathlib.Path, config: dict, layout: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("logging.tensorboard=true needs the tensorboard package. Fix: pip install "
                              "'meshtrain[tensorboard]', or set logging.tensorboard=false") from None
        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.writer.add_text("config", f"```\n{yaml.safe_dump(config, sort_keys=False)}```")
        self.writer.add_text("layout", layout)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, cfg: LoggingConfig, run_dir: pathlib.Path, config: dict, layout: str):
        try:
            import wandb
        except ImportError:
            raise ConfigError("logging.wandb_project needs the wandb package. Fix: pip install 'meshtrain[wandb]', "
                              "or unset logging.wandb_project") from None
        self.run = wandb.init(project=cfg.wandb_project, dir=str(run_dir), mode=cfg.wandb_mode,
                              name=run_dir.resolve().name, config={**config, "layout": layout})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def check_installed(cfg: LoggingConfig) -> None:
    """Run before any process group exists: a missing package is one message, not a stalled job."""
    import importlib.util

    for wanted, module, extra, field in [(cfg.tensorboard, "tensorboard", "tensorboard", "logging.tensorboard=false"),
                                         (cfg.wandb_project, "wandb", "wandb", "no logging.wandb_project")]:
        if wanted and importlib.util.find_spec(module) is None:
            raise ConfigError(f"the {module} package is not installed. Fix: pip install 'meshtrain[{extra}]', "
                              f"or run with {field}")


def open_backends(cfg: LoggingConfig, run_dir: pathlib.Path, config: dict, layout: str) -> list:
    backends: list = []
    if cfg.tensorboard:
        backends.append(TensorBoard(run_dir, config, layout))
    if cfg.wandb_project:
        backends.append(WandB(cfg, run_dir, config, layout))
    return backends
