"""Lighter robot visual meshes for CPU rendering (`env.robot_visual_lod`): a cached copy of a ManiSkill robot's URDF
whose visual meshes are decimated, its collision meshes untouched.

Why: on a CPU (Mesa lavapipe) a camera capture costs about the same at 32 px as at 64 px because the cost is the
vertex work, not the pixels: PushCube-v1's scene has ~157k visual triangles, ~136k of them on the Panda arm, and
hiding the arm drops one 32 px capture from ~60 to ~6 ms of CPU (a one-off check here with the arm's render bodies
hidden; `benchmarks/render.py` measures the decimated copies). The VLA
recipe captures one image per chunk step per env, which makes rendering the largest part of its rollout.

What changes: only what the cameras see. The URDF's <collision> elements point at the original collision meshes
(symlinks), inertias and joints are copied byte for byte, so the dynamics are those of the original robot: the same
(seed, actions) give bit-identical states (tested). The images differ at the arm's silhouette by a pixel or so
(measured in tests/tasks/test_mesh_lod.py); a policy trained on images of one LOD is evaluated on the other at its
own risk, which is why `robot_visual_lod` is recorded with every store's and run's config.

Decimation: quadric edge collapse (trimesh's `simplify_quadric_decimation`, backed by the `fast-simplification`
package) of every visual sub-mesh to `fraction` of its faces (at least 12), after merging duplicated vertices (the
glTF files split vertices per face corner; decimating them unmerged tears the mesh apart). The PBR material of each
sub-mesh is kept. The build is deterministic (same input files and library versions -> the same bytes) and cached
under `$DAGRL_CACHE` (default `~/.cache/dagrl`)/robot_lod/<key>, the key hashing the source files, the fraction and
the library versions; a build is written to a temporary directory and renamed into place, so concurrent env
workers never see a half-written copy.

Imports of mani_skill/trimesh happen inside functions.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path

FORMAT = 1  # bump when the build's output changes for the same inputs
MIN_FACES = 12
_PATCH_LOCK = threading.Lock()  # the agent-class patch of `robot_lod` is process-wide
_BUILT: dict[tuple[str, float, str], Path] = {}  # (source URDF, fraction, cache root) -> copy: one key hash per process


def cache_root() -> Path:
    """`$DAGRL_CACHE` or `~/.cache/dagrl`."""
    return Path(os.environ.get("DAGRL_CACHE") or Path.home() / ".cache" / "dagrl")


def _mesh_refs(urdf_text: str, kind: str) -> list[str]:
    """Mesh filenames referenced inside the URDF's <visual> (kind='visual') or <collision> elements."""
    out = []
    for block in re.findall(rf"<{kind}\b.*?</{kind}>", urdf_text, flags=re.S):
        out += re.findall(r'<mesh\s+filename="([^"]+)"', block)
    return out


def _key(urdf: Path, visual: list[str], fraction: float) -> str:
    import fast_simplification
    import trimesh
    h = hashlib.sha1(f"{FORMAT}|{fraction!r}|{trimesh.__version__}|{fast_simplification.__version__}".encode())
    h.update(urdf.read_bytes())
    for rel in sorted(set(visual)):
        h.update(rel.encode())
        h.update((urdf.parent / rel).read_bytes())
    return h.hexdigest()[:16]


def decimate_file(src: Path, dst: Path, fraction: float) -> tuple[int, int]:
    """Write a decimated copy of the mesh file `src` (any format trimesh reads; glTF scenes keep their node
    transforms and PBR materials) to `dst` (format from its suffix). Returns (faces before, faces after)."""
    import trimesh
    loaded = trimesh.load(str(src))
    scene = loaded if isinstance(loaded, trimesh.Scene) else trimesh.Scene(loaded)
    out = trimesh.Scene()
    before = after = 0
    for i, node in enumerate(scene.graph.nodes_geometry):  # trimesh names unnamed glTF nodes randomly at load
        transform, gname = scene.graph[node]
        g = scene.geometry[gname].copy()
        g.merge_vertices(merge_tex=True, merge_norm=True)
        n = max(int(len(g.faces) * fraction), MIN_FACES)
        d = g.simplify_quadric_decimation(face_count=n) if n < len(g.faces) else g
        if hasattr(g.visual, "material"):
            d.visual = trimesh.visual.TextureVisuals(material=g.visual.material)
        before, after = before + len(g.faces), after + len(d.faces)
        out.add_geometry(d, node_name=f"{src.stem}_{i}", geom_name=gname, transform=transform)
    out.export(str(dst))
    return before, after


