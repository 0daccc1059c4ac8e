"""`python -m critic_server [--port 5555] [--model PATH] [--config FILE] [key=value ...]`."""

from serving.startup import stop_at_once_until_serving

stop_at_once_until_serving("critic")  # first: the imports below take seconds

from serving.config import parse_cli
from serving.security import SECURITY_FLAGS, SECURITY_SWITCHES
from serving.startup import imports_without_gc

from .config import CriticConfig

FLAGS = {
    "--host": ("host", "interface to listen on"),
    "--port": ("port", "gRPC port"),
    "--http-port": ("http_port", "REST port for /health, /ready, /metrics"),
    "--model": ("model", "critic checkpoint: path, hub id or embedded:reward"),
    "--reward-model": ("reward_model", "combined mode: also serve this reward model"),
    "--checkpoint-dir": ("checkpoint_dir", "where Save writes checkpoints"),
    "--device": ("device", "auto, cpu, cuda, cuda:N"),
    **SECURITY_FLAGS,
}


def main(argv: list[str] | None = None) -> None:
    cfg = parse_cli(CriticConfig, argv, "PPO critic server (value inference and training over gRPC).", FLAGS,
                    SECURITY_SWITCHES, writes=("checkpoint_dir",))
    with imports_without_gc():  # torch and transformers load only after the config is valid
        from serving.server import run_service

        from .servicer import CriticService

    run_service(lambda: CriticService(cfg))


if __name__ == "__main__":
    main()
