"""Starting the services: the entry points' imports run without the cyclic garbage collector (serving.startup), and
what a service cannot use (a device, a model, a directory) is refused at start, naming its key, without a
traceback."""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from serving.startup import imports_without_gc
from tests.service_procs import ROOT, actor_command


def test_the_collector_is_off_within_and_back_after_with_what_was_made_frozen():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with imports_without_gc():
            assert not gc.isenabled()
            made = [[i] for i in range(1000)]  # tracked containers, alive when the block ends
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(made)
        gc.disable()  # a caller that had turned it off keeps it off
        with imports_without_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()


@pytest.mark.parametrize("module, setting, code, words", [
    ("reward_server", "device=gpu", 2, "device: expected auto, cpu, cuda or cuda:N (N a GPU index), got 'gpu'"),
    ("critic_server", "device=cuda:99", 1, "error: device=cuda:99: "),
    ("reward_server", "device=cuda:99", 1, "error: device=cuda:99: "),
    ("actor", "policy.device=cuda:99", 1, "error: policy.device=cuda:99: "),
    ("actor", "policy.model_name=/no/such/model", 1, "error: policy.model_name=/no/such/model: no such directory"),
    ("critic_server", "model=./no-such-model", 1, "ModelNotFound: model=./no-such-model: no such directory"),
    ("reward_server", "model=embedded:critic", 1, "model=embedded:critic: unknown embedded model; expected"),
    # a hub id that is neither cached nor reachable (offline here): transformers' reason, under the key
    ("actor", "policy.model_name=no-such-org/no-such-model", 1, "error: policy.model_name=no-such-org/no-such-model: "),
    ("reward_server", "model=no-such-org/no-such-model", 1, "ModelNotFound: model=no-such-org/no-such-model: "),
    ("reward_server", "tokenizer=no-such-org/no-such-tok", 1, "ModelNotFound: tokenizer=no-such-org/no-such-tok: "),
    ("critic_server", "reward_model=no-such-org/no-such-rm", 1, "ModelNotFound: reward_model=no-such-org/no-such-rm: "),
    # the prompt files are checked before any model loads (here a model that is not there either)
    ("actor", "data.train_file=/no/such.jsonl data.val_file=/no/such.jsonl policy.model_name=/no/such/model", 1,
     "error: data.train_file: /no/such.jsonl: prompt file does not exist"),
    # a reward model as the policy: transformers would fill its language-model head with noise
    ("actor", "policy.model_name=embedded:reward", 1,
     "error: policy.model_name=embedded:reward has no weights for the language-model head (lm_head.weight)"),
])
def test_a_device_or_model_that_is_not_there_is_refused_at_start_naming_the_key(module, setting, code, words, tmp_path):
    """A device that is no torch device is a config error; a GPU torch does not see here (a CPU-only build, none
    visible, an index past them) is refused before the model loads, naming the key, without a traceback. So is a
    model path with no directory there (which transformers would report as a malformed hub id), an unknown embedded
    name, or a hub id transformers cannot load (its reason, under the key)."""
    place = {"critic_server": ["--checkpoint-dir", str(tmp_path)], "actor": [f"run_dir={tmp_path}"]}.get(module, [])
    done = subprocess.run([sys.executable, "-m", module, "--http-port", "0", *place, *setting.split()], cwd=ROOT, check=False,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == code and words in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("module, sig", [("critic_server", signal.SIGTERM), ("reward_server", signal.SIGINT)])
def test_a_signal_before_a_server_serves_stops_it_at_once_with_exit_zero(module, sig, tmp_path):
    """A signal during the seconds a server spends importing torch and transformers: nothing is loaded or owed, so
    it stops at once, exit 0 (before, SIGTERM killed it, -15, and SIGINT printed a KeyboardInterrupt traceback)."""
    place = ["--checkpoint-dir", str(tmp_path)] if module == "critic_server" else ["--scorer", "positive_fraction"]
    proc = subprocess.Popen([sys.executable, "-m", module, "--port", "0", "--http-port", "0", *place], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(0.6)  # past the interpreter's own start (tenths of a second), within the imports (seconds)
    proc.send_signal(sig)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 0 and f"stopped by {sig.name} before it began serving" in err, err[-2000:]
    assert "Traceback" not in err


def test_a_signal_before_the_actor_trains_stops_it_at_once_with_exit_zero(tmp_path):
    """The actor's start (imports, the models, waiting for its servers, up to startup_timeout_s) writes nothing a
    restart does not redo: a signal there stops it at once, exit 0, saying so (before, SIGTERM killed it, -15, and
    SIGINT printed a KeyboardInterrupt traceback)."""
    with socket.socket() as s:  # a port nothing listens on: the actor waits for its reward server there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(actor_command("grpo", tmp_path / "run", f"reward.address=127.0.0.1:{port}"), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = ""
    for line in proc.stderr:
        err += line
        if "waiting for the reward server" in line:
            break
    proc.send_signal(signal.SIGINT)
    err += proc.communicate(timeout=60)[1]
    assert proc.returncode == 0 and "actor: stopped by SIGINT before training began" in err, err[-2000:]
    assert "Traceback" not in err


@pytest.mark.parametrize("module, key", [("actor", "run_dir"), ("critic_server", "checkpoint_dir")])
def test_a_directory_the_service_cannot_write_is_refused_at_start_naming_the_key(module, key, tmp_path):
    """Where the actor writes its run, and the critic its checkpoints, is checked before anything loads: a path
    under a file is refused naming the key (not a traceback at the first write, steps later); nothing is created."""
    (tmp_path / "a-file").write_text("")
    target = tmp_path / "a-file" / "sub"
    done = subprocess.run([sys.executable, "-m", module, "--http-port", "0", f"{key}={target}"], cwd=ROOT,
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"error: {key}={target}: {tmp_path / 'a-file'} is a file, not a directory" in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_thread_budget_past_the_cores_is_set_with_a_warning(caplog):
    import torch

    from serving.modeling import set_thread_budget

    before, cores = torch.get_num_threads(), len(os.sched_getaffinity(0))
    try:
        with caplog.at_level("WARNING", logger="serving.modeling"):
            set_thread_budget(cores, "num_threads")
            assert torch.get_num_threads() == cores and not caplog.records
            set_thread_budget(cores + 3, "policy.num_threads")
        assert torch.get_num_threads() == cores + 3  # the user's choice stands; the log says what it costs
        assert [r.getMessage() for r in caplog.records] == [
            (f"policy.num_threads={cores + 3} is more than the {cores} CPU cores this process may use; torch's "
            f"threads will contend for them (a value at most {cores} is faster)")]
        set_thread_budget(0)  # torch's default: unchanged
        assert torch.get_num_threads() == cores + 3
    finally:
        torch.set_num_threads(before)


def test_a_second_actor_on_a_run_dir_in_use_is_refused_naming_the_holder(tmp_path):
    """Two actors on one run_dir (a retried job, a second terminal) would resume from each other's checkpoints and
    interleave metrics.jsonl; the second is refused before it reads or writes anything, naming the holder's pid. The
    lock goes with the process that holds it, however it ends."""
    from actor.checkpoints import lock_run_dir

    run_dir = tmp_path / "run"
    held = lock_run_dir(run_dir)
    try:
        done = subprocess.run([sys.executable, "-m", "actor", "--http-port", "0", f"run_dir={run_dir}"], cwd=ROOT,
                              check=False, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert f"error: run_dir={run_dir} is in use by another actor (pid {os.getpid()})" in done.stderr
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]
    finally:
        held.close()
    lock_run_dir(run_dir).close()  # released: the next one takes it


@pytest.mark.parametrize("damage", ["weights-truncated", "weights-missing", "weights-overwritten",
                                    "optimizer-overwritten", "config-truncated", "tokenizer-truncated",
                                    "config-only-model"])
def test_a_policy_that_cannot_load_is_refused_naming_the_checkpoint_or_the_key(embedded_assets, tmp_path, damage):
    """A checkpoint damaged on disk (a full disk, a copy gone wrong) stops the resume with the checkpoint named and
    the two ways on; a model directory with a config but no weights is refused naming policy.model_name. Both were
    tracebacks."""
    import shutil

    if damage == "config-only-model":
        model = tmp_path / "config-only"
        model.mkdir()
        shutil.copy(embedded_assets.policy / "config.json", model)
        done = subprocess.run([sys.executable, "-m", "actor", "--http-port", "0", f"run_dir={tmp_path / 'run'}",
                               f"policy.model_name={model}"], cwd=ROOT, check=False, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert f"error: policy.model_name={model}: " in done.stderr
        return
    step = tmp_path / "run" / "checkpoints" / "step_3"
    shutil.copytree(embedded_assets.policy, step / "actor")
    (step / "trainer_state.json").write_text("{}")
    weights = step / "actor" / "model.safetensors"
    if damage in ("weights-overwritten", "optimizer-overwritten"):  # 64 bytes changed in place: both load as they are
        from actor.checkpoints import WEIGHTS_CRC32, weight_sums, write_state

        write_state(step, {WEIGHTS_CRC32: weight_sums(step)}, {"state": {}, "param_groups": []}, {"torch": None})
        changed = weights if damage == "weights-overwritten" else step / "optimizer.pt"
        with changed.open("r+b") as f:
            f.seek(changed.stat().st_size // 2)
            f.write(bytes(range(64)))
    elif damage == "weights-missing":
        weights.unlink()
    else:
        cut = {"weights-truncated": weights, "config-truncated": step / "actor" / "config.json",
               "tokenizer-truncated": step / "actor" / "tokenizer.json"}[damage]
        cut.write_bytes(cut.read_bytes()[:100])
    done = subprocess.run([sys.executable, "-m", "actor", "--http-port", "0", f"run_dir={tmp_path / 'run'}"],
                          cwd=ROOT, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    if damage.endswith("-overwritten"):
        name = "actor/model.safetensors" if damage == "weights-overwritten" else "optimizer.pt"
        assert f"error: {step}: {name} is not the file the checkpoint wrote (it has CRC-32" in done.stderr, \
            done.stderr[-2000:]
    else:
        part = "its policy" if damage.startswith("weights") else "its tokenizer"
        assert f"error: {step}: {part} cannot be loaded" in done.stderr, done.stderr[-2000:]
    assert "checkpointing.resume=<run_dir>/checkpoints/step_N" in done.stderr and "resume=never" in done.stderr


def test_a_trainer_state_that_is_no_json_is_a_resume_error(tmp_path):
    from actor.checkpoints import ResumeError, read_state

    torch_save = __import__("torch").save
    torch_save({}, tmp_path / "optimizer.pt")
    torch_save({}, tmp_path / "rng.pt")
    (tmp_path / "trainer_state.json").write_text('{"step": 3, "consu')
    with pytest.raises(ResumeError, match=f"^{tmp_path}: cannot read its trainer_state.json \\(JSONDecodeError"):
        read_state(tmp_path)


@pytest.mark.parametrize("module", ["actor", "critic_server", "reward_server"])
def test_help_names_the_command_and_an_override_that_exists(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, check=True, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.startswith(f"usage: python -m {module} ") and "num_threads=2" in done.stdout
    check = subprocess.run([sys.executable, "-m", module, "--http-port", "0", "num_threads=abc"], cwd=ROOT,
                           check=False, capture_output=True, text=True, timeout=60)
    assert check.returncode == 2 and "num_threads" in check.stderr and "unknown key" not in check.stderr


def test_a_prompt_too_long_for_the_policy_with_its_response_is_named_by_file_and_line(tmp_path):
    """The embedded policy takes 64 positions: a 60-token prompt (under data.max_input_seq_length) leaves no room
    for 16 new tokens. The actor names the prompt's file and line before it waits for any server."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "river =>"}\n{"prompt": "' + " ".join(["river"] * 60) + '"}\n')
    done = subprocess.run([sys.executable, "-m", "actor", "--http-port", "0", f"run_dir={tmp_path / 'run'}",
                           f"data.train_file={prompts}", f"data.val_file={prompts}", "data.max_input_seq_length=100",
                           "policy.generation.max_new_tokens=16"],
                          cwd=ROOT, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert (f"error: {prompts}:2: the prompt has 60 tokens, and with policy.generation.max_new_tokens (16) a sample "
            f"needs 76, more than the policy accepts (64)") in done.stderr, done.stderr[-2000:]


def test_the_same_event_loop_error_is_logged_once_per_interval_with_the_count_held_back():
    """Out of file descriptors under a flood of connections, asyncio logged a traceback for every failed accept
    (839,234 in 70 s, 373 MB): each kind of error is now logged once per interval, the next with the count."""
    from serving.server import ThrottledLoopErrors

    class Loop:
        def __init__(self):
            self.logged: list[str] = []

        def default_exception_handler(self, context):
            self.logged.append(context["message"])

    loop, handler = Loop(), ThrottledLoopErrors(every_s=0.2)
    for _ in range(1000):
        handler(loop, {"message": "socket.accept() out of system resource"})
    handler(loop, {"message": "another error"})
    assert loop.logged == ["socket.accept() out of system resource", "another error"]
    time.sleep(0.25)
    handler(loop, {"message": "socket.accept() out of system resource"})
    assert loop.logged[-1].startswith("socket.accept() out of system resource (999 more like it in the last")


def test_a_host_that_does_not_resolve_is_named_as_the_reason_a_server_cannot_listen(tmp_path):
    """Every bind failure was put down to the port ('is the port taken?'), a host that does not resolve too (F6)."""
    done = subprocess.run([sys.executable, "-m", "reward_server", "--scorer", "positive_fraction", "--port", "0",
                           "--http-port", "0", "--host", "no-such-host.invalid", "--allow-insecure"], cwd=ROOT,
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert ("reward cannot listen on no-such-host.invalid:0 (gRPC): host 'no-such-host.invalid' does not resolve"
            in done.stderr), done.stderr[-2000:]
    assert "is the port taken" not in done.stderr and "Traceback" not in done.stderr


def test_a_cache_that_cannot_hold_the_embedded_models_is_named(tmp_path):
    """PPO_SERVICES_CACHE naming a file was 'cannot load its model: FileExistsError: [Errno 17] File exists' (F12)."""
    (tmp_path / "a-file").write_text("")
    done = subprocess.run([sys.executable, "-m", "reward_server", "--port", "0", "--http-port", "0"], cwd=ROOT,
                          check=False, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PPO_SERVICES_CACHE": str(tmp_path / "a-file")})
    assert done.returncode == 1, done.stderr[-2000:]
    assert (f"PPO_SERVICES_CACHE={tmp_path / 'a-file'}: cannot hold the embedded default models "
            f"({tmp_path / 'a-file'}: a file, not a directory)") in done.stderr, done.stderr[-2000:]
    assert "FileExistsError" not in done.stderr and "Traceback" not in done.stderr


def test_a_stop_token_past_the_vocabulary_is_refused_before_the_actor_loads_its_models(embedded_cache, tmp_path):
    """A stop token the policy can never sample was accepted, and the run went on without the stop it asked for
    (F13)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(actor_command("grpo", tmp_path / "run", "policy.generation.stop_token_ids=[5, 99999]",
                                        f"reward.address=127.0.0.1:{port}", "reward.connect_timeout_s=2"),
                          cwd=ROOT, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert ("error: policy.generation.stop_token_ids=[5, 99999]: 99999 is past the vocabulary of embedded:policy (51 "
            "ids, 0 to 50), so the policy can never sample it") in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # refused before the run directory is taken
