"""LeRobot datasets, format v3.0: reading one (what `sft.store` takes) and writing one (`pipelines.export`).

The format (LeRobot's `codebase_version` "v3.0", public: the `lerobot` repository's `datasets/lerobot_dataset.py`
and `datasets/utils.py` define it; tests/fixtures/lerobot_tiny/ is a dataset written by the library itself)::

    DIR/meta/info.json         codebase_version, fps, robot_type, total_episodes, total_frames, total_tasks,
                               chunks_size, data_files_size_in_mb, video_files_size_in_mb, splits, data_path and
                               video_path (templates with {chunk_index}, {file_index}, {video_key}), features
                               ({key: {dtype, shape, names[, info]}}; camera streams have dtype "video")
    DIR/meta/stats.json        {feature: {min, max, mean, std, count, q01, q10, q50, q90, q99}} over all frames
                               (images: per channel, in [0, 1], shape [3, 1, 1])
    DIR/meta/tasks.parquet     one row per task: the task string (the frame's index) and task_index
    DIR/meta/episodes/chunk-CCC/file-FFF.parquet
                               one row per episode: episode_index, tasks (list of strings), length,
                               data/chunk_index, data/file_index, dataset_from_index, dataset_to_index (global frame
                               `index` range, end exclusive), per camera videos/<key>/chunk_index, file_index,
                               from_timestamp, to_timestamp (seconds into that mp4), meta/episodes/chunk_index,
                               meta/episodes/file_index
    DIR/data/chunk-CCC/file-FFF.parquet
                               one row per frame: the non-video features (observation.state, action as fixed-size
                               float32 lists, ...) and timestamp (s, float32), frame_index, episode_index, index,
                               task_index (int64)
    DIR/videos/<camera key>/chunk-CCC/file-FFF.mp4
                               each camera's frames, several episodes one after another in one file

Frame f of an episode is at `from_timestamp + f / fps` in its video file; a file starts at time 0 and has a constant
frame rate `fps`, so that is decoded frame `round(from_timestamp * fps) + f`.

Videos are decoded and encoded with the ffmpeg binary of `imageio-ffmpeg` (rgb24 frames). Written videos are H.264
(libx264, yuv420p, CRF `VIDEO_CRF`, a key frame every 2 frames as LeRobot's writer does): 4:2:0 chroma subsampling
and the CRF make decoded pixels differ from the written ones (tests/storage/test_lerobot_roundtrip.py measures it).

Everything that is not the format (which features a policy needs, the instruction table) is the callers' business
(`tasks.demo_datasets`). Errors in a dataset are `LeRobotFormatError`: one line naming the file, the field and what
was expected.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CODEBASE_VERSION = "v3.0"
INFO = "meta/info.json"
STATS = "meta/stats.json"
TASKS = "meta/tasks.parquet"
EPISODES = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
STATE, ACTION = "observation.state", "action"
REWARD, DONE, SUCCESS = "next.reward", "next.done", "next.success"  # optional per-frame features LeRobot names so
INDEX_FEATURES = {"timestamp": "float32", "frame_index": "int64", "episode_index": "int64", "index": "int64",
                  "task_index": "int64"}
CHUNKS_SIZE = 1000  # LeRobot's defaults, written to info.json (one data file and one video file per camera here)
DATA_FILES_MB, VIDEO_FILES_MB = 100, 200
VIDEO_CRF = 18  # libx264 quality (0 lossless .. 51): 18 is visually lossless
QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)


class LeRobotFormatError(ValueError):
    """A directory that is not a readable LeRobot v3.0 dataset; the message names the file, the field and the fix."""


def is_dataset(path) -> bool:
    """Whether `path` is a LeRobot dataset directory (it has meta/info.json)."""
    return path is not None and (Path(path) / INFO).is_file()


def _fail(path: Path, what: str) -> LeRobotFormatError:
    return LeRobotFormatError(f"LeRobot dataset {path}: {what}")


@dataclass(frozen=True)
class Episode:
    """One episode row of meta/episodes: `index` (episode_index), `length` (frames), `tasks` (its task strings),
    `start`/`stop` (its global frame `index` range, stop exclusive), `data_file` (chunk, file), `videos`
    {camera key: (chunk, file, from_timestamp s)}."""

    index: int
    length: int
    tasks: tuple[str, ...]
    start: int
    stop: int
    data_file: tuple[int, int]
    videos: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Dataset:
    """An opened, checked LeRobot v3.0 dataset (`open_dataset`): `info` (meta/info.json), `tasks` {task_index:
    string}, `episodes` (in episode_index order)."""

    path: Path
    info: dict
    tasks: dict
    episodes: tuple

    @property
    def fps(self) -> float:
        return float(self.info["fps"])

    @property
    def features(self) -> dict:
        return self.info["features"]

    @property
    def cameras(self) -> list[str]:
        """The camera keys (features of dtype video), in info.json's order."""
        return [k for k, f in self.features.items() if f.get("dtype") == "video"]

    def shape(self, key: str) -> tuple[int, ...]:
        """The per-frame shape info.json declares for feature `key`."""
        return tuple(int(n) for n in self.features[key]["shape"])

    def frames(self, keys: Iterable[str]) -> dict[str, np.ndarray]:
        """The non-video features `keys` (plus `index`) of every frame, in global `index` order: [F, *shape] with
        the declared dtype (a shape [1] feature as [F]). Raises LeRobotFormatError for a missing data file or
        column, or frames that do not match the episodes' index ranges."""
        import pyarrow.parquet as pq
        keys = list(dict.fromkeys([*keys, "index"]))
        tables = []
        for chunk, file in sorted({e.data_file for e in self.episodes}):
            rel = self.info["data_path"].format(chunk_index=chunk, file_index=file)
            p = self.path / rel
            if not p.is_file():
                raise _fail(self.path, f"{rel} is missing (meta/episodes lists it); copy the dataset whole")
            names = pq.read_schema(p).names
            missing = [k for k in keys if k not in names]
            if missing:
                raise _fail(self.path, f"{rel} has no column {missing[0]!r} (info.json's features list it)")
            tables.append(pq.read_table(p, columns=keys))
        out = {}
        for k in keys:
            cols = [np.asarray(t.column(k).combine_chunks().flatten() if _is_list(t.column(k)) else t.column(k))
                    for t in tables]
            arr = np.concatenate(cols) if cols else np.zeros(0)
            shape = self.shape(k) if k in self.features else (1,)
            n = sum(t.num_rows for t in tables)
            try:
                arr = arr.reshape(n, *shape)
            except ValueError:
                raise _fail(self.path, f"column {k!r} of data/ does not hold {list(shape)} values per frame as "
                                       f"info.json's features[{k!r}].shape says") from None
            out[k] = arr[:, 0] if shape == (1,) else arr
        order = np.argsort(out["index"], kind="stable")
        out = {k: v[order] for k, v in out.items()}
        want = np.concatenate([np.arange(e.start, e.stop) for e in self.episodes]) if self.episodes else []
        if not np.array_equal(np.sort(out["index"]), np.sort(np.asarray(want, np.int64))):
            raise _fail(self.path, f"data/ holds {len(out['index'])} frames whose `index` values differ from the "
                                   f"ranges meta/episodes gives (dataset_from_index..dataset_to_index); the dataset "
                                   f"is incomplete or mixed")
        return out

    def video(self, key: str, episode: Episode, size: int | None = None) -> np.ndarray:
        """uint8 [length, H, W, 3] camera `key`'s frames of `episode` (decoded rgb24; `size`: scaled to size x size
        by ffmpeg's area filter, else the stored size). ffmpeg seeks to half a frame before the episode's
        from_timestamp (its accurate seek drops the frames before) and decodes `length` frames. Raises
        LeRobotFormatError for a missing, undecodable or short video."""
        chunk, file, t0 = episode.videos[key]
        rel = self.info["video_path"].format(video_key=key, chunk_index=chunk, file_index=file)
        frames = decode_video(self.path / rel, size, start=max(0.0, t0 - 0.5 / self.fps), count=episode.length,
                              label=f"LeRobot dataset {self.path}: {rel}")
        if len(frames) != episode.length:
            raise _fail(self.path, f"{rel} holds {len(frames)} frames from {t0} s; episode {episode.index} has "
                                   f"{episode.length} (meta/episodes' videos/{key}/from_timestamp at {self.fps} fps)")
        return frames


