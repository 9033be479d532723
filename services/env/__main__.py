"""python -m services.env --config env.yaml [key=value ...]"""

from services.common.service import run_service
from services.env.config import EnvServiceConfig
from services.env.server import attach

if __name__ == "__main__":
    run_service("env", EnvServiceConfig, attach)
