"""Image classification data: digits, image folders, `datasets` saved to disk.

Every image is turned into `pixel_values` by the model's own image processor, configured for
the training image size (`model.configure_processor`), so training sees exactly what
inference with the saved processor will see.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset

from accelab.train.config import TrainConfig
from accelab.train.data_spec import EVAL_SPLITS, TrainData

log = logging.getLogger(__name__)

ENCODE_CHUNK = 256  # images per processor call when encoding a whole split up front
SHOWN_SKIPS = 5  # unreadable files named in the warning


class PixelDataset(Dataset):
    """Pre-encoded images held in memory. pixels: [N, C, H, W] float32; labels: [N] int64."""

    def __init__(self, pixels: torch.Tensor, labels: torch.Tensor):
        assert len(pixels) == len(labels)
        self.pixels, self.labels = pixels, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.pixels[index], "labels": self.labels[index]}


class LazyImageDataset(Dataset):
    """Images decoded and encoded when read (large folders do not fit in memory encoded)."""

    def __init__(self, loaders: Sequence[Callable[[], Image.Image]], labels: Sequence[int], processor: Any):
        self.loaders, self.labels, self.processor = list(loaders), list(labels), processor

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        pixels = encode(self.processor, [self.loaders[index]()])[0]
        return {"pixel_values": pixels, "labels": torch.tensor(self.labels[index])}


def encode(processor: Any, images: Sequence[Image.Image]) -> torch.Tensor:
    """[N, C, H, W] float32 pixel values, in chunks (one processor call per chunk)."""
    chunks = [
        processor(images=list(images[i : i + ENCODE_CHUNK]), return_tensors="pt")["pixel_values"]
        for i in range(0, len(images), ENCODE_CHUNK)
    ]
    return torch.cat(chunks).float()


# digits ------------------------------------------------------------------------------------
def build_digits(config: TrainConfig, processor: Any, image_size: int | None) -> TrainData:
    from accelab.catalog import inputs

    size = image_size or 32
    splits = {}
    for split in ("train", "test"):
        images, labels = inputs.digits(split, image_size=size)
        splits[split] = PixelDataset(encode(processor, images), torch.tensor(labels, dtype=torch.long))
    return TrainData(
        train=splits["train"],
        eval=splits["test"],
        class_names=[str(i) for i in range(10)],
        eval_split="digits test split",
        meta={"dataset": "digits", "image_size": size},
    )


# image folders -----------------------------------------------------------------------------
def _split_dirs(root: Path) -> tuple[Path, Path | None]:
    """(train dir, eval dir or None): `root/train` + `root/test|val...` when present, else root."""
    train = root / "train"
    if train.is_dir():
        for name in EVAL_SPLITS:
            if (root / name).is_dir():
                return train, root / name
    return root, None


def _subdirs(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


def folder_classes(root: Path) -> list[str]:
    train, _ = _split_dirs(root)
    names = [p.name for p in _subdirs(train)]
    if not names:
        raise ValueError(
            f"image folder {train} has no class subfolders; lay it out as {train}/<class name>/<image file> "
            "(one subfolder per class), or pass --dataset digits"
        )
    if len(names) < 2:
        raise ValueError(f"image folder {train} has one class ({names[0]}); a classifier needs 2 or more subfolders")
    return names


def _readable(path: Path) -> str | None:
    """None when the file decodes as an image, else why not."""
    try:
        with Image.open(path) as image:
            image.convert("RGB")
        return None
    except Exception as err:  # noqa: BLE001 - PIL raises many types (UnidentifiedImageError, OSError, ...)
        return f"{type(err).__name__}: {err}"


def _load_file(path: Path) -> Callable[[], Image.Image]:
    def load() -> Image.Image:
        with Image.open(path) as image:
            return image.convert("RGB")

    return load


def _scan_folder(directory: Path, classes: list[str], skipped: list[str]) -> tuple[list[Path], list[int]]:
    files, labels = [], []
    for label, name in enumerate(classes):
        class_dir = directory / name
        if not class_dir.is_dir():
            raise ValueError(
                f"{directory} has no subfolder {name!r}, but the training split has that class; "
                "give both splits the same class subfolders"
            )
        for path in sorted(p for p in class_dir.rglob("*") if p.is_file() and not p.name.startswith(".")):
            why = _readable(path)
            if why is None:
                files.append(path)
                labels.append(label)
            else:
                skipped.append(f"{path.relative_to(directory)} ({why})")
    return files, labels


def build_folder(config: TrainConfig, processor: Any, image_size: int | None) -> TrainData:
    root = Path(config.dataset)
    train_dir, eval_dir = _split_dirs(root)
    classes = folder_classes(root)
    skipped: list[str] = []
    files, labels = _scan_folder(train_dir, classes, skipped)
    _check_every_class(labels, classes, train_dir)
    if eval_dir is not None:
        eval_files, eval_labels = _scan_folder(eval_dir, classes, skipped)
        train_idx, eval_idx, split = list(range(len(files))), None, f"{eval_dir.name}/ folder"
    else:
        train_idx, eval_idx = stratified_split(labels, config.eval_fraction, config.seed)
        eval_files, eval_labels = [files[i] for i in eval_idx], [labels[i] for i in eval_idx]
        split = f"{config.eval_fraction:.0%} of each class held out (seed {config.seed})"
    if skipped:
        shown = "; ".join(skipped[:SHOWN_SKIPS]) + (" ..." if len(skipped) > SHOWN_SKIPS else "")
        log.warning("skipping %d unreadable file(s) in %s: %s", len(skipped), root, shown)
    train = LazyImageDataset([_load_file(files[i]) for i in train_idx], [labels[i] for i in train_idx], processor)
    evald = LazyImageDataset([_load_file(p) for p in eval_files], eval_labels, processor)
    return TrainData(
        train=train,
        eval=evald,
        class_names=classes,
        eval_split=split,
        skipped=len(skipped),
        meta={"dataset": str(root), "image_size": image_size},
    )


def _check_every_class(labels: list[int], classes: list[str], where: Path) -> None:
    empty = [name for i, name in enumerate(classes) if i not in set(labels)]
    if empty:
        raise ValueError(
            f"class folder(s) {', '.join(empty)} in {where} have no readable image; add images or remove the folder"
        )


def stratified_split(labels: Sequence[int], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, eval indices): `fraction` of each class (at least one image of a class with
    two or more) held out, chosen by a seeded permutation; both lists sorted."""
    rng = torch.Generator().manual_seed(seed)
    train, held = [], []
    for label in sorted(set(labels)):
        members = [i for i, y in enumerate(labels) if y == label]
        order = [members[j] for j in torch.randperm(len(members), generator=rng).tolist()]
        n_eval = max(1, round(fraction * len(members))) if len(members) >= 2 else 0
        held += order[:n_eval]
        train += order[n_eval:]
    return sorted(train), sorted(held)


