"""python -m services.rollout --config rollout.yaml [key=value ...]"""

from services.common.service import run_service
from services.rollout.config import RolloutServiceConfig
from services.rollout.server import attach

if __name__ == "__main__":
    run_service("rollout", RolloutServiceConfig, attach)
