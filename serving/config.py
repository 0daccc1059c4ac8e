"""Typed configs: a YAML file plus dotted `key=value` overrides, validated by pydantic at start-up.

A bad key or value fails with a message that names the key and what is allowed.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from collections.abc import Hashable
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, model_validator

Cfg = TypeVar("Cfg", bound=BaseModel)


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

# A directory the service writes in (`run_dir`, `checkpoint_dir`): a leading `~` is the user's home, as a shell would
# read it, whether the value came from YAML or from an override the shell left alone (`run_dir=~/runs`)
DirPath = Annotated[str, AfterValidator(lambda value: str(Path(value).expanduser()) if value else value)]


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in nested dict `data`; the value is parsed as YAML (`3`, `true`, `[1, 2]`, `null`)."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r}: expected KEY=VALUE with a dotted KEY, e.g. num_threads=2 or "
                          "section.key=value")
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {part} is not a section")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: the value is not valid YAML ({getattr(e, 'problem', None) or e}); "
                          f"quote a string that starts with one of YAML's indicators, as in {key}='\"{raw}\"'") from None
    if _cut_by_a_comment(raw, value):
        raise ConfigError(f"override {override!r}: YAML reads a '#' at the start or after a space as the start of a "
                          f"comment, so the value would be cut to {value!r}; quote the whole value to keep it, as in "
                          f"{key}='\"{raw}\"'")
    node[parts[-1]] = value


_NOT_A_COMMENT = "\ue000"  # a private-use character standing in for '#' to see whether YAML dropped a comment


def _cut_by_a_comment(raw: str, value: Any) -> bool:
    """Whether YAML dropped a comment from override value `raw` (`system_prompt=Answer #1 first` reads as 'Answer'):
    parsed again with every '#' replaced by a character that starts no comment, it reads otherwise. A '#' inside
    quotes, or inside a word (`C#`), changes nothing and passes."""
    if "#" not in raw:
        return False
    try:
        again = yaml.safe_load(raw.replace("#", _NOT_A_COMMENT))
    except yaml.YAMLError:
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
            if key and re.match(r"\w+: ", msg):  # a section's validator naming one of its keys
                lines.append(f"  {key}.{msg}")
            else:
                lines.append(f"  {key + ': ' if key and not msg.startswith(key) else ''}{msg}")
        else:
            lines.append(f"  {key}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (which would silently keep the last)."""

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


def load_config(model: type[Cfg], path: str | Path | None = None, overrides: list[str] | None = None) -> Cfg:
    """Read YAML `path` (optional), apply dotted overrides, validate into `model`."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} {'is a directory' if path.is_dir() else 'does not exist'}")
        try:
            data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path}: not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r})"
                              ) from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path}: not valid YAML: {e}") from e
        data = {} if data is None else data  # an empty file
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: expected a mapping of keys at the top level")
        source = str(path)
    aliases: dict[str, str] = getattr(model, "section_aliases", {})
    for alias, name in aliases.items():  # one section, two names (NeMo-RL's `grpo` for `ppo`): the file's, renamed
        if alias in data and name not in data:
            data[name] = data.pop(alias)
    for override in overrides or []:
        head, dot, rest = override.partition(".")
        apply_override(data, f"{aliases[head]}.{rest}" if dot and head in aliases else override)
    if overrides:
        source += " + command-line overrides"
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(model, e, source)) from None


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


def _is_text(model: type[BaseModel], key: str) -> bool:
    """Whether dotted `key` of `model` holds text: a flag's value for it is taken as given, not read as YAML (an IPv6
    host `::` would be a mapping, a model named `yes` a boolean)."""
    field = None
    for part in key.split("."):
        field = model.model_fields.get(part)
        if field is None:
            return False
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            model = field.annotation
    annotation = field.annotation
    return annotation is str or (get_origin(annotation) in (Union, UnionType) and str in get_args(annotation))


def parse_cli(
    model: type[Cfg], argv: list[str] | None, description: str, flags: dict[str, tuple[str, str]],
    switches: frozenset[str] = frozenset(), writes: tuple[str, ...] = (),
) -> Cfg:
    """Command line of a service: `--config FILE`, the flags in `flags` (`--port` -> config key `port`,
    with help text), and trailing dotted `key=value` overrides. Exits with status 2 on a config error, and when a
    directory named by a key in `writes` (where the service writes its work) cannot be created and written."""
    package = model.__module__.partition(".")[0]  # actor.config -> `python -m actor`, as a user starts it
    parser = argparse.ArgumentParser(prog=f"python -m {package}", description=description)
    parser.add_argument("--config", help="YAML config file; every key is documented in docs/configuration.md")
    for flag, (key, help_text) in flags.items():
        if key in switches:  # a flag without a value sets its boolean key
            parser.add_argument(flag, dest=key.replace(".", "__"), action="store_const", const="true", default=None,
                                help=f"{help_text} (config key `{key}`)")
        else:
            parser.add_argument(flag, dest=key.replace(".", "__"), default=None, help=f"{help_text} (config key `{key}`)")
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