# datasets saved to disk --------------------------------------------------------------------
IMAGE_COLUMN_NAMES = ("image", "img", "picture", "photo")
LABEL_COLUMN_NAMES = ("label", "labels", "class", "target", "fine_label")


def _load_disk(path: str) -> tuple[Any, Any | None]:
    """(train split, eval split or None) of a saved Dataset / DatasetDict."""
    import datasets

    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(f"saved DatasetDict {path} has no 'train' split (splits: {', '.join(loaded)})")
        eval_name = next((name for name in EVAL_SPLITS if name in loaded), None)
        return loaded["train"], (loaded[eval_name] if eval_name else None)
    return loaded, None


def _columns(dataset: Any, config: TrainConfig) -> tuple[str, str]:
    import datasets

    features = dataset.features
    names = list(features)

    def pick(given: str | None, kind: type, candidates: tuple[str, ...], what: str, option: str) -> str:
        if given is not None:
            if given not in features:
                raise ValueError(
                    f"{option} {given!r} is not a column of {config.dataset} (columns: {', '.join(names)})"
                )
            return given
        typed = [n for n in names if isinstance(features[n], kind)]
        named = [n for n in names if n.lower() in candidates]
        if typed or named:
            return (typed or named)[0]
        raise ValueError(
            f"cannot tell which column of {config.dataset} holds the {what} (columns: "
            f"{', '.join(names)}); pass {option} NAME"
        )

    return (
        pick(config.image_column, datasets.Image, IMAGE_COLUMN_NAMES, "images", "--image-column"),
        pick(config.label_column, datasets.ClassLabel, LABEL_COLUMN_NAMES, "labels", "--label-column"),
    )


