"""Typed configs: a YAML file plus dotted `key=value` overrides, validated by pydantic at start-up.

A bad key or value fails with a message that names the key and what is allowed.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import tempfile
from collections.abc import Hashable
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Self, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, model_validator

Cfg = TypeVar("Cfg", bound=BaseModel)
log = logging.getLogger(__name__)


class StrictModel(BaseModel):
    """Base of every config section: unknown keys are errors, defaults are validated too, a number must be finite,
    and `true`/`false` are no numbers (pydantic's lax mode read `lr: true` as a learning rate of 1)."""

    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            field = cls.model_fields.get(name) if isinstance(name, str) else None
            if field is None or not _numbers_only(field.annotation):
                continue
            values = value if isinstance(value, list | tuple) else [value]
            if any(isinstance(v, bool) for v in values):
                raise ValueError(f"{name}: expected a number, got {json.dumps(value)} (true and false are no numbers)")
        return data

    @model_validator(mode="before")
    @classmethod
    def _no_yaml_1_1_numbers(cls, data: Any) -> Any:
        """A number YAML 1.1 reads otherwise than its digits say (`010` is 8, `1:30` is 90) is refused for a key that
        takes no text, saying how to write it; a text key takes it as written (Yaml11Number)."""
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            field = cls.model_fields.get(name) if isinstance(name, str) else None
            if field is None or _text_anywhere(field.annotation):
                continue
            for v in value if isinstance(value, list | tuple) else [value]:
                if isinstance(v, Yaml11Number):
                    raise ValueError(f"{name}: {v.explain()}")  # noqa: TRY004 - pydantic reports ValueError
        return data

    @model_validator(mode="before")
    @classmethod
    def _a_null_section_is_empty(cls, data: Any) -> Any:
        """`policy:` with every key under it commented out is YAML's null: the section's defaults (an optional
        section, such as policy.lora, keeps null as `none`)."""
        if not isinstance(data, dict):
            return data
        return {name: {} if value is None and isinstance(name, str) and _is_section(cls.model_fields.get(name)) else value
                for name, value in data.items()}


def _text_anywhere(annotation: Any) -> bool:
    """Whether a field's type holds `str` anywhere (`str`, `str | None`, `str | list[str]`, `dict[str, ...]`)."""
    if annotation is str:
        return True
    return any(_text_anywhere(a) for a in get_args(annotation) if not isinstance(a, str))


def _is_section(field: Any) -> bool:
    """Whether a field is a section of its own (a config model, not an optional one)."""
    ann = getattr(field, "annotation", None)
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def _numbers_only(annotation: Any) -> bool:
    """Whether a field takes numbers and nothing else (an int or float, optional, or a tuple or list of them)."""
    if get_origin(annotation) is Annotated:
        return _numbers_only(get_args(annotation)[0])
    kinds = [a for a in (get_args(annotation) or (annotation,)) if a is not type(None) and a is not Ellipsis]
    if get_origin(annotation) in (tuple, list):
        return all(_numbers_only(a) for a in kinds)
    return bool(kinds) and all(a in (int, float) or (get_origin(a) is Annotated and _numbers_only(a)) for a in kinds)


class ConfigError(ValueError):
    """A config file, key or value is wrong; the message says which and what is allowed."""


def _device_spec(value: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", value):
        raise ValueError(f"expected auto, cpu, cuda or cuda:N (N a GPU index), got {value!r}")
    return value


# A `device` key: checked when the config is read, before torch is imported; whether that GPU exists is checked when
# the service resolves it (serving.modeling.resolve_device)
DeviceSpec = Annotated[str, AfterValidator(_device_spec)]

# Upper bounds of the settings that reach C code or the clock, shared by every service's config: a larger number
# passed validation and then overflowed in torch or gRPC with a traceback, or turned a deadline into one already past
MAX_THREADS = 4096  # torch CPU threads (num_threads): more than any machine's cores, far below a C int
SEED_LIMIT = 2**32  # seeds are below this, as numpy's are; torch takes up to 2**64 - 1
MAX_TIMEOUT_S = 30 * 86400  # timeouts and grace periods: 30 days, which Python's clocks and gRPC deadlines take
# a duration gRPC takes as a C int of milliseconds (keepalive, ping interval, handshake timeout): 2**31 - 1 ms, 24.8 days
MAX_GRPC_MS_S = (2**31 - 1) // 1000
MAX_MESSAGE_MB = 2047  # gRPC's message limits are C ints of bytes: at most 2 GiB - 1
MAX_QUEUE_DELAY_MS = 60_000  # a partial batch waits for companions at most a minute, holding every caller in it


def not_blank(what: str) -> AfterValidator:
    """A validator refusing an empty (or all-blank) string, saying what the key expects instead."""

    def check(value: str) -> str:
        if not value.strip():
            raise ValueError(f"must not be empty; expected {what}")
        return value

    return AfterValidator(check)


# A directory the service writes in (`run_dir`, `checkpoint_dir`): a leading `~` is the user's home, as a shell would
# read it, whether the value came from YAML or from an override the shell left alone (`run_dir=~/runs`); an empty one
# would have been the working directory, unannounced
DirPath = Annotated[str, not_blank("a directory (. for the working directory)"),
                    AfterValidator(lambda value: str(Path(value).expanduser()))]
# A file the service reads (a token, a prompt file, a template)
FilePath = Annotated[str, not_blank("the path of a file")]
# A model setting: a local directory, a hub id or an embedded model
ModelName = Annotated[str, not_blank("a model directory, a hub id or embedded:<name>")]


def apply_override(data: dict[str, Any], override: str, field: Any = None) -> None:
    """Set `a.b.c=value` in nested dict `data`; the value is parsed as YAML (`3`, `true`, `[1, 2]`, `null`). `field` is
    the key's pydantic field where known: a key that holds text takes the value as written where YAML reads something
    else (`host=::`, `run_dir=~`, `critic.address=10:20`), as its flag does."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r}: expected KEY=VALUE with a dotted KEY, e.g. num_threads=2 or "
                          "section.key=value")
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if node.get(part) is None:  # absent, or a section a file left null (`policy:` with its keys commented out)
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parts[:i + 1])} is {node!r}, not a section of keys")
    try:
        value = _load_yaml(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: the value is not valid YAML ({getattr(e, 'problem', None) or e}); "
                          f"quote a string that starts with one of YAML's indicators, as in {key}='\"{raw}\"'") from None
    except RecursionError:
        raise ConfigError(f"override {key}=...: the value is nested too deeply to read") from None
    if _cut_by_a_comment(raw, value):
        raise ConfigError(f"override {override!r}: YAML reads a '#' at the start or after a space as the start of a "
                          f"comment, so the value would be cut to {value!r}; quote the whole value to keep it, as in "
                          f"{key}='\"{raw}\"'")
    if field is not None and _holds_text(field) and not isinstance(value, str):
        args = get_args(field.annotation)
        if not (value is None and type(None) in args) and not (isinstance(value, list) and
                                                              any(get_origin(a) is list for a in args)):
            value = raw
    node[parts[-1]] = value


_NOT_A_COMMENT = "\ue000"  # a private-use character standing in for '#' to see whether YAML dropped a comment


def _cut_by_a_comment(raw: str, value: Any) -> bool:
    """Whether YAML dropped a comment from override value `raw` (`system_prompt=Answer #1 first` reads as 'Answer'):
    parsed again with every '#' replaced by a character that starts no comment, it reads otherwise. A '#' inside
    quotes, or inside a word (`C#`), changes nothing and passes."""
    if "#" not in raw:
        return False
    try:
        again = _load_yaml(raw.replace("#", _NOT_A_COMMENT))
    except (yaml.YAMLError, RecursionError):
        return True  # the comment hid text that is no YAML

    def back(x: Any) -> Any:
        if isinstance(x, str):
            return x.replace(_NOT_A_COMMENT, "#")
        if isinstance(x, list):
            return [back(v) for v in x]
        if isinstance(x, dict):
            return {back(k): back(v) for k, v in x.items()}
        return x

    return back(again) != value


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the config section at `loc` (the parent of an unknown key)."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        # an optional section (`LoraConfig | None`) is a union holding the section's model
        section = next((a for a in (ann, *get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if section is None:
            return []
        model = section
    return sorted(model.model_fields)


def format_validation_error(model: type[BaseModel], err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key; allowed keys here: {', '.join(_allowed_keys(model, e['loc']))}")
        elif e["type"] == "value_error":  # a validator's own message names the keys; the input may be a whole section
            msg = e["msg"].removeprefix("Value error, ")
            if key and msg.startswith(key) and msg[len(key):len(key) + 1] in (":", ".", "=", " "):  # named in full
                lines.append(f"  {msg}")
            elif key and re.match(r"\w+: ", msg):  # a section's validator naming one of its keys
                lines.append(f"  {key}.{msg}")
            else:
                lines.append(f"  {key + ': ' if key and not msg.startswith(key) else ''}{msg}")
        elif e["type"] == "string_type":  # YAML read a bare word or number as something else than text
            value = e.get("input")
            lines.append(f"  {key}: expected text, got {value!r}: YAML read the value as "
                         f"{'null' if value is None else type(value).__name__}; quote it to keep it as written")
        else:
            lines.append(f"  {key}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


class Yaml11Number(str):
    """A scalar PyYAML (YAML 1.1) reads as another number than its digits say in decimal: a leading zero makes it octal
    (`010` is 8, `--port 077777` was 32767), colons make it base 60 (`1:30` is 90). Kept as the text written, so a
    text key takes it as written; a key that takes no text refuses it, naming the key (StrictModel)."""

    read_as: float  # an int for an int

    def __new__(cls, text: str, read_as: float) -> Self:
        number = super().__new__(cls, text)
        number.read_as = read_as
        return number

    def explain(self) -> str:
        if ":" in self:
            return (f"YAML 1.1 reads {self} as the base-60 number {self.read_as}; write the number in one unit "
                    f"({self.read_as} if base 60 was meant), or quote it if it is text")
        decimal = int(self.replace("_", ""), 10)
        return (f"YAML 1.1 reads {self} as the octal number {self.read_as}; write {decimal} without the leading zero "
                f"({self.read_as} if octal was meant)")


def _reads_otherwise(text: str, value: float) -> bool:
    """Whether YAML 1.1 read `text` as base 60, or as an octal number other than its decimal reading (`07` is 7
    either way)."""
    if ":" in text:
        return True
    digits = text.lstrip("+-").replace("_", "")
    return len(digits) > 1 and digits.startswith("0") and digits.isdigit() and int(text.replace("_", ""), 10) != value


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (which would silently keep the last), and keeping
    the YAML 1.1 numbers that read otherwise than written as Yaml11Number."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int | str:
        value = super().construct_yaml_int(node)
        return Yaml11Number(node.value, value) if _reads_otherwise(node.value, value) else value

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float | str:
        value = super().construct_yaml_float(node)
        return Yaml11Number(node.value, value) if ":" in node.value else value

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`, whose keys the mapping's own may override
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # the base loader refuses it, naming its line
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice in this mapping",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", _UniqueKeyLoader.construct_yaml_float)


def _load_yaml(text: str) -> Any:
    """`text` read as YAML by _UniqueKeyLoader; RecursionError where it nests too deeply for Python."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


MAX_CONFIG_BYTES = 16 * 2**20  # more is no config file (and /dev/zero never ends)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping YAML file `path` holds: a regular file, or a pipe or device (`--config <(envsubst < f)`,
    /dev/null); ConfigError naming the file and what is wrong with it."""
    if str(path) == "":  # Path("") is the working directory
        raise ConfigError("config file: the path is empty; name a YAML file, or leave --config out for the defaults")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path}: larger than {MAX_CONFIG_BYTES // 2**20} MiB, no config file")
    try:
        data = _load_yaml(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r})"
                          ) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: not valid YAML: {e}") from e
    except RecursionError:
        raise ConfigError(f"config file {path}: nested too deeply to read (lists or mappings hundreds of levels "
                          "deep)") from None
    data = {} if data is None else data  # an empty file
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of keys at the top level")
    return data


def canonical_override(model: type[BaseModel], override: str) -> str:
    """`override` (`key=value`) with its section called by its own name where it names an alias of it (`grpo.seed=1`
    -> `ppo.seed=1`, `model.section_aliases`)."""
    aliases: dict[str, str] = getattr(model, "section_aliases", {})
    head, dot, rest = override.partition(".")
    return f"{aliases[head]}.{rest}" if dot and head in aliases else override


def load_config(model: type[Cfg], path: str | Path | None = None, overrides: list[str] | None = None) -> Cfg:
    """Read YAML `path` (optional), apply dotted overrides, validate into `model`. A key given twice among the
    overrides is refused where its two spellings differ (`grpo.seed` and `ppo.seed`); the same spelling twice is
    applied in order, with a warning naming the key."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        data = read_config_file(path)
        source = str(path)
    aliases: dict[str, str] = getattr(model, "section_aliases", {})
    renamed = {}  # the sections the file calls by an alias, which errors call so too
    for alias, name in aliases.items():  # one section, two names (NeMo-RL's `grpo` for `ppo`): the file's, renamed
        if alias in data and name not in data:
            data[name] = data.pop(alias)
            renamed[name] = alias
    given: dict[str, str] = {}
    for as_given in overrides or []:
        override = canonical_override(model, as_given)
        key = override.partition("=")[0]
        if key in given and "=" in override:
            if given[key].partition("=")[0] != as_given.partition("=")[0]:  # two spellings: which one was meant?
                raise ConfigError(f"{key} is given twice on the command line, as {given[key]!r} and {as_given!r}: "
                                  "give it once")
            # a command built from a base list and the settings of one run (the tests', the demo's) repeats keys
            log.warning("%s is given twice on the command line (%s, then %s): the last one applies", key,
                        given[key], as_given)
        given[key] = as_given
        apply_override(data, override, _field_at(model, key))
    if overrides:
        source += " + command-line overrides"
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message = format_validation_error(model, e, source)
        for name, alias in renamed.items():
            message = re.sub(rf"(?<![\w./-]){name}\.(?=\w)", f"{alias}.", message)
        raise ConfigError(message) from None


def unwritable_dir(path: str, key: str) -> str | None:
    """Why the service could not create and write the directory `path` (config key `key`), or None when it can. Leaves
    nothing behind: the nearest existing ancestor gets a temporary directory, removed at once (permission bits alone
    mislead where the service runs as root on a read-only mount or in /proc)."""
    existing = Path(path).expanduser().absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{key}={path}: {existing} is a file, not a directory"
    try:
        tempfile.TemporaryDirectory(dir=existing, prefix=".write-check-").cleanup()
    except OSError as e:
        return f"{key}={path}: cannot write in {existing} ({e.strerror or e})"
    return None


def _field_at(model: type[BaseModel], key: str) -> Any:
    """The pydantic field of dotted `key` in `model` (through sections, optional ones too); None for a key that is
    not one (an environment's own `env.<key>`, or no key at all)."""
    field = None
    for part in key.split("."):
        if model is None or (field := model.model_fields.get(part)) is None:
            return None
        ann = field.annotation
        model = next((a for a in (ann, *get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return field


def _holds_text(field: Any) -> bool:
    """Whether a field holds text (`str`, or `str` among the types of a union)."""
    annotation = field.annotation
    return annotation is str or (get_origin(annotation) in (Union, UnionType) and str in get_args(annotation))


def _is_text(model: type[BaseModel], key: str) -> bool:
    """Whether dotted `key` of `model` holds text: a flag's value for it is taken as given, not read as YAML (an IPv6
    host `::` would be a mapping, a model named `yes` a boolean)."""
    field = _field_at(model, key)
    return field is not None and _holds_text(field)


class _Once(argparse.Action):
    """A flag that may be given once: a second one is refused (argparse would keep the last silently), as a key given
    twice is. With nargs=0, a switch setting `const`."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if getattr(namespace, self.dest, None) is not None:
            parser.exit(2, f"error: {option_string} is given twice: give it once\n")
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def parse_cli(
    model: type[Cfg], argv: list[str] | None, description: str, flags: dict[str, tuple[str, str]],
    switches: frozenset[str] = frozenset(), writes: tuple[str, ...] = (),
) -> Cfg:
    """Command line of a service: `--config FILE`, the flags in `flags` (`--port` -> config key `port`,
    with help text), and trailing dotted `key=value` overrides. Exits with status 2 on a config error, and when a
    directory named by a key in `writes` (where the service writes its work) cannot be created and written."""
    package = model.__module__.partition(".")[0]  # actor.config -> `python -m actor`, as a user starts it
    parser = argparse.ArgumentParser(prog=f"python -m {package}", description=description)
    parser.add_argument("--config", action=_Once, help="YAML config file; every key is documented in "
                        "docs/configuration.md")
    for flag, (key, help_text) in flags.items():
        if key in switches:  # a flag without a value sets its boolean key
            parser.add_argument(flag, dest=key.replace(".", "__"), action=_Once, nargs=0, const="true", default=None,
                                help=f"{help_text} (config key `{key}`)")
        else:
            parser.add_argument(flag, dest=key.replace(".", "__"), action=_Once, default=None,
                                help=f"{help_text} (config key `{key}`)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted config overrides, e.g. num_threads=2 (every service has it)")
    args = parser.parse_intermixed_args(argv)  # flags and KEY=VALUE overrides in any order
    overrides = [f"{key}={json.dumps(v) if _is_text(model, key) else v}" for key, _ in flags.values()
                 if (v := getattr(args, key.replace(".", "__"))) is not None]
    given = {o.partition("=")[0] for o in args.overrides}
    for flag, (key, _) in flags.items():
        if key in given and getattr(args, key.replace(".", "__")) is not None:
            parser.exit(2, f"error: {flag} and {key}=... both set config key {key}: give it once\n")
    try:
        cfg = load_config(model, args.config, [*args.overrides, *overrides])
    except ConfigError as e:
        parser.exit(2, f"error: {e}\n")
    for key in writes:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if value and (why := unwritable_dir(str(value), key)):
            parser.exit(2, f"error: {why}\n")
    return cfg
