"""Prompt data: JSONL files (one object per line) or JSON arrays of objects, each object with a prompt (a string,
or a list of chat messages) and optionally a reference answer (the label, any JSON value). Errors name the file
and line."""

from __future__ import annotations

import json
import re
import string
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from serving.modeling import text_ids


class DataError(ValueError):
    """A prompt file is missing or malformed; the message names the file and the line."""


def resolve_data_file(spec: str) -> Path:
    """`embedded:prompts_train` / `embedded:prompts_eval` -> the built embedded files; else a path."""
    if spec.startswith("embedded:"):
        from embedded import ensure_built

        assets = ensure_built()
        name = spec.removeprefix("embedded:")
        if name not in ("prompts_train", "prompts_eval"):
            raise DataError(f"{spec}: unknown embedded data; expected embedded:prompts_train or embedded:prompts_eval")
        return getattr(assets, name)
    return Path(spec).expanduser()


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids, its label (None when the line has none) and its chat messages (a string prompt is
    one user message), which a chat reward model reads with the response after them (reward.input=chat)."""

    ids: list[int]
    label: Any = None
    where: str = ""  # "FILE:LINE", for error messages
    messages: list[dict[str, str]] | None = None  # None: the decoded ids as one user message


@dataclass(frozen=True)
class PromptFormat:
    """How a prompt line becomes text (data.prompt_file, data.apply_chat_template, data.system_prompt_file): a string
    prompt goes into `template` at its {}, then, with `chat`, becomes one user message after the `system` message;
    a list of {role, content} messages (TRL's conversational format) gets the system message unless it has one. Chat
    messages are rendered by the tokenizer's chat template with the generation prompt; the text is then tokenized
    without adding special tokens (a template writes its own)."""

    template: str | None = None
    chat: bool = False
    system: str | None = None

    @classmethod
    def from_files(cls, prompt_file: str | None, chat: bool, system_prompt_file: str | None) -> PromptFormat:
        """The format of the data config's keys, reading and checking their files."""
        template = _read_text(prompt_file, "data.prompt_file") if prompt_file is not None else None
        if template is not None:
            _check_template(template, f"{prompt_file} (data.prompt_file)")
        system = _read_text(system_prompt_file, "data.system_prompt_file") if system_prompt_file is not None else None
        return cls(template, chat, system)

    def messages(self, value: Any) -> list[dict[str, str]] | None:
        """The chat messages of a line's prompt (None: render it as plain text); ValueError says what is wrong."""
        if isinstance(value, str):
            if not self.chat:
                return None
            value = [{"role": "user", "content": self.text(value)}]
        elif not (isinstance(value, list) and value):
            raise ValueError("expected a non-empty string or a non-empty list of {\"role\": str, \"content\": str} messages")
        elif (bad := next((i for i, m in enumerate(value) if not (
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str))),
                None)) is not None:
            raise ValueError(f"message {bad}: expected {{\"role\": str, \"content\": str}} in a list of "
                             f"{{\"role\": str, \"content\": str}} messages, got {json.dumps(value[bad])[:200]}")
        elif not any(m["role"] != "system" and m["content"].strip() for m in value):
            raise ValueError("no message but the system's has any text: there is nothing for the policy to answer")
        elif self.template is not None:  # silently left out before: the instructions never reached the policy
            raise ValueError("data.prompt_file formats string prompts (its {} takes the prompt), and this prompt is a "
                             "list of messages: write the instructions into the messages (or the system message, "
                             "data.system_prompt_file), or drop data.prompt_file")
        if value[-1]["role"] == "assistant":
            raise ValueError("the conversation ends with an assistant message: a prompt ends where the policy's "
                             "answer begins (drop the reference answer from the messages; it can be the label)")
        if self.system is not None and value[0]["role"] != "system":
            value = [{"role": "system", "content": self.system}, *value]
        return value

    def text(self, prompt: str) -> str:
        return prompt if self.template is None else self.template.format(prompt)

    def render(self, value: Any, tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[dict[str, str]]]:
        """A line's prompt as the policy reads it (token ids) and as a chat reward model reads it (messages: a string
        prompt, formatted by `template`, is one user message, after the system message when there is one);
        ValueError says what is wrong with it."""
        messages = self.messages(value)
        if messages is None:  # as the tokenizer begins a text (e.g. with BOS), since the response continues it
            text = self.text(value)
            return text_ids(tokenizer, [text], ending=False)[0], [{"role": "user", "content": text}]
        if tokenizer.chat_template is None:
            raise ValueError("a chat prompt needs a chat template, and the policy's tokenizer has none (set "
                             "chat_template in its tokenizer_config.json, or give string prompts with "
                             "data.apply_chat_template=false)")
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - the template's own complaint (e.g. roles must alternate), with its line
            raise ValueError(f"the policy tokenizer's chat template refused the messages: {type(e).__name__}: {e}") from None
        return tokenizer(text, add_special_tokens=False)["input_ids"], messages


