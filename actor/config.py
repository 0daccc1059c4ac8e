"""Configuration of the actor (`python -m actor --config FILE [key=value ...]`), in NeMo-RL's shape.

Sections and key names follow NeMo-RL wherever it has the concept (`ppo`, `loss_fn`, `value_loss_fn`,
`policy`, `data`, `logger`, `checkpointing`); what is ours (server addresses, the KL controller, the REST
endpoint) has sections of its own. docs/configuration.md lists every key; docs/algorithms.md maps
NeMo-Aligner's names to these. Contradictory settings fail at start-up naming both keys.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, ConfigDict, Field, field_validator, model_validator

from serving.config import (
    MAX_GRPC_MS_S,
    MAX_MESSAGE_MB,
    MAX_THREADS,
    MAX_TIMEOUT_S,
    SEED_LIMIT,
    DeviceSpec,
    DirPath,
    FilePath,
    ModelName,
    StrictModel,
    not_blank,
)

AdvEstimatorName = Literal["gae", "raw_reward", "grpo", "gdpo", "reinforce_plus_plus"]
KLType = Literal["k1", "k2", "k3"]


def _host_of(address: str) -> str:
    """The host of `host:port` or `[IPv6]:port`; ValueError saying what is wrong, a port outside 1..65535 too."""
    if address.startswith("["):
        host, closed, rest = address[1:].partition("]")
        if not closed:
            raise ValueError("the bracketed IPv6 address has no closing ]")
        try:
            ipaddress.IPv6Address(host.partition("%")[0])
        except ValueError:
            raise ValueError(f"{host!r} in brackets is no IPv6 address") from None
        if not rest.startswith(":"):
            raise ValueError("no :port after the bracketed address")
        port = rest[1:]
    else:
        if address.count(":") > 1:
            raise ValueError("an IPv6 address goes in brackets, as in [::1]:5555")
        host, colon, port = address.rpartition(":")
        if not colon:
            raise ValueError("no :port (gRPC would dial port 443)")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", host):
            raise ValueError(f"{host!r} is no host name or address" if host else "no host before the :port")
    if not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
        raise ValueError(f"the port {port!r} is no number from 1 to 65535")
    return host


def grpc_target_hosts(target: str) -> list[str]:
    """The hosts gRPC target `target` dials (`host:port`, `[::1]:5555`, `dns:[//authority/]host:port`,
    `ipv4:10.0.0.1:5555,10.0.0.2:5555`, `ipv6:[::1]:5555,...`); none for a Unix socket (`unix:PATH`,
    `unix-abstract:NAME`). ValueError saying what is wrong with it."""
    if target.startswith(("unix:", "unix-abstract:")):
        if not target.partition(":")[2].strip("/"):
            raise ValueError("no socket path after unix:")
        return []
    if dns := re.match(r"dns:(//[^/]*/)?", target):
        return [_host_of(target[dns.end():])]
    if target.startswith(("ipv4:", "ipv6:")):
        hosts = [_host_of(address) for address in target[5:].split(",")]
        for host in hosts:
            try:
                (ipaddress.IPv4Address if target.startswith("ipv4:") else ipaddress.IPv6Address)(host.partition("%")[0])
            except ValueError:
                raise ValueError(f"{host!r} is no {target[:4]} address") from None
        return hosts
    if "://" in target:
        raise ValueError("a gRPC address takes no URL scheme")
    return [_host_of(target)]


def _grpc_target(target: str) -> str:
    try:
        grpc_target_hosts(target)
    except ValueError as e:
        raise ValueError(f"{target!r} is no gRPC address: {e}; expected host:port (e.g. 127.0.0.1:5556), "
                         f"[IPv6]:port, dns:///host:port, ipv4:/ipv6: address lists or unix:PATH") from None
    return target


# a server's address, checked when the config is read: a malformed one cost connect_timeout_s, then a wrong reason
GrpcTarget = Annotated[str, AfterValidator(_grpc_target)]


def _http_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = 0
    why = ("its scheme is not http:// or https://" if parts.scheme.lower() not in ("http", "https") else
           "it names no host" if not parts.hostname else
           "its port is no number from 1 to 65535" if port == 0 else None)
    if why:
        raise ValueError(f"{url!r} is no URL the reward client can POST to: {why}; expected "
                         "http(s)://host[:port]/path, e.g. http://rm-host:8002/get_reward")
    return url


class RemoteConfig(StrictModel):
    """A gRPC server the actor talks to."""

    address: GrpcTarget = Field(..., description="host:port of the server.")
    connect_timeout_s: float = Field(120.0, gt=0, le=MAX_TIMEOUT_S, description="How long to wait at start-up for the server to answer and to be ready (its model loaded).")
    timeout_s: float = Field(600.0, gt=0, le=MAX_TIMEOUT_S, description="Deadline of each call.")
    max_message_mb: int = Field(1024, ge=4, le=MAX_MESSAGE_MB, description="gRPC send/receive limit in MiB (gRPC's own limit is 2 GiB - 1 B).")
    outage_timeout_s: float = Field(300.0, ge=0, le=MAX_TIMEOUT_S, description="How long a running job retries (with backoff) a call the server answers UNAVAILABLE (restarting, unreachable) or CANCELLED (shutting down) before it checkpoints and exits 1; 0 fails at once.")
    keepalive_s: float = Field(30.0, ge=0, le=MAX_GRPC_MS_S, allow_inf_nan=False, description="While a call is in flight, ping the server (an HTTP/2 ping) after every keepalive_s seconds without an answer's bytes; a ping unanswered within keepalive_timeout_s closes the connection and the call is retried as in an outage, so a server that froze or a network path that silently drops packets (a node lost behind a Kubernetes Service) costs keepalive_s + keepalive_timeout_s, not the call's whole timeout_s. The server must accept pings this often (its min_ping_interval_s, 5 s by default; a server that does not closes the connection with too_many_pings). 0: no pings.")
    keepalive_timeout_s: float = Field(20.0, gt=0, le=MAX_GRPC_MS_S, allow_inf_nan=False, description="How long a keepalive ping may go unanswered before the connection is taken for dead.")
    tls_ca_file: FilePath | None = Field(None, description="PEM CA bundle: connect over TLS and verify the server's certificate with it.")
    tls_cert_file: FilePath | None = Field(None, description="PEM client certificate for mutual TLS (with tls_key_file).")
    tls_key_file: FilePath | None = Field(None, description="PEM private key of tls_cert_file.")

    @model_validator(mode="after")
    def _tls_pair(self) -> RemoteConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file: set both or neither")
        return self


class RewardConfig(RemoteConfig):
    address: GrpcTarget = Field("127.0.0.1:5556", description="host:port of the reward server (source: server).")
    source: Literal["server", "critic", "openrlhf"] = Field(
        "server",
        description="server: our reward server over gRPC; critic: the rewards of a combined RM + critic server; "
        "openrlhf: POST prompt and response texts (and labels) to `url`, any server speaking OpenRLHF's "
        "/get_reward protocol.",
    )
    input: Literal["auto", "tokens", "text", "chat"] = Field(
        "auto",
        description="What the reward server is sent (source: server): tokens (the policy's ids; the server must "
        "share the policy's tokenizer), text (decoded prompt and response strings; for a reward model with its "
        "own tokenizer), chat (each prompt's chat messages, then the response as an assistant message, which the "
        "server renders with its reward model's own chat template: for a chat reward model with another tokenizer "
        "or template than the policy's), auto (tokens when the server's vocabulary equals the policy's, else chat "
        "when the server reports a chat template, else text).",
    )
    skip_special_tokens: bool = Field(True, description="Texts sent (input: text, or source: openrlhf) are decoded without the policy tokenizer's special tokens; false keeps them, so a chat reward model sees the chat template's markup and the EOS token, as OpenRLHF sends texts to its remote reward models.")
    url: Annotated[str, AfterValidator(_http_url)] | None = Field(None, description="source: openrlhf: the endpoint, e.g. http://rm-host:8002/get_reward.")
    retries: int = Field(3, ge=0, description="source: openrlhf: retries of a request that failed to connect.")


class CriticConfig(RemoteConfig):
    address: GrpcTarget = Field("127.0.0.1:5555", description="host:port of the critic server: used by estimators that need values (gae), and for the rewards with reward.source=critic (a combined critic).")
    ppo_epochs: int = Field(1, ge=1, le=64, description="Critic passes over each step's batch (Train's epochs). Independent of ppo.ppo_epochs: the default 1 trains the critic once a step however many epochs the policy takes; set it equal to ppo.ppo_epochs to train the critic every epoch, as TRL trains its value model.")


class GenerationConfig(StrictModel):
    """NeMo-RL's policy.generation."""

    backend: Literal["torch"] = Field("torch", description="Rollout engine; torch runs the policy itself (KV cache).")
    max_new_tokens: int = Field(16, ge=1, description="Longest response; longer ones are truncated (not 'properly ended').")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass; 1 disables.")
    top_k: int | None = Field(None, ge=1, description="Keep the k most likely tokens; null disables.")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, description="Extra stop tokens besides EOS (the tokenizer's and every eos_token_id of the policy's generation config, as generate() stops); each must be below the policy's vocabulary size (checked at start).")
    stop_strings: list[str] | None = Field(
        None, description="A response stops right after the token that completes one of these strings in its decoded text (also across several tokens), and counts as properly ended; null disables. Checked on a window of the newest tokens (the longest string's length in UTF-8 bytes + 2, as a byte-level tokenizer may split one character into several tokens).")
    val_temperature: float = Field(0.0, ge=0, description="Validation temperature; 0 (the default) is greedy.")
    val_top_p: float = Field(1.0, gt=0, le=1, description="Validation nucleus mass.")
    val_top_k: int | None = Field(None, ge=1, description="Validation top-k; null disables.")
    ignore_eos: bool = Field(False, description="Generate max_new_tokens for every sample, EOS or not (benchmarks); stop_token_ids still stop.")
    compile: bool = Field(False, description="torch.compile the decode step (one token per row on the pre-allocated KV cache) into fused kernels, with dynamic shapes so one graph serves every batch size and cache length; prefill, a lone row and models on the DynamicCache fallback stay eager. It compiles at start, on a short generation from dummy prompts, while the servers may still be starting (with ppo.async_grpo, the worker compiles at its first rollout instead); tens of seconds on a CPU, and the log says how long. On the CPU it needs a C++ compiler, checked at start. Log-probs equal eager ones up to float reduction order, so a sample can differ where two tokens' probabilities are within rounding. On one H100 it decoded 1.8-2.2x as many tokens per second as transformers' generate(), with and without stop at EOS, where eager decoding matches generate() (docs/PERFORMANCE.md).")
    cuda_graphs: bool = Field(False, description="On a GPU: decode through the compiled step (as policy.generation.compile, which it implies) recorded as a CUDA graph per batch size and cache length and replayed as one launch (torch.compile's mode='reduce-overhead'), on a static-shape KV cache: every step attends over the whole cache, whose length is prompt + max_new_tokens rounded up to a multiple of 64 (the unwritten positions masked), and finished rows stay in the batch. The cache is kept between generations of the same batch and length (its buffers must keep their addresses for a graph to replay), one more KV cache's memory. The first generation compiles the step and records its graph (about a minute more at start). Small models decode launch-bound on a GPU, where a step's many kernel launches are the cost: on one H200 in bf16 (the bench's 5M-parameter policy, batch 64) it decoded 5.5-5.9x as many tokens per second as transformers' generate(), where policy.generation.compile alone gave 1.8-2.2x on an H100 (docs/PERFORMANCE.md). Needs policy.device to be a CUDA device (refused at start elsewhere) and does not combine with ppo.async_grpo (its worker thread).")
    prepack_weights: bool = Field(True, description="On a CPU in float32, every linear layer (torch.nn.Linear, and transformers' Conv1D: GPT-2's projections) of the policy computes during each generation through a copy of its weight prepacked for oneDNN, made when the generation starts and freed when it ends (one more copy of those weights meanwhile; false saves that memory); so do the policy's and the reference's no-grad log-prob passes of each generation batch, eager or compiled (policy.compile: the packed layers are called between the compiled graph's fused kernels; the training passes compute on the weights themselves). With the compiled decode step, generation of 256 tokens for 64 prompts ran 1.39x as fast as without it on a 2-core CPU (docs/PERFORMANCE.md). Ignored on a GPU and in bfloat16. Log-probs equal unpacked ones up to float rounding.")
    reuse_logprobs: bool = Field(False, description="Take the rollout policy's log-probs from generation instead of a separate forward pass; the torch backend samples from the policy itself, so they differ only by float rounding (docs/PERFORMANCE.md gives the measured error).")


