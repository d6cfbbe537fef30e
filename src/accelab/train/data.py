"""Training data: what `--dataset` names, its class labels, and the train / eval datasets.

Sources (`dataset_kind`):
- `digits`: scikit-learn's 8x8 digits upscaled to the model's image size; the catalog's
  deterministic train / test split (the quality guard checks trained models on that test split);
- `imagefolder`: a directory with one subfolder per class (or `train/` and `test/` / `val/`
  subfolders, each with class subfolders); unreadable images are skipped, counted, warned;
- `disk`: a `datasets` dataset saved with `save_to_disk` (a DatasetDict's "train" and
  "test"/"validation" splits, or a seeded split); image / label columns autodetected;
- `text`: a text file (or the catalog's held-out essay) packed into blocks for a causal LM.

`detect_kind` and `class_names` are cheap (no image is decoded), so the parent process checks
the dataset before it starts any worker.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from accelab.train.config import DatasetKind, TrainConfig
from accelab.train.data_spec import TrainData

log = logging.getLogger(__name__)

DIGITS = "digits"
HELDOUT = ""  # dataset value meaning "the catalog's held-out essay" (text-generation)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


def detect_kind(dataset: str, task: str) -> DatasetKind:
    """Which source `--dataset` names; ValueError with the fix when it names nothing usable."""
    if task == "text-generation":
        if dataset in (HELDOUT, "heldout"):
            return "text"
        path = Path(dataset).expanduser()
        if not path.exists():
            raise ValueError(
                f"dataset file {path} does not exist; pass a UTF-8 text file, or omit --dataset "
                "to fine-tune on the catalog's held-out essay"
            )
        if not path.is_file():
            raise ValueError(f"--dataset {path} is a directory; text-generation fine-tunes on one text file")
        return "text"
    if dataset == DIGITS:
        return "digits"
    path = Path(dataset).expanduser()
    if not path.exists():
        raise ValueError(
            f"dataset path {path} does not exist; pass --dataset digits (built in), a directory with one "
            "subfolder per class, or a `datasets` dataset saved with save_to_disk"
        )
    if path.is_file():
        raise ValueError(
            f"--dataset {path} is a file; image classification needs --dataset digits, a directory "
            "of class subfolders or a saved `datasets` dataset (text files are for --task text-generation)"
        )
    if any((path / name).is_file() for name in ("dataset_dict.json", "dataset_info.json", "state.json")):
        return "disk"
    return "imagefolder"


def class_names(config: TrainConfig) -> list[str] | None:
    """The dataset's class labels (image classification), without decoding any image."""
    if config.task != "image-classification":
        return None
    if config.dataset_kind == "digits":
        return [str(i) for i in range(10)]
    if config.dataset_kind == "imagefolder":
        from accelab.train.data_images import folder_classes

        return folder_classes(Path(config.dataset))
    from accelab.train.data_images import disk_classes

    return disk_classes(config)


def build(config: TrainConfig, processor: Any, image_size: int | None) -> TrainData:
    """Load and encode the datasets for this run (in each worker process)."""
    if config.task == "text-generation":
        from accelab.train.data_text import build_text

        return build_text(config, processor)
    from accelab.train import data_images

    builders = {
        "digits": data_images.build_digits,
        "imagefolder": data_images.build_folder,
        "disk": data_images.build_disk,
    }
    return builders[config.dataset_kind](config, processor, image_size)  # they warn about skipped images
