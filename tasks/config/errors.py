"""The one error of configuration and the one "did you mean" of dagrl."""
from __future__ import annotations


class ConfigError(ValueError):
    """A config value that cannot work. The message is one line: key, value, fix."""

    def __init__(self, key: str, value, fix: str):
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"{key}={value!r}: {fix}")


def close_matches(name: str, known, *, n: int = 3, cutoff: float = 0.6) -> list[str]:
    """The names of `known` that `name` may have meant, at most `n`: those `name` is a prefix of (in `known`'s
    order) when there are any, else the `difflib` matches of ratio >= `cutoff` within 0.1 of the best one, best
    first. The one "did you mean" of dagrl: unknown config keys and `conf=`/group names (pipelines.config), env ids
    (tasks.envs), runs and metrics (pipelines.compare)."""
    import difflib
    known = [str(k) for k in known]
    prefixed = [k for k in known if name and k.startswith(name) and k != name]
    if prefixed:
        return prefixed[:n]
    scored = sorted(((difflib.SequenceMatcher(None, name, k).ratio(), -i, k) for i, k in enumerate(known)),
                    reverse=True)
    scored = [(r, k) for r, _, k in scored if r >= cutoff]
    return [k for r, k in scored if r >= scored[0][0] - 0.1][:n] if scored else []


def did_you_mean(name: str, known, **kw) -> str:
    """`"did you mean 'a'?"` / `"did you mean 'a' or 'b'?"` for the `close_matches` of `name`, or "" when none."""
    close = close_matches(name, known, **kw)
    return f"did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