def _read_text(path: str, key: str) -> str:
    try:
        return Path(path).expanduser().read_text(encoding="utf-8-sig")  # without a byte-order mark
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path} ({key}): cannot be read: {e.strerror if isinstance(e, OSError) else e}") from None


def _require_file(path: Path) -> Path:
    if path.is_dir():
        raise DataError(f"{path}: a directory, where a prompt file (JSONL or a JSON array) is expected")
    if not path.is_file():
        raise DataError(f"{path}: prompt file does not exist")
    return path


def existing_prompt_file(spec: str, key: str) -> Path:
    """The prompt file `spec` names (data.train_file / data.val_file), checked to be one: called before the models
    load, so a mistyped path costs seconds, not a large model's load."""
    try:
        return _require_file(resolve_data_file(spec))
    except DataError as e:
        raise DataError(f"{key}: {e}") from None


def _check_template(template: str, where: str) -> None:
    """A prompt template holds one plain {} (or {0}) where the prompt goes, other braces doubled: a field with an
    index, attribute, conversion or format spec ({0[0]}, {0.x}, {!r}, {:.4}) would put a part of the prompt there, or
    something else, and a second field a second copy."""
    try:
        fields = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(template)
                  if name is not None]
    except ValueError as e:
        raise DataError(f"{where}: not a template with one {{}} where the prompt goes (other braces doubled): "
                        f"{e}") from None
    if not fields:
        raise DataError(f"{where}: the template has no {{}} where the prompt goes")
    if len(fields) > 1:
        raise DataError(f"{where}: not a template with one {{}} where the prompt goes (other braces doubled): it has "
                        f"{len(fields)} fields")
    name, spec, conversion = fields[0]
    if name not in ("", "0") or spec or conversion:
        field = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        raise DataError(f"{where}: the prompt goes in whole at a plain {{}}, got {field}")


def _jsonl_records(path: Path, data: bytes) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for every non-blank line of a JSONL file."""
    for lineno, raw in enumerate(data.splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                            f"prompt files are JSONL or a JSON array, in UTF-8") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON: {e.msg} (column {e.colno})") from None
        except (ValueError, RecursionError) as e:
            raise DataError(f"{path}:{lineno}: {_unreadable_json(e)}") from None
        yield lineno, record


def _unreadable_json(e: ValueError | RecursionError) -> str:
    """Valid JSON that Python's parser will not read: an integer of more than 4300 digits, or nesting too deep."""
    if isinstance(e, RecursionError):
        return "JSON nested too deeply to read"
    return f"JSON this reader cannot take: {e}"


