"""The hf export of a policy (`save_pretrained` layout, the directory `policy.model_path` takes), written
atomically with its file index."""
from __future__ import annotations

import torch


def write_export(policy: torch.nn.Module, final: str, env_meta: dict | None = None) -> str:
    """Write `policy` in the `save_pretrained` layout to the directory `final` (the one `policy.model_path` takes):
    to a sibling tmp dir first, then renamed over `final`. `env_meta` (simulator, env_id, control_mode,
    gripper_convention: pipelines.graphs.export_env_meta) is added to its config.json as `env`;
    `dagrl_files.json` (storage.exports.index_export, written last) lists every file's size and sha256, so a
    damaged copy is refused offline (pipelines.config.check_model_path). Returns `final`."""
    import json
    import os
    import shutil
    from storage.exports import index_export
    final = os.fspath(final)
    tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp)
    if env_meta:
        conf = os.path.join(tmp, "config.json")
        meta = json.loads(open(conf).read())
        meta["env"] = dict(env_meta)
        with open(conf, "w") as f:
            f.write(json.dumps(meta, indent=2, sort_keys=True))
    index_export(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final