def decimated_urdf(urdf_path: str | os.PathLike, fraction: float, root: Path | None = None) -> Path:
    """The path of a URDF equal to `urdf_path` except that its visual meshes keep `fraction` of their faces
    (built once, then read from the cache; module docstring). The copy mirrors the source directory: the URDF (and
    SRDF) files are copied, collision meshes and every other file are symlinks to the originals, visual meshes are
    decimated files.

    Raises:
        ValueError: fraction outside (0, 1].
        FileNotFoundError: the URDF or one of its meshes is missing.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    urdf = Path(urdf_path).resolve()
    memo = (str(urdf), float(fraction), str(root or cache_root()))
    if memo in _BUILT and _BUILT[memo].is_file():  # every env instance of a shard asks: hash the sources once
        return _BUILT[memo]
    _BUILT[memo] = _build(urdf, fraction, root)
    return _BUILT[memo]


def _build(urdf: Path, fraction: float, root: Path | None) -> Path:
    """`decimated_urdf` without the per-process memo: the cached copy for the sources' key, built if missing."""
    text = urdf.read_text()
    visual = _mesh_refs(text, "visual")
    for rel in visual + _mesh_refs(text, "collision"):
        if not (urdf.parent / rel).is_file():
            raise FileNotFoundError(f"{urdf}: mesh {rel} is missing")
    dst = (root or cache_root()) / "robot_lod" / f"{urdf.stem}-{_key(urdf, visual, fraction)}"
    if (dst / urdf.name).is_file():
        return dst / urdf.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dst.name + ".tmp-", dir=dst.parent))
    try:
        src_dir = urdf.parent
        vis = {os.path.normpath(v) for v in visual}
        for dirpath, _, files in os.walk(src_dir):
            for f in files:
                rel = os.path.relpath(os.path.join(dirpath, f), src_dir)
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                if rel in vis:
                    decimate_file(src_dir / rel, tmp / rel, fraction)
                elif f.endswith((".urdf", ".srdf")):
                    shutil.copyfile(src_dir / rel, tmp / rel)
                else:
                    os.symlink(src_dir / rel, tmp / rel)
        try:
            os.rename(tmp, dst)
        except OSError:  # another process renamed its (identical) build first
            if not (dst / urdf.name).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dst / urdf.name


def robot_agent_class(env_id: str):
    """The ManiSkill agent class an env task builds by default (its `robot_uids` default, e.g. PushCube-v1 ->
    Panda), or None when it has none or several."""
    import inspect

    import mani_skill.envs  # noqa: F401
    from mani_skill.agents.registration import REGISTERED_AGENTS
    from mani_skill.utils.registration import REGISTERED_ENVS
    cls = REGISTERED_ENVS[env_id].cls
    uid = inspect.signature(cls.__init__).parameters.get("robot_uids")
    uid = None if uid is None else uid.default
    if not isinstance(uid, str) or uid not in REGISTERED_AGENTS:
        return None
    return REGISTERED_AGENTS[uid].agent_cls


def robot_urdf(env_id: str) -> str | None:
    """The URDF path of the env task's default robot (`robot_agent_class`), None when it has none (nothing to
    decimate)."""
    agent = robot_agent_class(env_id)
    if agent is None or not getattr(agent, "urdf_path", None):
        return None
    from mani_skill import format_path
    return format_path(str(agent.urdf_path))


@contextlib.contextmanager
def robot_lod(env_id: str, fraction: float):
    """While active, the env task's robot loads the decimated visual meshes of `decimated_urdf` (the agent class's
    `urdf_path` is swapped and restored; a process-wide lock serialises it). Wrap the env's construction in it:
    ManiSkill loads the robot when it (re)configures the scene, which the adapters do only at construction
    (`reconfiguration_freq` 0). fraction 1.0: no change.

    Raises:
        ValueError: the env task's robot has no URDF to decimate (use fraction 1.0).
    """
    if fraction >= 1.0:
        yield
        return
    source = robot_urdf(env_id)
    if source is None:
        raise ValueError(f"{env_id}'s robot has no URDF whose visual meshes could be decimated")
    agent = robot_agent_class(env_id)
    path = str(decimated_urdf(source, fraction))
    with _PATCH_LOCK:
        had = "urdf_path" in agent.__dict__
        old = agent.__dict__.get("urdf_path")
        agent.urdf_path = path
        try:
            yield
        finally:
            if had:
                agent.urdf_path = old
            else:
                del agent.urdf_path
