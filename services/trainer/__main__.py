"""python -m services.trainer --config trainer.yaml [key=value ...]            (one rank)
torchrun --nproc-per-node N -m services.trainer --config trainer.yaml [...]  (N ranks, one per GPU)

Under torchrun rank 0 serves gRPC and registers with the coordinator; the
other ranks serve nothing and do what rank 0 relays to them. However torchrun
was started, rank 0 stops when its agent dies (kill -9 too), and the others
end with rank 0.
"""

import os

if __name__ == "__main__" and "RANK" in os.environ:  # the agent, taken before the imports below take seconds
    os.environ["MESHRL_PARENT_PID"] = str(os.getppid())

from services.common.service import run_service
from services.trainer.config import TrainerServiceConfig
from services.trainer.server import attach

if __name__ == "__main__":
    if int(os.environ.get("RANK", "0")) == 0:
        run_service("trainer", TrainerServiceConfig, attach)
    else:
        from services.trainer.follower import main

        main()
