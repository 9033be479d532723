"""A trainer rank other than 0: no server, it does what rank 0 relays, until rank 0 says stop.

SIGTERM and SIGINT are ignored: torchrun and systemd send them to every rank
at once, and rank 0 answers them by finishing the call in flight (which
needs this rank) and then telling this rank to stop. Should rank 0 die
instead, its sockets close, the wait for the next command fails and this
rank ends too.
"""

from __future__ import annotations

import signal

import structlog

from services.algo_registry import POLICY_LOSSES
from services.common.plugins import import_modules
from services.common.cli import log_config, parse_service_config
from services.common.logging import configure_logging
from services.trainer.config import TrainerServiceConfig
from services.trainer.ranks import fatal, join
from services.trainer.worker import STOP, RankWorker

log = structlog.get_logger()


def follow(worker: RankWorker) -> None:
    """Do each command rank 0 relays until it says stop; end the process if rank 0 goes away or a command fails."""
    while True:
        try:
            op, args, tensors = worker.ranks.receive_command()
        except RuntimeError:
            fatal("leader_gone", rank=worker.ranks.rank)
        if op == STOP:
            log.info("stopped_by_leader", rank=worker.ranks.rank)
            return
        try:
            worker.execute(op, args, tensors)
        except BaseException:  # noqa: BLE001 - fatal() logs it and ends the rank: the ranks are out of step
            fatal("command_failed", op=op, rank=worker.ranks.rank)


def main() -> None:
    config = parse_service_config("trainer", TrainerServiceConfig)
    log_config(configure_logging("trainer", config.log_level), config)
    if config.torch_threads:
        import torch

        torch.set_num_threads(config.torch_threads)
        torch.set_num_interop_threads(config.torch_threads)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    POLICY_LOSSES.load_builtins()  # first: a user's module reusing a built-in's name is the one refused
    import_modules(config.policy_loss_modules, "policy_loss_modules")
    ranks = join(config.device, config.collective_timeout_s)
    structlog.contextvars.bind_contextvars(rank=ranks.rank)
    follow(RankWorker(ranks))
    ranks.close()
