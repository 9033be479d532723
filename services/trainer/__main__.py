"""python -m services.trainer --config trainer.yaml [key=value ...]            (one rank)
torchrun --nproc-per-node N -m services.trainer --config trainer.yaml [...]  (N ranks, one per GPU)

Under torchrun rank 0 serves gRPC and registers with the coordinator; the
other ranks serve nothing and do what rank 0 relays to them.
"""

import os

from services.common.service import run_service
from services.trainer.config import TrainerServiceConfig
from services.trainer.server import attach

if __name__ == "__main__":
    if "RANK" in os.environ and "MESHRL_PARENT_PID" in os.environ:
        os.environ["MESHRL_PARENT_PID"] = str(os.getppid())  # a rank goes with its torchrun agent
    if int(os.environ.get("RANK", "0")) == 0:
        run_service("trainer", TrainerServiceConfig, attach)
    else:
        from services.trainer.follower import main

        main()