def _is_list(col) -> bool:
    import pyarrow as pa
    return pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type) or pa.types.is_large_list(col.type)


def open_dataset(path) -> Dataset:
    """Open and check the LeRobot dataset at `path` (its metadata; frames and videos are read on demand).

    Raises LeRobotFormatError (one line naming the file and field) for: no meta/info.json, unreadable JSON, another
    codebase_version than v3.0, a missing info.json key, a feature without dtype or shape, images stored in parquet
    (dtype image), no meta/tasks.parquet or meta/episodes/, an episode row without the columns above, episode counts
    that disagree with info.json."""
    import pandas as pd
    path = Path(path)
    if not (path / INFO).is_file():
        raise _fail(path, f"no {INFO} (not a LeRobot dataset directory)")
    try:
        info = json.loads((path / INFO).read_text())
    except (OSError, ValueError) as exc:
        raise _fail(path, f"{INFO} is not readable JSON ({exc})") from None
    version = info.get("codebase_version")
    if version != CODEBASE_VERSION:
        raise _fail(path, f"{INFO} has codebase_version={version!r}; dagrl reads {CODEBASE_VERSION} (convert older "
                          f"datasets with LeRobot's `lerobot.datasets.v30.convert_dataset_v21_to_v30`)")
    for k in ("fps", "features", "data_path", "total_episodes", "total_frames"):
        if k not in info:
            raise _fail(path, f"{INFO} has no {k!r}")
    for k, f in info["features"].items():
        if not isinstance(f, dict) or "dtype" not in f or "shape" not in f:
            raise _fail(path, f"{INFO} features[{k!r}] has no dtype or shape")
        if f["dtype"] == "image":
            raise _fail(path, f"{INFO} features[{k!r}] is stored as images in parquet (dtype image); dagrl reads "
                              f"camera streams stored as video (dtype video): re-encode with LeRobot")
    cameras = [k for k, f in info["features"].items() if f["dtype"] == "video"]
    if cameras and "video_path" not in info:
        raise _fail(path, f"{INFO} has video features {cameras} but no 'video_path'")
    if not (path / TASKS).is_file():
        raise _fail(path, f"no {TASKS}")
    try:
        t = pd.read_parquet(path / TASKS)
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors of a damaged file: one line
        raise _fail(path, f"{TASKS} is not readable parquet ({type(exc).__name__})") from None
    if "task_index" not in t.columns:
        raise _fail(path, f"{TASKS} has no task_index column")
    names = t["task"] if "task" in t.columns else t.index
    tasks = {int(i): str(s) for i, s in zip(t["task_index"], names)}
    files = sorted((path / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
    if not files:
        raise _fail(path, "no meta/episodes/chunk-*/file-*.parquet")
    need = ["episode_index", "length", "dataset_from_index", "dataset_to_index", "data/chunk_index",
            "data/file_index", *(f"videos/{k}/{c}" for k in cameras for c in ("chunk_index", "file_index",
                                                                                 "from_timestamp"))]
    rows = []
    for p in files:
        import pyarrow.parquet as pq
        have = pq.read_schema(p).names
        missing = [c for c in need if c not in have]
        if missing:
            raise _fail(path, f"{p.relative_to(path)} has no column {missing[0]!r}")
        cols = need + (["tasks"] if "tasks" in have else [])
        rows += pd.read_parquet(p, columns=cols).to_dict("records")
    episodes = []
    for r in sorted(rows, key=lambda r: int(r["episode_index"])):
        episodes.append(Episode(
            index=int(r["episode_index"]), length=int(r["length"]),
            tasks=tuple(str(s) for s in (r.get("tasks") if r.get("tasks") is not None else ())),
            start=int(r["dataset_from_index"]), stop=int(r["dataset_to_index"]),
            data_file=(int(r["data/chunk_index"]), int(r["data/file_index"])),
            videos={k: (int(r[f"videos/{k}/chunk_index"]), int(r[f"videos/{k}/file_index"]),
                        float(r[f"videos/{k}/from_timestamp"])) for k in cameras}))
        if episodes[-1].stop - episodes[-1].start != episodes[-1].length:
            raise _fail(path, f"meta/episodes: episode {episodes[-1].index} has length {episodes[-1].length} but "
                              f"frames {episodes[-1].start}..{episodes[-1].stop} (dataset_from/to_index)")
    if len(episodes) != int(info["total_episodes"]):
        raise _fail(path, f"meta/episodes lists {len(episodes)} episodes, {INFO} total_episodes="
                          f"{info['total_episodes']}; the dataset is incomplete")
    return Dataset(path=path, info=info, tasks=tasks, episodes=tuple(episodes))


# ---- video --------------------------------------------------------------------------------------------------------
def decode_video(path: Path, size: int | None = None, *, start: float = 0.0, count: int | None = None,
                 label: str | None = None) -> np.ndarray:
    """uint8 [N, H, W, 3] the frames of the video at `path` as rgb24 (ffmpeg of imageio-ffmpeg): from `start`
    seconds (accurate seek), at most `count` frames (None: to the end); `size`: scaled to size x size with ffmpeg's
    area filter. Raises LeRobotFormatError (`label`: the file's name in the message) for a missing or undecodable
    file."""
    import imageio_ffmpeg
    label = label or str(path)
    if not Path(path).is_file():
        raise LeRobotFormatError(f"{label} is missing; copy the dataset whole")
    out = (["-vf", f"scale={size}:{size}:flags=area"] if size else []) + \
        (["-frames:v", str(int(count))] if count is not None else [])
    import logging
    log = logging.getLogger("imageio_ffmpeg")  # its warning that the scaled size is not the source's: intended
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        gen = imageio_ffmpeg.read_frames(str(path), pix_fmt="rgb24", output_params=out or None,
                                         input_params=["-ss", f"{start:.6f}"] if start > 0 else None)
        meta = next(gen)
        w, h = (size, size) if size else meta["size"]
        frames = [np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in gen]
    except (RuntimeError, OSError, StopIteration) as exc:
        raise LeRobotFormatError(f"{label} cannot be decoded ({' '.join(str(exc).split())[:160]})") from None
    finally:
        log.setLevel(level)
    return np.stack(frames) if frames else np.zeros((0, h, w, 3), np.uint8)


def encode_video(path: Path, frames: np.ndarray, fps: float) -> dict:
    """Write uint8 [N, H, W, 3] `frames` (H, W even) to an H.264 mp4 at `path` (libx264, yuv420p, CRF VIDEO_CRF,
    a key frame every 2 frames). Returns info.json's `info` entry of the video feature."""
    import imageio_ffmpeg
    n, h, w, _ = frames.shape
    writer = imageio_ffmpeg.write_frames(str(path), (w, h), fps=fps, codec="libx264", pix_fmt_in="rgb24",
                                         pix_fmt_out="yuv420p", macro_block_size=1, ffmpeg_log_level="error",
                                         output_params=["-crf", str(VIDEO_CRF), "-g", "2"])
    writer.send(None)
    for f in frames:
        writer.send(np.ascontiguousarray(f))
    writer.close()
    return {"video.height": h, "video.width": w, "video.codec": "h264", "video.pix_fmt": "yuv420p",
            "video.is_depth_map": False, "video.fps": fps, "video.channels": 3, "has_audio": False}


# ---- writing ------------------------------------------------------------------------------------------------------
def _stats(x: np.ndarray, image: bool = False) -> dict:
    """meta/stats.json's entry of one feature over frames x [F, ...]: min, max, mean, std, q01..q99 per dimension
    and count [F] (images [F, H, W, 3] uint8: per channel in [0, 1], shaped [3, 1, 1] as LeRobot keeps them)."""
    n = len(x)
    x = x.reshape(-1, 3) / 255.0 if image else x.astype(np.float64).reshape(n, -1)
    q = np.quantile(x, QUANTILES, axis=0)
    s = {"min": x.min(0), "max": x.max(0), "mean": x.mean(0), "std": x.std(0)}
    s.update({f"q{int(round(p * 100)):02d}": v for p, v in zip(QUANTILES, q)})
    shape = (3, 1, 1) if image else (-1,)
    out = {k: np.asarray(v, np.float64).reshape(shape).tolist() for k, v in s.items()}
    out["count"] = [int(n)]
    return out


def write_dataset(out, episodes: Iterable[Mapping], *, fps: float, robot_type: str | None = None,
                  state_names: list[str] | None = None, action_names: list[str] | None = None,
                  extra_meta: Mapping | None = None) -> dict:
    """Write `episodes` as a LeRobot v3.0 dataset at `out` (created; it must not exist): one data file, one episodes
    file and one video file per camera, every episode in them one after another.

    Each episode: {"state": float32 [L, O], "action": float32 [L, D], "images": {camera key: uint8 [L, H, W, 3]}
    (the same keys in every episode; H, W even), "task": str, and optionally "reward" float32 [L], "done" bool [L],
    "success" bool [L] (written as next.reward / next.done / next.success)}. `extra_meta`: written to
    meta/dagrl.json (LeRobot reads only its own files). Written under `<out>.partial` and renamed when complete.

    Returns info.json's content. Raises FileExistsError when `out` exists, ValueError for inconsistent episodes."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new output directory (a dataset is never overwritten)")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    eps = list(episodes)
    if not eps:
        raise ValueError("no episode to write")
    cams = list(eps[0]["images"])
    optional = [(k, name, dt) for k, name, dt in (("reward", REWARD, "float32"), ("done", DONE, "bool"),
                                                  ("success", SUCCESS, "bool")) if k in eps[0]]
    task_ids: dict[str, int] = {}
    cols: dict[str, list] = {k: [] for k in (STATE, ACTION, *INDEX_FEATURES, *(n for _, n, _ in optional))}
    rows, start, images = [], 0, {c: [] for c in cams}
    for e, ep in enumerate(eps):
        L = len(ep["action"])
        if len(ep["state"]) != L or any(len(ep["images"][c]) != L for c in cams) or set(ep["images"]) != set(cams):
            raise ValueError(f"episode {e}: state, action and images of every camera need one row per frame")
        tid = task_ids.setdefault(ep["task"], len(task_ids))
        cols[STATE].append(np.asarray(ep["state"], np.float32))
        cols[ACTION].append(np.asarray(ep["action"], np.float32))
        cols["timestamp"].append((np.arange(L) / fps).astype(np.float32))
        cols["frame_index"].append(np.arange(L, dtype=np.int64))
        cols["episode_index"].append(np.full(L, e, np.int64))
        cols["index"].append(np.arange(start, start + L, dtype=np.int64))
        cols["task_index"].append(np.full(L, tid, np.int64))
        for k, name, dt in optional:
            cols[name].append(np.asarray(ep[k], dt).reshape(L))
        row = {"episode_index": e, "tasks": [ep["task"]], "length": L, "data/chunk_index": 0, "data/file_index": 0,
               "dataset_from_index": start, "dataset_to_index": start + L}
        for c in cams:
            row.update({f"videos/{c}/chunk_index": 0, f"videos/{c}/file_index": 0,
                        f"videos/{c}/from_timestamp": start / fps, f"videos/{c}/to_timestamp": (start + L) / fps})
            images[c].append(np.asarray(ep["images"][c], np.uint8))
        row.update({"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0})
        rows.append(row)
        start += L
    data = {k: np.concatenate(v) for k, v in cols.items()}
    O, D = data[STATE].shape[1], data[ACTION].shape[1]
    features = {STATE: {"dtype": "float32", "shape": [O], "names": state_names or [f"state_{i}" for i in range(O)]},
                ACTION: {"dtype": "float32", "shape": [D], "names": action_names or [f"action_{i}" for i in range(D)]}}
    stats = {STATE: _stats(data[STATE]), ACTION: _stats(data[ACTION])}
    (tmp / "meta" / "episodes" / "chunk-000").mkdir(parents=True)
    (tmp / "data" / "chunk-000").mkdir(parents=True)
    for c in cams:
        frames = np.concatenate(images[c])
        (tmp / "videos" / c / "chunk-000").mkdir(parents=True)
        vinfo = encode_video(tmp / VIDEO_PATH.format(video_key=c, chunk_index=0, file_index=0), frames, fps)
        features[c] = {"dtype": "video", "shape": list(frames.shape[1:]), "names": ["height", "width", "channels"],
                       "info": vinfo}
        stats[c] = _stats(frames, image=True)
    for _, name, dt in optional:
        features[name] = {"dtype": dt, "shape": [1], "names": None}
        stats[name] = _stats(data[name][:, None])
    for k, dt in INDEX_FEATURES.items():
        features[k] = {"dtype": dt, "shape": [1], "names": None}
        stats[k] = _stats(data[k][:, None])
    arrays = {}
    for k, v in data.items():
        if v.ndim == 2:  # [F, O] -> fixed_size_list<float>[O]
            arrays[k] = pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), v.shape[1])
        else:
            arrays[k] = pa.array(v)
    pq.write_table(pa.table(arrays), tmp / DATA_PATH.format(chunk_index=0, file_index=0))
    pd.DataFrame(rows).to_parquet(tmp / EPISODES.format(chunk_index=0, file_index=0), index=False)
    pd.DataFrame({"task_index": list(task_ids.values())}, index=pd.Index(list(task_ids))).to_parquet(tmp / TASKS)
    info = {"codebase_version": CODEBASE_VERSION, "robot_type": robot_type, "total_episodes": len(eps),
            "total_frames": int(start), "total_tasks": len(task_ids), "chunks_size": CHUNKS_SIZE,
            "data_files_size_in_mb": DATA_FILES_MB, "video_files_size_in_mb": VIDEO_FILES_MB, "fps": fps,
            "splits": {"train": f"0:{len(eps)}"}, "data_path": DATA_PATH,
            "video_path": VIDEO_PATH if cams else None, "features": features}
    (tmp / INFO).write_text(json.dumps(info, indent=4))
    (tmp / STATS).write_text(json.dumps(stats, indent=4))
    if extra_meta:
        (tmp / "meta" / "dagrl.json").write_text(json.dumps(dict(extra_meta), indent=2, default=str))
    tmp.rename(out)
    return info


def dataset_digest(path) -> str:
    """A fingerprint of the dataset at `path` without reading frames: sha256 over meta/info.json, meta/tasks.parquet,
    the episodes files, and the name and size of every data and video file (hex, 16 digits)."""
    import hashlib
    path = Path(path)
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file() and not q.name.startswith(".")):
        rel = p.relative_to(path).as_posix()
        h.update(rel.encode())
        if rel.startswith("meta/"):
            h.update(p.read_bytes())
        else:
            h.update(str(p.stat().st_size).encode())
    return h.hexdigest()[:16]