class OptimizerKwargs(StrictModel):
    lr: float = Field(9e-7, gt=0, allow_inf_nan=False, description="Learning rate (NeMo-Aligner's actor default).")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        (0.9, 0.999), description="Adam betas, each in [0, 1).")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")


class OptimizerConfig(StrictModel):
    name: Literal["torch.optim.AdamW"] = Field("torch.optim.AdamW", description="Optimizer class.")
    kwargs: OptimizerKwargs = Field(default_factory=OptimizerKwargs)


# A rank past any layer's width adds nothing; a huge one failed inside torch with a C++ traceback
MAX_LORA_RANK = 65536


class LoraConfig(StrictModel):
    """policy.lora: train low-rank adapters (peft) instead of the policy's weights; docs/policy_models.md."""

    rank: int = Field(8, ge=1, le=MAX_LORA_RANK, description="Rank r of each adapter's A [r, in] and B [out, r] matrices.")
    alpha: float = Field(16.0, gt=0, description="Scale: the adapter adds (alpha / rank) * B A x to a layer's output.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input during the policy update only (generation and log-prob passes run without it, so with > 0 the first epoch's ratio is no longer exactly 1).")
    target_modules: str | list[str] = Field("all-linear", description="Modules that get adapters: peft's 'all-linear' (every linear layer but the LM head, GPT-2's Conv1D included), another string as a regular expression on whole module names, or module names such as [q_proj, v_proj].")
    save_merged: bool = Field(False, description="Checkpoints also hold step_N/actor_merged: the base weights with the adapters merged in, loadable with AutoModelForCausalLM.from_pretrained.")

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, v: str | list[str]) -> str | list[str]:
        if not v or (isinstance(v, list) and not all(v)):
            raise ValueError(f"expected 'all-linear' or a list of module names such as "
                             f"[q_proj, v_proj], got {v!r}")
        return v


