"""What the critic and reward servers share: tensor codec, model helpers, batching, health, metrics, shutdown."""


def package_version() -> str:
    """This project's installed version, recorded in every checkpoint (the actor's and the critic's)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ppo-services")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "unknown"
