"""``python -m services.coordctl.torchrun [torchrun's arguments]``: torchrun that stops when its launcher dies.

coordctl --local starts a trainer of several ranks this way. torchrun's agent is torch's code, which would
outlive a coordctl killed with kill -9 (and its ranks with it); here it first asks for SIGTERM when the launcher
named by MESHRL_PARENT_PID dies, on which torchrun stops its ranks and ends.
"""

import os
import runpy
import signal

from services.common.lifetime import die_with_parent

if __name__ == "__main__":
    if "MESHRL_PARENT_PID" in os.environ:  # (absent where a person runs it, for --help say)
        die_with_parent(int(os.environ["MESHRL_PARENT_PID"]), signal.SIGTERM)
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
