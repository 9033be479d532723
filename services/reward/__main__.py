"""python -m services.reward --config reward.yaml [key=value ...]"""

from services.common.service import run_service
from services.reward.config import RewardServiceConfig
from services.reward.server import attach

if __name__ == "__main__":
    run_service("reward", RewardServiceConfig, attach)