class DynamicBatchingConfig(StrictModel):
    """NeMo-RL's policy.dynamic_batching: the actor's passes cut by padded tokens instead of rows."""

    enabled: bool = Field(False, description="Cut the policy's training micro-batches and its log-prob passes (policy and reference) by tokens: rows sorted by length go into passes of at most train_mb_tokens (training) or logprob_mb_tokens (log-probs) tokens counted padded (rows x the pass's width), so short rows go many to a pass and long ones few. policy.train_micro_batch_size and policy.logprob_batch_size then no longer bound the rows of a pass. The loss is normalised over the global batch either way, so losses and gradients equal the row-cut ones up to float summation order. false: passes of at most train_micro_batch_size and logprob_batch_size rows.")
    train_mb_tokens: int | None = Field(None, ge=1, description="Most padded tokens in one training micro-batch (a row longer than this gets one of its own). Required when enabled.")
    logprob_mb_tokens: int | None = Field(None, ge=1, description="Most padded tokens in one log-prob pass. Required when enabled.")
    sequence_length_round: int = Field(1, ge=1, description="Each pass's width (its longest row) is rounded up to a multiple of this, within the batch's width; NeMo-RL's configs use 64, which lets a GPU see fewer distinct shapes. 1: no rounding, the least padding.")

    @model_validator(mode="after")
    def _budgets_when_enabled(self) -> DynamicBatchingConfig:
        missing = [k for k in ("train_mb_tokens", "logprob_mb_tokens") if getattr(self, k) is None]
        if self.enabled and missing:
            raise ValueError(f"policy.dynamic_batching.enabled=true needs {' and '.join(missing)}: the most padded "
                             f"tokens in one pass (a positive integer)")
        return self


class PolicyConfig(StrictModel):
    model_name: ModelName = Field("embedded:policy", description="SFT policy: Hugging Face causal-LM path or hub id, or embedded:policy.")
    reference_model_name: ModelName | None = Field(None, description="Frozen reference policy for the KL term; defaults to model_name.")
    train_global_batch_size: int = Field(64, ge=1, description="Samples per policy optimizer step.")
    train_micro_batch_size: int = Field(8, ge=1, description="Samples per forward/backward pass (gradient accumulation); must divide train_global_batch_size, unless policy.dynamic_batching is enabled (tokens then cut the micro-batches).")
    logprob_batch_size: int = Field(8, ge=1, description="Samples per forward pass when computing rollout and reference log-probs.")
    generation_batch_size: int = Field(8, ge=1, description="Samples per generation call; each batch's critic and reward requests go out as soon as it is generated.")
    trust_remote_code: bool = Field(False, description="Let transformers run the model code a checkpoint ships (the auto_map of its config.json) for the policy, the reference and the tokenizer: only for checkpoints you trust.")
    precision: Literal["float32", "bfloat16"] = Field("float32", description="Compute dtype: bfloat16 runs generation and every pass under torch.autocast with float32 policy weights, which the optimizer updates (mixed precision, as NeMo-RL's precision does: a bf16 weight would round away updates below its resolution); the reference is float32 too, so at the start both compute alike, and a LoRA base, never trained, is held in it.")
    max_grad_norm: float = Field(1.0, ge=0, description="Max global gradient norm; 0 disables clipping.")
    device: DeviceSpec = Field("auto", description="auto (cuda if available), cpu, cuda, cuda:N.")
    num_layers_unfrozen: int = Field(-1, ge=-1, description="Train only the top N transformer blocks, the final norm and the LM head (trlx's key); the embeddings and the lower blocks are frozen. -1 trains every layer. A head tied to the input embeddings is frozen with them when N >= 0.")
    compile: bool = Field(False, description="torch.compile every pass over whole sequences: the policy's training forward and backward and the policy's and reference's log-prob passes, into fused kernels with dynamic shapes, so one graph per model serves every micro-batch width. They compile at start, on dummy batches, before the actor waits for the servers (tens of seconds on a CPU, overlapping the servers' start-up; the log says how long), so the first step runs at full speed; on the CPU it needs a C++ compiler (g++ or clang++), checked at start. Losses and gradients equal eager ones up to float reduction order. Generation's decode step has its own key, policy.generation.compile.")
    reference_offload: bool = Field(False, description="Keep the reference policy on the CPU and move it to the policy's device only for its log-prob passes (saves its device memory; costs two transfers per generation batch).")
    lora: LoraConfig | None = Field(None, description="LoRA adapters (peft) on the policy; null trains the policy's own weights. The reference is then the same model with its adapters disabled (no second copy) unless reference_model_name names another model.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)

    @model_validator(mode="after")
    def _batches_divide(self) -> PolicyConfig:
        if any(not s for s in self.generation.stop_strings or []):
            raise ValueError(f"policy.generation.stop_strings: every stop string must be non-empty, got "
                             f"{self.generation.stop_strings!r}")
        # rows cut the micro-batches only without dynamic batching (then tokens do, and the micro-batch size is unused)
        if not self.dynamic_batching.enabled and self.train_global_batch_size % self.train_micro_batch_size:
            raise ValueError(f"policy.train_global_batch_size ({self.train_global_batch_size}) must be a multiple of "
                             f"policy.train_micro_batch_size ({self.train_micro_batch_size})")
        return self

    @property
    def separate_reference(self) -> bool:
        """Whether the reference is a model of its own (with LoRA it is otherwise the policy, adapters disabled)."""
        return self.lora is None or self.reference_model_name not in (None, self.model_name)


class AdvEstimatorConfig(StrictModel):
    name: AdvEstimatorName = Field("gae", description="gae (critic values), raw_reward, grpo, gdpo, reinforce_plus_plus (no critic).")
    gae_gamma: float = Field(1.0, ge=0, le=1, description="gae: discount factor (NeMo-Aligner discount_factor).")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="gae: lambda.")
    gae_lambda_value: float | None = Field(None, ge=0, le=1, description="gae: lambda of the critic's returns (VAPO); null: gae_lambda.")
    gae_lambda_policy: float | None = Field(None, ge=0, le=1, description="gae: lambda of the policy's advantages (VAPO); null: gae_lambda.")
    length_adaptive_alpha: float = Field(0.0, ge=0, description="gae: > 0 sets each sample's policy lambda to clamp(1 - 1/(alpha * length), 0, 1); wins over gae_lambda_policy.")
    normalize_advantages: bool = Field(True, description="gae, raw_reward: whiten advantages over the step's response tokens.")
    use_leave_one_out_baseline: bool = Field(True, description="grpo, gdpo: baseline = mean of the other samples of the prompt (else the group mean).")
    normalize_rewards: bool = Field(True, description="grpo, gdpo: divide by the std of the rewards the baseline is taken over (with the leave-one-out baseline, the prompt's other samples), where it is above 1e-6.")
    minus_baseline: bool = Field(True, description="reinforce_plus_plus: subtract the prompt's mean reward.")
    advantage_clip_low: float | None = Field(None, description="Clip advantages from below; null disables.")
    advantage_clip_high: float | None = Field(None, description="Clip advantages from above; null disables.")
    reward_components: list[str] | None = Field(
        None, description="gdpo: the reward components (names as the reward server reports them, e.g. reward/positive_fraction); null: all of them (at least two)."
    )
    reward_weights: list[float] | None = Field(None, description="gdpo: one weight per component; null: 1 each.")

    @model_validator(mode="after")
    def _clip_range(self) -> AdvEstimatorConfig:
        low, high = self.advantage_clip_low, self.advantage_clip_high
        if low is not None and high is not None and low > high:
            raise ValueError(f"ppo.adv_estimator.advantage_clip_low ({low}) must not exceed "
                             f"ppo.adv_estimator.advantage_clip_high ({high})")
        return self


