"""What `--help` of the Hydra-style commands (`pipelines.run`, `pipelines.validate`, `pipelines.record`) lists after
the command's own text: the experiments (`conf=NAME`: conf/conf/NAME.yaml, each with the first sentence of its
header comment and the keys it leaves `???` for the command line) and the config groups (`GROUP=NAME`:
conf/GROUP/NAME.yaml; a file whose name starts with `_` is an include, not a choice) with their options. Read from
the conf tree each time (`help_text`), so it cannot drift from the files.
"""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

from pipelines.overrides import GROUPS

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # the project's Hydra tree (pipelines.families.CONF_DIR)

WIDTH = 100  # characters of a line of the listing
MISSING = "???"  # OmegaConf's mandatory value (pipelines.compose.MISSING)


def header_text(path: Path) -> str:
    """A conf file's header comment (the `#` lines at its top, `# @package ...` skipped) as one line of text."""
    words = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if not text.startswith("@package"):
            words.append(text)
    return " ".join(w for w in words if w)


def summary(path: Path, width: int = WIDTH) -> str:
    """The first sentence of a conf file's header comment (`header_text`), shortened to `width` characters at a
    word with "..."; "" when it has none."""
    text = header_text(path)
    first = re.split(r"(?<=\.)\s", text, maxsplit=1)[0]  # up to the first sentence's end
    return textwrap.shorten(first, width=width, placeholder=" ...") if first else ""


def required_keys(path: Path) -> list[str]:
    """The keys an experiment file writes as `???` (given on the command line: pipelines.compose.check_required),
    dotted, in file order (YAML's 2-space nesting; only the file's own text is read)."""
    keys, stack = [], []
    for line in path.read_text().splitlines():
        body = line.split("#", 1)[0].rstrip()
        if not body.strip() or body.lstrip().startswith("-") or ":" not in body:
            continue
        depth = (len(body) - len(body.lstrip(" "))) // 2
        key, _, value = body.strip().partition(":")
        stack = stack[:depth] + [key.strip()]
        if value.strip() == MISSING:
            keys.append(".".join(stack))
    return keys


def experiments(conf_dir: Path = CONF_DIR) -> list[tuple[str, str, list[str]]]:
    """(name, summary, required keys) of every experiment file conf/conf/NAME.yaml, sorted by name."""
    return [(p.stem, summary(p), required_keys(p)) for p in sorted((conf_dir / "conf").glob("*.yaml"))]


def groups(conf_dir: Path = CONF_DIR) -> dict[str, list[str]]:
    """{group: its options (file names without .yaml, sorted)} of every config group (pipelines.overrides.GROUPS),
    the includes (`_NAME.yaml`) left out."""
    return {g: sorted(p.stem for p in (conf_dir / g).glob("*.yaml") if not p.stem.startswith("_"))
            for g in GROUPS if (conf_dir / g).is_dir()}


def help_text(conf_dir: Path = CONF_DIR, default: str | None = None) -> str:
    """The listing `--help` prints: experiments (with `(default)` on `default`, conf/config.yaml's choice, and
    `needs KEY=...` for each key it leaves `???`), then groups and options, then where every key is described."""
    default = default or _default_experiment(conf_dir)
    exps = experiments(conf_dir)
    pad = max((len(n) for n, _, _ in exps), default=0) + 2
    lines = ["experiments (conf=NAME; conf/conf/NAME.yaml):"]
    for name, text, required in exps:
        tags = (["default"] if name == default else []) + [f"needs {k}=..." for k in required]
        head = f"  {name:<{pad}}" + (f"({', '.join(tags)}) " if tags else "")
        lines.append(head + textwrap.shorten(text, width=max(30, WIDTH - len(head)), placeholder=" ...")
                     if text else head.rstrip())
    lines.append("groups (GROUP=NAME picks conf/GROUP/NAME.yaml; an experiment chooses its own):")
    gpad = max((len(g) for g in groups(conf_dir)), default=0) + 2
    for g, options in groups(conf_dir).items():
        lines += textwrap.wrap(", ".join(options), width=WIDTH, initial_indent=f"  {g:<{gpad}}",
                               subsequent_indent=" " * (gpad + 2))
    lines.append("any key: KEY=VALUE (e.g. runner.max_steps=3); the resolved config of a choice: --show; every key "
                 "with its meaning: docs/reference/config.md")
    return "\n".join(lines)


def _default_experiment(conf_dir: Path) -> str | None:
    """conf/config.yaml's `- conf: NAME` (the experiment a command runs without `conf=`)."""
    found = re.search(r"^\s*-\s*conf:\s*(\S+)", (conf_dir / "config.yaml").read_text(), re.M)
    return found.group(1) if found else None