def disk_classes(config: TrainConfig) -> list[str]:
    import datasets

    train, _ = _load_disk(config.dataset)
    _, label_col = _columns(train, config)
    feature = train.features[label_col]
    if isinstance(feature, datasets.ClassLabel):
        return list(feature.names)
    return [str(v) for v in sorted(set(train[label_col]))]


def _decode(value: Any) -> Image.Image:
    """An image cell (datasets Image with decode=False: {"bytes", "path"}; or an array) as RGB PIL."""
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):
        if value.get("bytes"):
            return Image.open(io.BytesIO(value["bytes"])).convert("RGB")
        return Image.open(value["path"]).convert("RGB")
    import numpy as np

    return Image.fromarray(np.asarray(value).astype("uint8")).convert("RGB")


def _disk_items(dataset: Any, image_col: str, label_ids: list[int], skipped: list[str]) -> tuple[list, list[int]]:
    images, labels = [], []
    for row, label in enumerate(label_ids):
        try:
            images.append(_decode(dataset[row][image_col]))
            labels.append(label)
        except Exception as err:  # noqa: BLE001 - an undecodable cell: skip it, count it
            skipped.append(f"row {row} ({type(err).__name__}: {err})")
    return images, labels


def build_disk(config: TrainConfig, processor: Any, image_size: int | None) -> TrainData:
    import datasets

    train, evald = _load_disk(config.dataset)
    image_col, label_col = _columns(train, config)
    classes = disk_classes(config)
    index = {name: i for i, name in enumerate(classes)}

    def label_ids(split: Any) -> list[int]:
        if isinstance(split.features[label_col], datasets.ClassLabel):
            return [int(v) for v in split[label_col]]
        unknown = sorted({str(v) for v in split[label_col]} - set(index))
        if unknown:
            raise ValueError(f"labels {unknown[:5]} of the eval split are not in the train split of {config.dataset}")
        return [index[str(v)] for v in split[label_col]]

    if isinstance(train.features[image_col], datasets.Image):
        train = train.cast_column(image_col, datasets.Image(decode=False))  # decode ourselves: count failures
        if evald is not None:
            evald = evald.cast_column(image_col, datasets.Image(decode=False))
    skipped: list[str] = []
    images, labels = _disk_items(train, image_col, label_ids(train), skipped)
    if evald is not None:
        eval_images, eval_labels = _disk_items(evald, image_col, label_ids(evald), skipped)
        split = "the dataset's eval split"
    else:
        train_idx, eval_idx = stratified_split(labels, config.eval_fraction, config.seed)
        eval_images, eval_labels = [images[i] for i in eval_idx], [labels[i] for i in eval_idx]
        images, labels = [images[i] for i in train_idx], [labels[i] for i in train_idx]
        split = f"{config.eval_fraction:.0%} of each class held out (seed {config.seed})"
    if skipped:
        log.warning(
            "skipping %d unreadable image(s) in %s: %s", len(skipped), config.dataset, "; ".join(skipped[:SHOWN_SKIPS])
        )
    train_ds = PixelDataset(encode(processor, images), torch.tensor(labels, dtype=torch.long))
    eval_ds = PixelDataset(encode(processor, eval_images), torch.tensor(eval_labels, dtype=torch.long))
    return TrainData(
        train=train_ds,
        eval=eval_ds,
        class_names=classes,
        eval_split=split,
        skipped=len(skipped),
        meta={"dataset": str(config.dataset), "image_size": image_size},
    )