class RewardScalingConfig(StrictModel):
    enabled: bool = Field(False, description="Clamp rewards (and every component) to [source_min, source_max] and map them linearly to [target_min, target_max].")
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0

    @model_validator(mode="after")
    def _range(self) -> RewardScalingConfig:
        if self.source_max <= self.source_min:
            raise ValueError(f"reward_scaling.source_max ({self.source_max}) must exceed reward_scaling.source_min ({self.source_min})")
        return self


class RewardShapingConfig(StrictModel):
    """NeMo-RL's reward shaping: nothing unless `enabled`; then the stop-properly penalty where
    stop_properly_penalty_coef is set, else DAPO's overlong penalty."""

    enabled: bool = Field(False, description="Shape the rewards: with stop_properly_penalty_coef set, its penalty; else DAPO's overlong penalty (responses longer than max_response_length - overlong_buffer_length lose up to overlong_buffer_penalty), which needs both overlong keys. false: no shaping, every other key here unused (NeMo-RL's meaning).")
    overlong_buffer_length: int | None = Field(None, ge=1, description="DAPO: tokens before max_response_length where the penalty ramps up.")
    overlong_buffer_penalty: float | None = Field(None, ge=0, description="DAPO: penalty at max_response_length.")
    max_response_length: int | None = Field(None, ge=1, description="DAPO: the length the penalty is full at; null: policy.generation.max_new_tokens.")
    stop_properly_penalty_coef: float | None = Field(None, ge=0, le=1, description="Truncated samples (no EOS or stop token) get reward * coef, in place of DAPO's penalty; null: DAPO's penalty.")

    @model_validator(mode="after")
    def _one_penalty(self) -> RewardShapingConfig:
        overlong = {k: v for k in ("overlong_buffer_length", "overlong_buffer_penalty", "max_response_length")
                    if (v := getattr(self, k)) is not None}
        if not self.enabled and self.stop_properly_penalty_coef is not None:
            raise ValueError(f"ppo.reward_shaping.stop_properly_penalty_coef ({self.stop_properly_penalty_coef}) "
                             f"applies only with ppo.reward_shaping.enabled=true (NeMo-RL's meaning): set it, or the "
                             f"coefficient to null")
        if self.enabled and self.stop_properly_penalty_coef is not None and overlong:
            raise ValueError(f"ppo.reward_shaping.stop_properly_penalty_coef ({self.stop_properly_penalty_coef}) "
                             f"replaces DAPO's overlong penalty, so ppo.reward_shaping."
                             f"{', ppo.reward_shaping.'.join(overlong)} would go unused: set those to null, or the "
                             f"coefficient to null for DAPO's penalty")
        missing = [k for k in ("overlong_buffer_length", "overlong_buffer_penalty") if getattr(self, k) is None]
        if self.enabled and self.stop_properly_penalty_coef is None and missing:
            raise ValueError(f"ppo.reward_shaping.enabled=true without stop_properly_penalty_coef is DAPO's overlong "
                             f"penalty, which needs ppo.reward_shaping.{' and ppo.reward_shaping.'.join(missing)}")
        return self


