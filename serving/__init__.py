"""What the critic and reward servers share: tensor codec, model helpers, batching, health, metrics, shutdown."""