def _json_array_records(path: Path, data: bytes) -> Iterator[tuple[int, Any]]:
    """(line number where it starts, parsed object) for every element of a file holding one JSON array (the
    layout of many published datasets' .json files), parsed element by element so each keeps its line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte {data[e.start]:#04x}); prompt files are JSONL or a "
                        f"JSON array, in UTF-8") from None
    decoder, ws = json.JSONDecoder(), re.compile(r"\s*")
    line, counted = 1, 0  # the line of text[counted], counted forward as the parse goes (once over the text)

    def line_at(pos: int) -> int:
        nonlocal line, counted
        line, counted = line + text.count("\n", counted, pos), pos
        return line

    pos = ws.match(text, text.index("[") + 1).end()
    if text.startswith("]", pos):
        pos = ws.match(text, pos + 1).end()
    else:
        while True:
            try:
                obj, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{e.lineno}: not valid JSON: {e.msg} (column {e.colno})") from None
            except (ValueError, RecursionError) as e:
                raise DataError(f"{path}:{line_at(pos)}: {_unreadable_json(e)}") from None
            yield line_at(pos), obj
            pos = ws.match(text, end).end()
            if text.startswith(",", pos):
                pos = ws.match(text, pos + 1).end()
            elif text.startswith("]", pos):
                pos = ws.match(text, pos + 1).end()
                break
            else:
                raise DataError(f"{path}:{line_at(pos)}: not valid JSON: expected ',' or ']' after the array's "
                                f"element")
    if pos != len(text):
        raise DataError(f"{path}:{line_at(pos)}: not valid JSON: text after the array's end")


_MISSING = object()


def lookup(obj: dict, key: str) -> Any:
    """obj[key]; for a key with dots that the object does not hold as it is, the path through nested objects
    (`reward_model.ground_truth`, verl's layout). _MISSING when absent."""
    if key in obj or "." not in key:
        return obj.get(key, _MISSING)
    for part in key.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return _MISSING
        obj = obj[part]
    return obj


def load_prompts(path: Path, key: str, tokenizer: PreTrainedTokenizerBase, max_length: int,
                 label_key: str = "label", fmt: PromptFormat = PromptFormat(),
                 embedding_rows: int | None = None) -> list[Prompt]:
    """Every prompt of a prompt file, formatted by `fmt` and tokenized, with its label if its object has one. The
    file is JSONL (an object per line) or one JSON array of objects (a file whose first character is `[`); errors
    name the file and the line the object starts on. With `embedding_rows` (the policy's), a prompt holding a token
    the model has no embedding for is refused."""
    _require_file(path)
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
    records = _json_array_records if data.lstrip().startswith(b"[") else _jsonl_records
    prompts = []
    for lineno, obj in records(path, data):
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:  # JSON's \uXXXX escapes can spell half of a surrogate pair alone
            raise DataError(f"{path}:{lineno}: holds a lone surrogate (a \\ud800-\\udfff escape without its "
                            f"pair), which is not valid Unicode") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{lineno}: expected an object with a prompt under {key!r} (data.prompt_key), "
                            f"got {type(obj).__name__}")
        prompt, label = lookup(obj, key), lookup(obj, label_key)
        label = None if label is _MISSING else label
        if prompt is _MISSING:
            raise DataError(f"{path}:{lineno}: no {key!r} (data.prompt_key); the object has "
                            f"{', '.join(map(repr, list(obj)[:10])) or 'no keys'}")
        if isinstance(prompt, str) and not prompt.strip():
            raise DataError(f"{path}:{lineno}: expected a non-empty string {key!r} (or a list of chat messages)")
        try:
            json.dumps(label, allow_nan=False)
        except ValueError:
            raise DataError(f"{path}:{lineno}: the label {label_key!r} (data.label_key) holds NaN or Infinity, "
                            f"which is not JSON: no scorer can compare it (a missing value written by pandas?)") from None
        try:
            ids, conversation = fmt.render(prompt, tokenizer)
        except ValueError as e:
            raise DataError(f"{path}:{lineno}: {key!r}: {e}") from None
        if not ids:
            raise DataError(f"{path}:{lineno}: prompt tokenizes to nothing")
        if len(ids) > max_length:
            raise DataError(f"{path}:{lineno}: prompt has {len(ids)} tokens, more than "
                            f"data.max_input_seq_length={max_length}")
        if embedding_rows is not None and (token := max(ids)) >= embedding_rows:
            raise DataError(f"{path}:{lineno}: the prompt holds token {tokenizer.convert_ids_to_tokens(token)!r} "
                            f"(id {token}), past the policy's embedding table ({embedding_rows} rows): the "
                            f"tokenizer has tokens the model was not resized for")
        prompts.append(Prompt(ids, label, f"{path}:{lineno}", conversation))
    if not prompts:
        raise DataError(f"{path}: no prompts")
    return prompts


class PromptSampler:
    """Endless epochs over the prompts, reshuffled each epoch by a seeded generator."""

    def __init__(self, prompts: list[Prompt], seed: int, shuffle: bool = True):
        self.prompts, self.shuffle = prompts, shuffle
        self.gen = torch.Generator().manual_seed(seed)
        self.epoch, self.consumed = 0, 0
        self._order = self._new_order()
        self._pos = 0

    def _new_order(self) -> list[int]:
        n = len(self.prompts)
        return torch.randperm(n, generator=self.gen).tolist() if self.shuffle else list(range(n))

    def state_dict(self) -> dict:
        """Where the sampler is (for exact resume): the epoch's order, the position in it, the counters and the
        shuffling generator's state."""
        return {"order": self._order, "pos": self._pos, "epoch": self.epoch, "consumed": self.consumed,
                "generator": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self._order, self._pos = list(state["order"]), int(state["pos"])
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self.gen.set_state(state["generator"])

    @property
    def finished_epochs(self) -> int:
        """Complete passes over the prompts so far."""
        return self.epoch + (self._pos == len(self._order))

    def take(self, n: int) -> list[Prompt]:
        out = []
        while len(out) < n:
            if self._pos == len(self._order):
                self.epoch += 1
                self._order, self._pos = self._new_order(), 0
            out.append(self.prompts[self._order[self._pos]])
            self._pos += 1
        self.consumed += n
        return out


def require_labels(prompts: list[Prompt], label_key: str, why: str) -> None:
    """Fail, naming the first line without one, unless every prompt has a label."""
    missing = next((p for p in prompts if p.label is None), None)
    if missing is not None:
        raise DataError(f"{missing.where}: no {label_key!r} (data.label_key; null counts as none), but {why}")


RUN_ID_FILE = "run_id"


def run_id_of(run_dir: Path) -> str:
    """The run's id: made once (12 hex digits) and kept in <run_dir>/run_id, so a restart in the same run_dir keeps
    it. It names the run's critic checkpoints and its Train requests."""
    path = run_dir / RUN_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    return new_run_id(run_dir)


def new_run_id(run_dir: Path) -> str:
    """A new id for the run in run_dir, replacing the one kept there."""
    import uuid

    run_dir.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex[:12]
    (run_dir / RUN_ID_FILE).write_text(run_id + "\n")
    return run_id