class KLControllerConfig(StrictModel):
    """KL to the reference policy in the reward (NeMo-Aligner, trlx, OpenRLHF). KL in the loss is loss_fn's."""

    init_kl_coef: float = Field(0.0, ge=0, description="beta of the per-token KL penalty in the reward (NeMo-Aligner initial_policy_kl_penalty); 0 disables.")
    kl_type: KLType = Field("k1", description="Per-token KL estimator in the reward.")
    use_absolute_kl: bool = Field(True, description="Penalise |KL| per token (NeMo-Aligner's default).")
    type: Literal["fixed", "adaptive"] = Field("fixed", description="fixed keeps beta; adaptive moves it towards `target` (trlx/OpenRLHF).")
    target: float = Field(6.0, gt=0, description="adaptive: target KL per sample (sum over its tokens).")
    horizon: int = Field(10000, ge=1, description="adaptive: samples over which beta may change by about 20%; must be above the samples per step / 5, or beta could turn negative.")


class AsyncGRPOConfig(StrictModel):
    """NeMo-RL's async_grpo: generation runs ahead of training in its own thread (actor/async_rollouts.py)."""

    enabled: bool = Field(False, description="Generate in a worker thread with its own copy of the policy, refreshed after every step, into a replay buffer of whole prompt groups; the step trains on the oldest groups. Needs loss_fn.use_importance_sampling_correction with a truncated_importance_sampling_type.")
    max_trajectory_age_steps: int = Field(1, ge=0, description="Most trainer steps between the weights that generated a group and the weights that train on it; the worker runs at most this many steps ahead (0: never, the same run as synchronous), older groups are evicted.")
    generation_timeout_s: float = Field(600.0, gt=0, le=MAX_TIMEOUT_S, description="Longest the step waits for the worker's next groups (a straggling generation); past it the actor checkpoints its last finished step and exits 1.")
    num_threads: int = Field(0, ge=0, le=MAX_THREADS, description="torch CPU threads of the generation worker thread; 0: the actor's num_threads.")


class PPOConfig(StrictModel):
    """NeMo-RL's `ppo` / `grpo` section (a config may call it either, not both)."""

    num_prompts_per_step: int = Field(64, ge=1, description="Prompts per step.")
    num_generations_per_prompt: int = Field(1, ge=1, description="Samples per prompt; group-relative estimators need >= 2.")
    max_num_steps: int = Field(20, ge=1, description="Steps to run.")
    max_num_epochs: int = Field(1_000_000, ge=1, description="Stop after this many passes over the training prompts.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each step's rollouts.")
    seed: int = Field(42, ge=0, lt=SEED_LIMIT, description="Seed for data order, sampling and initialisation.")
    val_period: int = Field(0, ge=0, description="Validate every N steps; 0 disables periodic validation.")
    val_at_start: bool = Field(False, description="Validate before the first step (step 0).")
    val_at_end: bool = Field(False, description="Validate after the run's last step (ppo.max_num_steps, or the end of the data under ppo.max_num_epochs); not when a SIGTERM or checkpointing.checkpoint_must_save_by stops the run early, whose time goes to its checkpoint.")
    val_batch_size: int = Field(64, ge=1, description="Validation prompts per generation call.")
    max_val_samples: int = Field(64, ge=1, description="Validation prompts used (the first N of data.val_file).")
    overlong_filtering: bool = Field(
        True, description="Samples that did not end with EOS or a stop token get no policy gradient (NeMo-Aligner's rule); they still count in group baselines and train the critic."
    )
    use_dynamic_sampling: bool = Field(False, description="DAPO: keep only prompt groups whose rewards differ; generate more until the step is full.")
    dynamic_sampling_max_gen_batches: int = Field(10, ge=1, description="Generation batches per step before dynamic sampling gives up with an error.")
    batch_multiplier: float = Field(1.0, ge=1, description="Generate ceil(num_prompts_per_step * this) prompts per generation batch; only with use_dynamic_sampling.")
    policy_training_start_step: int = Field(
        0, ge=0, description="Critic warm-up: the number of steps at the start in which only the critic trains (NeMo-RL's meaning; NeMo-Aligner's critic_warmup_steps); the policy trains from the step after them. 0: both train from the first step."
    )
    skip_reference_policy_logprobs_calculation: bool = Field(False, description="Skip the reference model (allowed only without any KL term).")
    max_rollout_turns: int = Field(
        1, ge=1, description="With an environment (env.name): the most policy turns of an episode; each turn generates up to policy.generation.max_new_tokens, the environment answers, and its observation is appended for the next turn. Above 1 needs env.name.")
    reward_scaling: RewardScalingConfig = Field(default_factory=RewardScalingConfig)
    reward_shaping: RewardShapingConfig = Field(default_factory=RewardShapingConfig)
    adv_estimator: AdvEstimatorConfig = Field(default_factory=AdvEstimatorConfig)
    kl_controller: KLControllerConfig = Field(default_factory=KLControllerConfig)
    async_grpo: AsyncGRPOConfig = Field(default_factory=AsyncGRPOConfig)

    @property
    def validates(self) -> bool:
        """Whether the run validates at all (periodically, at its start or at its end)."""
        return self.val_period > 0 or self.val_at_start or self.val_at_end


class LossConfig(StrictModel):
    """NeMo-RL's ClippedPGLossConfig."""

    ratio_clip_min: float = Field(0.2, ge=0, description="Lower clip range: ratio >= 1 - this (NeMo-Aligner ratio_eps).")
    ratio_clip_max: float = Field(0.2, ge=0, description="Upper clip range: ratio <= 1 + this (DAPO clip-higher: 0.28).")
    ratio_clip_c: float | None = Field(None, gt=1, description="Dual clip: where A < 0 the loss is at most -c * A; null disables.")
    token_level_loss: bool = Field(True, description="true: mean over the global batch's tokens; false: mean over tokens per sample, then over samples.")
    entropy_bonus: float = Field(0.0, ge=0, description="Weight of the entropy bonus (NeMo-Aligner entropy_bonus).")
    reference_policy_kl_penalty: float = Field(0.0, ge=0, description="beta of the per-token KL in the loss; 0 disables. Never together with ppo.kl_controller.init_kl_coef.")
    reference_policy_kl_type: KLType = Field("k3", description="Per-token KL estimator in the loss.")
    use_importance_sampling_correction: bool = Field(False, description="Weight tokens by exp(logprob at rollout - logprob of the generation engine) (off-policy generation).")
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] | None = Field(
        None, description="tis clamps the weight, icepop zeroes tokens outside the range, seq-mask-tis drops whole sequences."
    )
    truncated_importance_sampling_ratio: float = Field(2.0, gt=0, description="Upper bound of the importance weight.")
    truncated_importance_sampling_ratio_min: float = Field(0.0, ge=0, description="Lower bound of the importance weight.")

    @model_validator(mode="after")
    def _bounds(self) -> LossConfig:
        if self.truncated_importance_sampling_ratio_min > self.truncated_importance_sampling_ratio:
            raise ValueError(f"loss_fn.truncated_importance_sampling_ratio_min "
                             f"({self.truncated_importance_sampling_ratio_min}) must not exceed "
                             f"loss_fn.truncated_importance_sampling_ratio ({self.truncated_importance_sampling_ratio})")
        return self


