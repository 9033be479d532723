"""python -m services.coordinator --config coordinator.yaml [key=value ...]"""

from services.common.service import run_service
from services.coordinator.config import CoordinatorServiceConfig
from services.coordinator.server import attach

if __name__ == "__main__":
    run_service("coordinator", CoordinatorServiceConfig, attach)
