"""The embedded scheduler's JSON routes (`/json/counts.json`, `/json/identity.json`, `/json/index.html` of the
dashboard): distributed's own, with `identity.json` made serialisable.

Why: `Scheduler.identity()` carries each worker's last heartbeat metrics, and a worker that ran tasks since its
previous heartbeat reports `digests_total_since_heartbeat` keyed by tuples (`("execute", "env_step_s",
"thread-cpu", "seconds")`, distributed's fine performance metrics). distributed's handler writes the dict as it is,
so `json.dumps` raised `TypeError: keys must be str, int, float, bool or None, not tuple`: the route answered 500
and tornado printed the 20-line traceback into the training console (the embedded scheduler lives in the driver).
Here every key that JSON cannot hold is written as a string (a tuple's parts joined by "/") and any other value
JSON cannot hold as its `str`; the rest of the document is distributed's.

`pipelines.clusters.start_cluster` puts this module in place of `distributed.http.scheduler.json` in
`distributed.scheduler.http.routes` while the embedded scheduler is created (`scheduler_http_routes`).
"""
from __future__ import annotations

import json

from distributed.http.scheduler import json as _distributed_json
from distributed.http.utils import RequestHandler

REPLACES = "distributed.http.scheduler.json"  # the routes module this one stands in for


def json_key(key) -> str | int | float | bool | None:
    """A dict key JSON can hold: str, int, float, bool and None as they are; a tuple's parts (recursively) joined
    by "/" (`("execute", "x", "seconds")` -> `"execute/x/seconds"`); anything else its `str`."""
    if key is None or isinstance(key, (str, int, float, bool)):
        return key
    if isinstance(key, tuple):
        return "/".join(str(json_key(k)) for k in key)
    return str(key)


def json_safe(obj):
    """`obj` with every dict key made a JSON key (`json_key`), recursively through dicts, lists, tuples and sets
    (those become lists); other values are left for `json.dumps(..., default=str)`. Two keys that map to the
    same string keep the later value."""
    if isinstance(obj, dict):
        return {json_key(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in obj]
    return obj


def identity_json(scheduler) -> str:
    """`scheduler.identity()` as a JSON document (`json_safe`, other values that JSON cannot hold as `str`)."""
    return json.dumps(json_safe(scheduler.identity()), default=str)


class IdentityJSON(RequestHandler):
    """`/json/identity.json`: `identity_json(scheduler)`."""

    def get(self):
        self.set_header("Content-Type", "application/json; charset=UTF-8")
        self.write(identity_json(self.server))


routes: list[tuple] = [(url, IdentityJSON if url == r"json/identity.json" else handler, kwargs)
                       for url, handler, kwargs in _distributed_json.routes]