class ValueLossConfig(StrictModel):
    """NeMo-RL's value_loss_fn, sent with every critic Train."""

    cliprange: float | None = Field(0.2, ge=0, description="Clip values to old +- this in the loss (NeMo-Aligner loss_clip_val); null or 0 disables.")
    scale: float = Field(1.0, gt=0, description="Multiplier of the value loss.")


class DataConfig(StrictModel):
    train_file: FilePath = Field("embedded:prompts_train", description="Prompts: JSONL (one object per line) or one JSON array of objects, or embedded:prompts_train.")
    val_file: FilePath = Field("embedded:prompts_eval", description="Prompts for validation, as train_file, or embedded:prompts_eval (which a run validating on its own train_file refuses: set this too).")
    prompt_key: str = Field("prompt", description="Key of the prompt text in each JSON object; a dotted key the object does not hold as it is is a path through nested objects (extra_info.question).")
    label_key: str = Field("label", description="Key of the reference answer (any JSON value), sent to the reward scorer with every generation of the prompt; dotted as prompt_key (verl's reward_model.ground_truth).")
    max_input_seq_length: int = Field(64, ge=1, description="Prompts longer than this many tokens are a data error.")
    shuffle: bool = Field(True, description="Reshuffle the prompts every epoch.")
    prompt_file: FilePath | None = Field(None, description="A text file holding a template with one {} where each string prompt goes (NeMo-RL's data.prompt_file; other braces doubled, as in Python's str.format); null uses the prompts as they are. A prompt given as a list of messages has no place for it and is refused naming its line.")
    apply_chat_template: bool = Field(False, description="Render each string prompt (after prompt_file) as one user message through the policy tokenizer's chat template, with the generation prompt; a prompt given as a list of {role, content} messages is always rendered so.")
    system_prompt_file: FilePath | None = Field(None, description="A text file whose content becomes the system message of every chat-rendered prompt (NeMo-RL's data.system_prompt_file); needs apply_chat_template.")

    @model_validator(mode="after")
    def _system_prompt_needs_chat(self) -> DataConfig:
        if self.system_prompt_file is not None and not self.apply_chat_template:
            raise ValueError("data.system_prompt_file needs data.apply_chat_template=true: only chat-rendered prompts "
                             "have a system message")
        return self


class LoggerConfig(StrictModel):
    tensorboard_enabled: bool = Field(True, description="Write TensorBoard events under <run_dir>/tensorboard.")
    reward_curve_enabled: bool = Field(
        True, description="Draw <run_dir>/reward_curve.png when the run ends, with matplotlib (whose import is most of the cost).")
    num_val_samples_to_print: int = Field(3, ge=0, description="Prompt/response/reward samples printed at the first and last step.")


LOGGED_METRIC_PREFIXES = ("val/", "train_rollouts/", "train_optim/", "critic/", "timers/")


class CheckpointingConfig(StrictModel):
    enabled: bool = Field(True, description="Write checkpoints under <run_dir>/checkpoints.")
    save_period: int = Field(10, ge=0, description="Checkpoint every N steps (and always at the end); 0 only at the end.")
    resume: Annotated[str, not_blank("auto, never, step_N or the path of a step_N checkpoint")] = Field(
        "auto", description="auto: continue from the latest complete checkpoint in <run_dir>/checkpoints when there "
        "is one; never: start over; step_N: this run's checkpoint of step N (<run_dir>/checkpoints/step_N); or the path of "
        "a step_N checkpoint to continue from (another run's too).")
    keep_top_k: int | None = Field(None, ge=1, description="Keep only the latest checkpoint, the k best by metric_name and the newest that holds its critic (once the critic's Saves fail, the only one a resume is exact from); null keeps all.")
    metric_name: str | None = Field(None, description="The metric that ranks checkpoints for keep_top_k, as the run logs it, e.g. val/rewards; NeMo-RL's form val:<name> / train:<name> is read as val/<name> / train/<name>, and its val:accuracy (the mean validation reward) as val/rewards. A checkpoint of a step without validation ranks last (ties: the newer first); a name the step's metrics lack when they hold a validation stops the run after that step's checkpoint, listing the names there are.")
    higher_is_better: bool = Field(True, description="Whether a larger metric_name is better.")
    checkpoint_must_save_by: str | None = Field(
        None, description="Run time after which the actor checkpoints and stops (exit 0), as HH:MM:SS or DD:HH:MM:SS, e.g. a job's time limit minus a margin; null disables.")

    @field_validator("checkpoint_must_save_by", mode="before")
    @classmethod
    def _quoted_time(cls, value: Any) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool):  # an unquoted 1:30:00 is kept as written
            raise ValueError(f"expected HH:MM:SS or DD:HH:MM:SS, got the number {value}: write the time, e.g. "  # noqa: TRY004 - pydantic reports ValueError
                             f"01:30:00")
        return value

    @field_validator("metric_name")
    @classmethod
    def _logged_name(cls, name: str | None) -> str | None:
        """NeMo-RL names a metric `val:accuracy`; this run logs it as val/rewards."""
        if name is None:
            return name
        if ":" in name:
            name = name.replace(":", "/", 1)
            name = "val/rewards" if name == "val/accuracy" else name
        if not name.startswith(LOGGED_METRIC_PREFIXES):
            raise ValueError(f"checkpointing.metric_name={name} is no metric the run logs: expected one under "
                             f"{', '.join(LOGGED_METRIC_PREFIXES)} (e.g. val/rewards)")
        return name

    @model_validator(mode="after")
    def _consistent(self) -> CheckpointingConfig:
        if self.keep_top_k is not None and not self.metric_name:
            raise ValueError("checkpointing.keep_top_k needs checkpointing.metric_name (e.g. val/rewards)")
        if self.checkpoint_must_save_by is not None:
            self.must_save_by_s  # noqa: B018 - parses, or raises naming the key
        return self

    @property
    def must_save_by_s(self) -> float | None:
        if self.checkpoint_must_save_by is None:
            return None
        parts = self.checkpoint_must_save_by.split(":")
        if len(parts) not in (3, 4) or not all(p.isdigit() for p in parts):
            raise ValueError(f"checkpointing.checkpoint_must_save_by: expected HH:MM:SS or DD:HH:MM:SS, got "
                             f"{self.checkpoint_must_save_by!r}")
        *days, h, m, sec = (int(p) for p in parts)
        if m >= 60 or sec >= 60 or (days and h >= 24):
            raise ValueError(f"checkpointing.checkpoint_must_save_by: {self.checkpoint_must_save_by!r} is no time: "
                             f"minutes and seconds run from 00 to 59{', hours from 00 to 23' if days else ''}")
        return (days[0] if days else 0) * 86400 + h * 3600 + m * 60 + sec


