"""`python -m reward_server [--port 5556] [--model PATH | --scorer NAME] [--config FILE] [key=value ...]`."""

from serving.startup import stop_at_once_until_serving

stop_at_once_until_serving("reward")  # first: the imports below take seconds

from serving.config import parse_cli
from serving.security import SECURITY_FLAGS, SECURITY_SWITCHES
from serving.startup import imports_without_gc

from .config import RewardConfig
from .scorers import SCORERS

FLAGS = {
    "--host": ("host", "interface to listen on"),
    "--port": ("port", "gRPC port"),
    "--http-port": ("http_port", "REST port for /health, /ready, /metrics, /get_reward"),
    "--model": ("model", "reward model checkpoint: path, hub id or embedded:reward"),
    "--scorer": ("scorer", f"rule-based scorer instead of a model: {', '.join(SCORERS)}"),
    "--device": ("device", "auto, cpu, cuda, cuda:N"),
    **SECURITY_FLAGS,
}


def main(argv: list[str] | None = None) -> None:
    cfg = parse_cli(RewardConfig, argv, "PPO reward server (rewards over gRPC and POST /get_reward).", FLAGS,
                    SECURITY_SWITCHES)
    with imports_without_gc():  # torch and transformers load only after the config is valid
        from serving.server import run_service

        from .servicer import RewardService

    run_service(lambda: RewardService(cfg))


if __name__ == "__main__":
    main()
