"""python -m services.trainer --config trainer.yaml [key=value ...]"""

from services.common.service import run_service
from services.trainer.config import TrainerServiceConfig
from services.trainer.server import attach

if __name__ == "__main__":
    run_service("trainer", TrainerServiceConfig, attach)