class EnvConfig(StrictModel):
    """The environment a multi-turn episode alternates with (docs/environments.md). Its own options sit beside
    `name` in this section and are checked by the environment's `Options` model."""

    model_config = ConfigDict(extra="allow", validate_default=True)

    name: str | None = Field(
        None, description="null: no environment (one response per sample, rewards from the reward source); a built-in environment (retry_with_feedback) or an importable 'package.module:Class'. Its rewards become the sample rewards; its own keys sit beside name (docs/environments.md).")
    step_timeout_s: float | None = Field(
        600.0, gt=0, le=MAX_TIMEOUT_S, description="Longest one environment step (its answer to every running sample of a generation batch) may take; past it the run stops (exit 1), its last finished step checkpointed, naming the environment. null: wait as long as it takes.")

    @property
    def options(self) -> dict[str, Any]:
        """The environment's own keys (everything in the section but `name`)."""
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _known(self) -> EnvConfig:
        if self.name is not None:
            # imported late: the environments import the clients, which import this module
            from .environments import environment_options

            environment_options(self.name, self.options)  # raises naming env.<key>
        elif self.options:
            raise ValueError(f"env.{', env.'.join(sorted(self.options))} set without env.name: name the environment "
                             "whose options they are")
        return self

    @property
    def uses_reward_server(self) -> bool:
        """Whether the environment scores through the configured reward server."""
        if self.name is None:
            return False
        from .environments import environment_options

        return environment_options(self.name, self.options).uses_reward_server


