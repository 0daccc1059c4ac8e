"""Configuration of the critic server (YAML + dotted overrides; see README "Configuration")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from serving.config import SEED_LIMIT, DirPath, ModelName, StrictModel
from serving.server_config import ServerConfig


class CriticTrainConfig(StrictModel):
    """How a Train request updates the critic."""

    lr: float = Field(1e-4, gt=0, allow_inf_nan=False, description="AdamW learning rate (NeMo-Aligner uses 9e-6 for billion-parameter critics).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    global_batch_size: int = Field(64, ge=1, description="Rows per optimizer step; a Train of B rows takes ceil(B / this) steps.")
    micro_batch_size: int = Field(16, ge=1, description="Rows per forward/backward pass (gradient accumulation).")
    grad_clip: float = Field(1.0, ge=0, description="Max global gradient norm; 0 disables clipping.")
    value_clip: float = Field(0.2, ge=0, description="Value-loss clipping range around the old values; 0 disables.")
    loss_scale: float = Field(1.0, gt=0, description="Multiplier of the value loss.")
    dedupe_window: int = Field(
        1024,
        ge=0,
        description="Replies of the last N Train request_ids kept (in memory and in every checkpoint): a Train whose "
        "request_id is among them is answered with the stored reply and not applied again. 0 disables deduplication.",
    )


class CriticConfig(ServerConfig):
    """`python -m critic_server`: every key, with its default."""

    port: int = Field(5555, ge=0, le=65535, description="gRPC port.")
    http_port: int = Field(8001, ge=0, le=65535, description="REST port for /health, /ready, /metrics.")
    model: ModelName = Field(
        "embedded:reward",
        description="Critic weights: a Hugging Face checkpoint path or hub id (a sequence-classification model with one "
        "label, e.g. a reward model, or a causal LM such as the policy, which gets a fresh value head), or "
        "embedded:reward / embedded:policy for the built-in tiny models.",
    )
    reward_model: ModelName | None = Field(
        None, description="Combined mode: also serve this reward model; Infer then returns rewards as well."
    )
    normalize_reward: bool | None = Field(
        None,
        description="Combined mode: return the reward model's (score - mean) / std with the `mean` and `std` in its "
        "config.json, as OpenRLHF does for reward models trained with --normalize_reward. Unset follows the "
        "checkpoint's own normalize_reward; true requires mean and std there; false returns raw scores.",
    )
    normalize_values: bool | None = Field(
        None,
        description="Values are (v - mean) / std with the `mean` and `std` in the critic model's own config.json, as "
        "OpenRLHF's critic computes them when started from a model trained with --normalize_reward (an OpenRLHF reward "
        "model or critic), in Infer and in Train alike; the critic's checkpoints keep the keys. Unset follows the "
        "checkpoint's own normalize_reward; true requires mean and std there; false reads the head as it is.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Compute dtype: bfloat16 or float16 run Infer and Train under torch.autocast with float32 critic weights, which the optimizer updates (mixed precision; float16 without loss scaling, so prefer bfloat16); a combined reward model (--reward-model) is held in it.")
    checkpoint_dir: DirPath = Field(
        "checkpoints/critic", description="Where Save and autosave write <checkpoint_dir>/<tag>; what `resume` reads."
    )
    keep_last: int = Field(
        0,
        ge=0,
        description="Checkpoints to keep: 0 keeps every one; N > 0 keeps the N most recently written (by the order "
        "their critic_state.json records: a sequence number, then saved_at) and, after each successful Save, deletes this server's older ones and its "
        "leftover .tmp-* directories. Directories without a critic_state.json are never deleted.",
    )
    autosave_every: int = Field(
        0,
        ge=0,
        description="Self-checkpointing: N > 0 saves <checkpoint_dir>/autosave-<train_step> whenever a Train crosses a "
        "multiple of N optimizer steps, and once more on SIGTERM after in-flight work drained (if it trained since the "
        "last save). keep_last applies as to Save. 0 disables both; only Save writes checkpoints.",
    )
    autosave_keep: int = Field(
        0,
        ge=0,
        description="Autosaves to keep: 0 leaves them to keep_last; N > 0 keeps the N most recent autosave-* "
        "checkpoints and deletes older autosaves after each autosave, never another tag (the actor's "
        "<run_id>-step_N checkpoints stay), so autosave_every=1 bounds the disk without keep_last. N > 0 needs "
        "autosave_every > 0.",
    )
    resume: Literal["latest", "never"] = Field(
        "latest",
        description="At start, `latest` loads the newest checkpoint this server wrote in checkpoint_dir (one whose "
        "critic_state.json has a saved_at: weights, optimizer, train step, dedupe window; the newest by the sequence "
        "number each Save and Load records, not by the clock) instead of `model`, if there is one (a damaged one is logged and the next older one tried; when none loads the server exits naming them); "
        "`never` always starts from `model`.",
    )
    seed: int = Field(1234, ge=0, lt=SEED_LIMIT, description="Seed for the value head's initialisation when the checkpoint has none.")
    train: CriticTrainConfig = Field(default_factory=CriticTrainConfig)

    @model_validator(mode="after")
    def _autosaves_to_keep_need_autosaves(self) -> CriticConfig:
        if self.autosave_keep and not self.autosave_every:
            raise ValueError(f"autosave_keep={self.autosave_keep} keeps autosaves, but autosave_every=0 makes none: "
                             "set autosave_every to N > 0, or autosave_keep to 0")
        return self

    @model_validator(mode="after")
    def _normalize_needs_a_reward_model(self) -> CriticConfig:
        if self.normalize_reward and self.reward_model is None:
            raise ValueError("normalize_reward=true applies to the combined reward model's scores, and no reward_model "
                             "is set; unset normalize_reward or set reward_model")
        return self
