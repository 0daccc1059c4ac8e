"""Write docs/configuration.md from the config models, so every key is documented in one place (the
models' field descriptions). `--check` exits 1 when the committed file is stale (a test runs it)."""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from actor.config import ActorConfig
from critic_server.config import CriticConfig
from reward_server.config import RewardConfig

OUT = ROOT / "docs" / "configuration.md"
SERVICES = [
    ("actor", "python -m actor --config FILE [key=value ...]", ActorConfig),
    ("critic_server", "python -m critic_server [--port 5555] [--config FILE] [key=value ...]", CriticConfig),
    ("reward_server", "python -m reward_server [--port 5556] [--config FILE] [key=value ...]", RewardConfig),
]


def type_text(ann) -> str:
    """`str`, `int`, one of `'a'`, `'b'` for a Literal, `str` or `None` for an optional."""
    if typing.get_origin(ann) is typing.Literal:
        return "one of " + ", ".join(f"`{a!r}`" for a in typing.get_args(ann))
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return " or ".join(type_text(a) for a in typing.get_args(ann))
    if ann is type(None):
        return "`None`"
    return f"`{plain(ann)}`"


def plain(ann) -> str:
    """A type as written, without the constraints Annotated attaches (the description states them)."""
    origin = typing.get_origin(ann)
    if origin is typing.Annotated:
        return plain(typing.get_args(ann)[0])
    if origin is None:
        return getattr(ann, "__name__", str(ann)).replace("typing.", "")
    if origin in (typing.Union, types.UnionType):
        return " | ".join(plain(a) for a in typing.get_args(ann))
    return f"{getattr(origin, '__name__', str(origin))}[{', '.join(plain(a) for a in typing.get_args(ann))}]"


_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def bounds(field) -> str:
    """The numeric limits a field's validation enforces (`ge=1` -> ` (>= 1)`), so the table states what the
    error would; empty for a field without any."""
    found = [f"{sign} {getattr(m, name)!r}" for m in field.metadata for name, sign in _BOUNDS
             if getattr(m, name, None) is not None]
    return f" ({', '.join(found)})" if found else ""


def rows(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += rows(ann, f"{key}.")
            continue
        default = field.default
        if default is PydanticUndefined:
            default = field.default_factory() if field.default_factory else "(required)"
        desc = (field.description or "").replace("|", "\\|")
        out.append(f"| `{key}` | {type_text(ann)}{bounds(field)} | `{default!r}` | {desc} |")
        # an optional section (null by default): its keys, which apply once it is set
        out += [r for a in typing.get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)
                for r in rows(a, f"{key}.")]
    return out


def render() -> str:
    parts = ["# Configuration reference", "",
             "Generated from the config models by `python scripts/gen_config_docs.py`; do not edit by hand.",
             "Every service reads an optional YAML file (`--config FILE`) and dotted command-line overrides",
             ("(`ppo.adv_estimator.gae_gamma=0.99`, `policy.generation.stop_token_ids=[5,7]`); flags such as `--port` are shorthands for keys,\n"
             "in any order with the overrides (a flag and its own key given together are refused)."),
             ("Unknown keys and bad values stop the service at start-up with a message naming the key. A number must "
              "be finite\n(`inf` and `nan` are refused) and `true`/`false` are no numbers; a value that is not valid "
              "YAML (one starting with\n`@`, `%` or `*`, an unclosed `[`) must be quoted: `data.prompt_key='\"@x\"'`; so must "
              "one holding a `#` at its start\nor after a space, which YAML would read as a comment and cut "
              "(refused, naming what would be left)."),
             ""]
    for name, usage, model in SERVICES:
        parts += [f"## `{name}`", "", f"`{usage}`", "", "| key | type | default | meaning |", "|---|---|---|---|",
                  *rows(model), ""]
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is stale: run `python scripts/gen_config_docs.py`")
            return 1
        return 0
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