class ActorConfig(StrictModel):
    """Every key of the actor, with its default."""

    run_dir: DirPath = Field("runs/ppo", description="metrics.jsonl, TensorBoard events, reward_curve.png and checkpoints go here.")
    host: Annotated[str, not_blank("a host name or address, e.g. 127.0.0.1")] = Field(
        "127.0.0.1", description="Interface of the actor's REST endpoints.")
    http_port: int = Field(8000, ge=0, le=65535, description="REST port for /health, /ready, /metrics; 0 disables.")
    auth_token_file: FilePath | None = Field(None, description="File holding the bearer token the servers require (the environment variable PPO_SERVICES_AUTH_TOKEN is read when this is unset); sent on every call.")
    num_threads: int = Field(0, ge=0, le=MAX_THREADS, description="torch CPU threads of the actor (its thread budget when the servers share the machine's cores); 0: torch's default, one per core.")
    num_threads_shared: int = Field(0, ge=0, le=MAX_THREADS, description="The actor's torch threads while co-located servers compute at the same time (log-prob passes while Infer and Score run, the policy update while the critic trains); 0: num_threads. On one machine: num_threads minus the servers' threads.")
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    loss_fn: LossConfig = Field(default_factory=LossConfig)
    value_loss_fn: ValueLossConfig = Field(default_factory=ValueLossConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)

    @property
    def rollout_samples(self) -> int:
        return self.ppo.num_prompts_per_step * self.ppo.num_generations_per_prompt

    # read by serving.config.load_config: a file's `grpo:` section takes `ppo.*` overrides, and `grpo.*` overrides
    # land in a file's `ppo:` section
    section_aliases: ClassVar[dict[str, str]] = {"grpo": "ppo"}

    @model_validator(mode="before")
    @classmethod
    def _grpo_section(cls, data: object) -> object:
        """NeMo-RL's GRPO configs call the `ppo` section `grpo`."""
        if isinstance(data, dict) and "grpo" in data:
            if "ppo" in data:
                raise ValueError("ppo and grpo name the same section: give one of them, not both")
            data = {("ppo" if k == "grpo" else k): v for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> ActorConfig:
        """Refuse settings that contradict each other, naming both keys."""
        p, est, kl = self.ppo, self.ppo.adv_estimator, self.ppo.kl_controller
        name = f"ppo.adv_estimator.name={est.name}"
        data_defaults = DataConfig()
        if p.validates and self.data.train_file != data_defaults.train_file and self.data.val_file == data_defaults.val_file:
            raise ValueError(f"data.train_file is your own ({self.data.train_file}) but data.val_file is still the "
                             f"embedded toy prompts ({data_defaults.val_file}), which validation would score: set "
                             f"data.val_file to your validation prompts, or turn validation off (ppo.val_period=0, "
                             f"ppo.val_at_start=false, ppo.val_at_end=false)")
        loss_kl = self.loss_fn.reference_policy_kl_penalty
        shaping = p.reward_shaping
        longest = shaping.max_response_length or self.policy.generation.max_new_tokens
        if shaping.enabled and shaping.overlong_buffer_length is not None and shaping.overlong_buffer_length > longest:
            raise ValueError(f"ppo.reward_shaping.overlong_buffer_length ({shaping.overlong_buffer_length}) is longer "
                             f"than the response may be ({longest}: ppo.reward_shaping.max_response_length, else "
                             f"policy.generation.max_new_tokens), so every response would be penalised")
        if kl.init_kl_coef > 0 and loss_kl > 0:
            raise ValueError("KL in the reward and in the loss: set ppo.kl_controller.init_kl_coef "
                             f"({kl.init_kl_coef}) or loss_fn.reference_policy_kl_penalty ({loss_kl}) to 0")
        if p.skip_reference_policy_logprobs_calculation and (kl.init_kl_coef > 0 or loss_kl > 0):
            key = "ppo.kl_controller.init_kl_coef" if kl.init_kl_coef > 0 else "loss_fn.reference_policy_kl_penalty"
            raise ValueError(f"ppo.skip_reference_policy_logprobs_calculation=true leaves no reference log-probs "
                             f"for the KL term: {key} must be 0")
        grouped = est.name in ("grpo", "gdpo") or (est.name == "reinforce_plus_plus" and est.minus_baseline)
        if grouped and p.num_generations_per_prompt < 2:
            raise ValueError(f"{name} compares the samples of each prompt: ppo.num_generations_per_prompt must be "
                             f">= 2, got {p.num_generations_per_prompt}")
        if p.use_dynamic_sampling and not grouped:
            raise ValueError(f"ppo.use_dynamic_sampling=true keeps prompt groups whose rewards differ, but {name}"
                             f"{' with minus_baseline=false' if est.name == 'reinforce_plus_plus' else ''} has no "
                             "groups: use grpo, gdpo or reinforce_plus_plus")
        if p.batch_multiplier != 1 and not p.use_dynamic_sampling:
            raise ValueError(f"ppo.batch_multiplier ({p.batch_multiplier}) over-samples prompts for dynamic sampling: "
                             f"it needs ppo.use_dynamic_sampling=true (as in NeMo-RL), or set it to 1")
        if kl.type == "adaptive" and 5 * kl.horizon <= self.rollout_samples:
            raise ValueError(f"ppo.kl_controller.horizon={kl.horizon} is too short for the {self.rollout_samples}"
                             " samples per step (ppo.num_prompts_per_step x ppo.num_generations_per_prompt): the"
                             " adaptive controller multiplies beta by 1 + err * samples / horizon with err down to"
                             " -0.2, which turns beta negative unless horizon > samples / 5; set"
                             f" ppo.kl_controller.horizon above {self.rollout_samples / 5:g} (it counts samples,"
                             " not steps; trlx and OpenRLHF use 10000)")
        if est.name in ("grpo", "gdpo") and kl.init_kl_coef > 0:
            raise ValueError(f"{name} takes the KL in the loss: set ppo.kl_controller.init_kl_coef=0 and "
                             "loss_fn.reference_policy_kl_penalty instead")
        if est.reward_weights is not None and est.reward_components is not None \
                and len(est.reward_weights) != len(est.reward_components):
            raise ValueError(f"ppo.adv_estimator.reward_weights has {len(est.reward_weights)} entries but "
                             f"ppo.adv_estimator.reward_components has {len(est.reward_components)}")
        if self.reward.input == "chat" and (self.reward.source != "server" or self.env.name is not None):
            why = f"reward.source={self.reward.source}" if self.reward.source != "server" else f"env.name={self.env.name}"
            raise ValueError(f"reward.input=chat sends conversations to our reward server for single-turn samples; "
                             f"{why} scores otherwise: unset reward.input (auto)")
        if self.reward.source == "openrlhf" and not self.reward.url:
            raise ValueError("reward.source=openrlhf needs reward.url (e.g. http://host:8002/get_reward)")
        tls = [k for k in ("tls_ca_file", "tls_cert_file") if getattr(self.reward, k)]
        if self.reward.source == "openrlhf" and tls and not self.reward.url.lower().startswith("https://"):
            raise ValueError(f"reward.{tls[0]} is set, but reward.url={self.reward.url} is not https://: TLS needs an "
                             f"https:// URL (or unset reward.{tls[0]})")
        if self.loss_fn.truncated_importance_sampling_type and not self.loss_fn.use_importance_sampling_correction:
            raise ValueError("loss_fn.truncated_importance_sampling_type is set but "
                             "loss_fn.use_importance_sampling_correction is false")
        if p.max_rollout_turns > 1 and self.env.name is None:
            raise ValueError(f"ppo.max_rollout_turns={p.max_rollout_turns} alternates generation with an environment: "
                             "set env.name (e.g. retry_with_feedback) or ppo.max_rollout_turns=1")
        if self.env.name is not None and self.reward.source != "server":
            raise ValueError(f"env.name={self.env.name} gives the rewards (through the reward server at "
                             f"reward.address when its scorer is one): reward.source={self.reward.source} cannot "
                             "apply; use reward.source=server")
        if self.env.name is not None and est.name == "gdpo":
            raise ValueError(f"{name} needs named reward components, but env.name={self.env.name} gives one reward "
                             "per sample: use grpo, gae, raw_reward or reinforce_plus_plus")
        if p.async_grpo.enabled:
            self._async_combines()
        if self.policy.generation.reuse_logprobs and self.loss_fn.use_importance_sampling_correction:
            raise ValueError("policy.generation.reuse_logprobs=true makes the policy's log-probs the generation "
                             "engine's, so loss_fn.use_importance_sampling_correction would correct nothing: "
                             "turn one of them off")
        pol = self.policy
        if pol.lora is not None and pol.num_layers_unfrozen >= 0:
            raise ValueError("policy.lora trains adapters and freezes every base weight, so "
                             f"policy.num_layers_unfrozen={pol.num_layers_unfrozen} has nothing to choose: set it to -1 "
                             "or policy.lora to null")
        if pol.reference_offload and not pol.separate_reference:
            raise ValueError("policy.reference_offload=true, but with policy.lora the reference is the policy itself "
                             "(adapters disabled), so there is no copy to offload: set policy.reference_offload=false, "
                             "or policy.reference_model_name to a different model")
        return self

    def _async_combines(self) -> None:
        on, lf = "ppo.async_grpo.enabled=true", self.loss_fn
        if not lf.use_importance_sampling_correction or lf.truncated_importance_sampling_type is None:
            raise ValueError(f"{on} trains on groups generated by older weights: it needs "
                             "loss_fn.use_importance_sampling_correction=true with "
                             "loss_fn.truncated_importance_sampling_type tis, icepop or seq-mask-tis")
        if self.policy.generation.reuse_logprobs:
            raise ValueError(f"{on} generates with older weights, whose log-probs are not the trained policy's: "
                             "turn policy.generation.reuse_logprobs off")
        if self.ppo.use_dynamic_sampling:
            raise ValueError(f"{on} and ppo.use_dynamic_sampling=true do not combine (the worker generates whole "
                             "steps of groups ahead): turn one of them off")
        if self.policy.generation.cuda_graphs:
            raise ValueError(f"{on} generates in a worker thread, where torch.compile's CUDA graphs fail on torch "
                             "releases before the fix of pytorch/pytorch#123177 and are untested here: turn "
                             "policy.generation.cuda_graphs off (policy.generation.compile still applies)")

    @property
    def trains_critic(self) -> bool:
        """Only GAE bootstraps from critic values, and its returns train the critic while the policy updates."""
        return self.ppo.adv_estimator.name == "gae"

    @property
    def needs_critic(self) -> bool:
        """A critic for GAE's values, or a combined server as the reward source."""
        return self.trains_critic or self.reward.source == "critic"
