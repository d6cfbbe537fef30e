"""Two "nodes" on 127.0.0.1: two `accelab train` / `accelab predict` commands, each a torchrun
agent with 2 ranks (`--nnodes 2 --nproc 2`), meeting through a c10d rendezvous, as on two
machines. Train: the 4 ranks step together (the loss curve of one process at the same global
batch, within the data-parallel tolerance of test_train_e2e) and one checkpoint is written, by
global rank 0. Predict: the output of one process, every input exactly once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from accelab.predict.outputs import read_output

pytestmark = pytest.mark.slow

DDP_LOSS_RTOL = 1e-4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def accelab(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "accelab", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def on_two_nodes(args: list[str], per_node: list[list[str]], env: dict[str, str], timeout_s: float = 600) -> list[str]:
    """Run the same command on two local "nodes" (c10d rendezvous on a free port); their outputs."""
    port = free_port()
    rendezvous = ["--nproc", "2", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                  "--rdzv-id", f"accelab-test-{port}"]
    nodes = [accelab(*args, *extra, *rendezvous, env=env) for extra in per_node]
    outputs = []
    try:
        for node in nodes:
            out, _ = node.communicate(timeout=timeout_s)
            outputs.append(out)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, out in zip(nodes, outputs):
        assert node.returncode == 0, out[-3000:]
    return outputs


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A private ACCELAB_CACHE: a tiny ViT (2 layers of width 32, 16 px) and the catalog's MiniLM."""
    from transformers import ViTConfig, ViTForImageClassification

    from accelab.catalog.build_vision import image_processor_class
    from accelab.catalog.fetch import fetch, is_fetched
    from accelab.catalog.store import model_dir

    root = tmp_path_factory.mktemp("multinode-cache")
    (root / "models").mkdir()
    if not is_fetched("minilm-l6"):
        fetch("minilm-l6")
    os.symlink(model_dir("minilm-l6"), root / "models" / "minilm-l6")
    labels = {i: str(i) for i in range(10)}
    config = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                       image_size=16, patch_size=4, num_labels=10, id2label=labels,
                       label2id={v: k for k, v in labels.items()}, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    ViTForImageClassification(config).save_pretrained(root / "tiny-vit")
    image_processor_class("ViTImageProcessor")(size={"height": 16, "width": 16}, image_mean=[0.5] * 3,
                                               image_std=[0.5] * 3).save_pretrained(root / "tiny-vit")
    return {**os.environ, "ACCELAB_CACHE": str(root), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def test_two_nodes_train_in_step_with_one_process_and_write_one_checkpoint(env, tmp_path):
    root = Path(env["ACCELAB_CACHE"])
    common = ["train", "--model", str(root / "tiny-vit"), "--dataset", "digits", "--max-steps", "4", "--batch-size",
              "16", "--threads", "1", "--checkpoint-every", "4", "--no-save", "--no-progress", "--no-store"]
    single = tmp_path / "single"
    one = accelab(*common, "--output-dir", str(single), "--json", str(tmp_path / "one.json"), env=env)
    out, _ = one.communicate(timeout=600)
    assert one.returncode == 0, out[-3000:]
    dirs = [tmp_path / "node-a", tmp_path / "node-b"]
    on_two_nodes(common, [["--output-dir", str(d), "--json", str(d) + ".json"] for d in dirs], env)

    baseline = json.loads((tmp_path / "one.json").read_text())["metrics"]
    summaries = [Path(str(d) + ".json") for d in dirs if Path(str(d) + ".json").is_file()]
    assert len(summaries) == 1  # written by the node that holds global rank 0
    doc = json.loads(summaries[0].read_text())
    assert doc["workload"]["nnodes"] == 2 and doc["workload"]["per_process_batch"] == 4  # 16 over 4 ranks
    assert len(doc["metrics"]["peak_rss_mb_per_rank"]) == 4
    assert doc["metrics"]["losses"] == pytest.approx(baseline["losses"], rel=DDP_LOSS_RTOL)
    checkpoints = [c for d in dirs for c in (d.glob("**/checkpoints/step-*") if d.exists() else [])]
    assert len(checkpoints) == 1 and (checkpoints[0] / "trainer_state.json").is_file(), checkpoints


def test_two_nodes_predict_like_one_process_with_every_input_once(env, tmp_path):
    texts = tmp_path / "texts.jsonl"
    sentences = [f"sentence number {i} about {'cats' if i % 3 else 'the weather'}" for i in range(301)]
    texts.write_text("".join(json.dumps({"id": f"s{i}", "text": t}) + "\n" for i, t in enumerate(sentences)))
    common = ["predict", "minilm-l6", "--inputs", str(texts), "--threads", "1", "--max-length", "32", "--no-progress",
              "--no-store"]
    one_out = tmp_path / "one.jsonl"
    one = accelab(*common, "--out", str(one_out), env=env)
    out, _ = one.communicate(timeout=600)
    assert one.returncode == 0, out[-3000:]
    shared = tmp_path / "two.jsonl"  # one output path on a "shared disk", as the README tells
    on_two_nodes([*common, "--out", str(shared)], [[], []], env)
    single, double = read_output(one_out), read_output(shared)
    assert [r["id"] for r in double] == [f"s{i}" for i in range(301)]  # each input exactly once, in order
    assert np.abs(np.array([r["embedding"] for r in single]) - np.array([r["embedding"] for r in double])).max() < 1e-5
