"""Configuration of the actor (`python -m actor --config FILE [key=value ...]`); README "Configuration"
lists every key. Defaults follow NeMo-Aligner's PPO where it has one."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from serving.config import StrictModel


class RemoteConfig(StrictModel):
    """A gRPC server the actor talks to."""

    address: str = Field(..., description="host:port of the server.")
    connect_timeout_s: float = Field(120.0, gt=0, description="How long to wait at start-up for the server to answer and to be ready (its model loaded).")
    timeout_s: float = Field(600.0, gt=0, description="Deadline of each call.")
    max_message_mb: int = Field(1024, ge=4, description="gRPC send/receive limit in MiB.")


class RewardConfig(RemoteConfig):
    address: str = Field("127.0.0.1:5556", description="host:port of the reward server.")
    source: Literal["server", "critic"] = Field(
        "server", description="server: score with the reward server; critic: use the rewards of a combined RM + critic server."
    )


class CriticConfig(RemoteConfig):
    address: str = Field("127.0.0.1:5555", description="host:port of the critic server.")


class DataConfig(StrictModel):
    train_file: str = Field("embedded:prompts_train", description="JSONL prompts, one object per line, or embedded:prompts_train.")
    val_file: str = Field("embedded:prompts_eval", description="JSONL prompts for validation, or embedded:prompts_eval.")
    prompt_key: str = Field("prompt", description="Key of the prompt text in each JSON object.")
    max_prompt_length: int = Field(64, ge=1, description="Prompts longer than this many tokens are a data error.")
    shuffle: bool = Field(True, description="Reshuffle the prompts every epoch.")


class GenerationConfig(StrictModel):
    backend: Literal["torch"] = Field("torch", description="Rollout engine; torch runs the policy itself.")
    max_new_tokens: int = Field(16, ge=1, description="Longest response; longer ones are truncated (not 'properly ended').")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature; 0 is greedy.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 disables.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass; 1 disables.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop tokens besides EOS.")


class PPOConfig(StrictModel):
    num_rollout_samples: int = Field(512, ge=1, description="Samples generated per step.")
    rollout_micro_batch_size: int = Field(8, ge=1, description="Samples per generation call; each micro-batch's critic and reward requests are sent as soon as it is generated.")
    global_batch_size: int = Field(64, ge=1, description="Samples per actor optimizer step.")
    micro_batch_size: int = Field(8, ge=1, description="Samples per forward/backward pass (gradient accumulation).")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each step's rollouts.")
    lr: float = Field(9e-7, gt=0, description="Actor AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Actor AdamW weight decay.")
    grad_clip: float = Field(1.0, ge=0, description="Max global gradient norm; 0 disables.")
    ratio_eps: float = Field(0.2, gt=0, description="Clip range of the probability ratio (both sides).")
    entropy_bonus: float = Field(0.0, ge=0, description="Weight of the entropy bonus in the loss.")
    kl_coef: float = Field(0.01, ge=0, description="Per-token KL-to-reference penalty in the reward (initial_policy_kl_penalty).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="Per-token KL estimator.")
    use_absolute_kl: bool = Field(True, description="Penalise |KL| per token (NeMo-Aligner's default).")
    adv_estimator: Literal["gae"] = Field("gae", description="Advantage estimator.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    normalize_advantages: bool = Field(True, description="Whiten advantages over the step's response tokens.")

    @model_validator(mode="after")
    def _batches_divide(self) -> PPOConfig:
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"ppo.global_batch_size ({self.global_batch_size}) must be a multiple of "
                             f"ppo.micro_batch_size ({self.micro_batch_size})")
        return self


class ActorConfig(StrictModel):
    """Every key of the actor, with its default."""

    policy: str = Field("embedded:policy", description="SFT policy: Hugging Face causal-LM path or hub id, or embedded:policy.")
    reference: str | None = Field(None, description="Frozen reference policy for the KL penalty; defaults to `policy`.")
    run_dir: str = Field("runs/ppo", description="metrics.jsonl, TensorBoard events, reward_curve.png and checkpoints go here.")
    max_steps: int = Field(20, ge=1, description="PPO steps to run.")
    save_interval: int = Field(10, ge=0, description="Checkpoint every N steps (and always at the end); 0 only at the end.")
    val_check_interval: int = Field(0, ge=0, description="Validate (greedy generation on val_file) every N steps; 0 disables.")
    num_val_samples: int = Field(64, ge=1, description="Validation prompts per validation.")
    log_samples: int = Field(3, ge=0, description="Prompt/response/reward samples printed at the first and last step.")
    seed: int = Field(42, description="Seed for data order, sampling and initialisation.")
    device: str = Field("auto", description="auto (cuda if available), cpu, cuda, cuda:N.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Policy weights' dtype.")
    host: str = Field("127.0.0.1", description="Interface of the actor's REST endpoints.")
    http_port: int = Field(8000, ge=0, le=65535, description="REST port for /health, /ready, /metrics; 0 disables.")
    critic: CriticConfig = Field(default_factory=CriticConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
