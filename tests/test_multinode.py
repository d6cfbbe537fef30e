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
from caches import with_limits
from train_fixtures import build_tiny_vit

from accelab.predict.outputs import read_output

pytestmark = pytest.mark.slow

DDP_LOSS_RTOL = 1e-4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def accelab(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "accelab", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def on_two_nodes(args: list[str], per_node: list[list[str]], env: dict[str, str], timeout_s: float = 600) -> list[str]:
    """Run the same command on two local "nodes" (c10d rendezvous on a free port); their outputs."""
    port = free_port()
    rendezvous = [
        "--nproc",
        "2",
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"accelab-test-{port}",
    ]
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
    from accelab.catalog.fetch import fetch, is_fetched
    from accelab.catalog.store import model_dir

    root = with_limits(tmp_path_factory.mktemp("multinode-cache"))
    (root / "models").mkdir()
    if not is_fetched("minilm-l6"):
        fetch("minilm-l6")
    os.symlink(model_dir("minilm-l6"), root / "models" / "minilm-l6")
    build_tiny_vit(root / "tiny-vit")
    return {**os.environ, "ACCELAB_CACHE": str(root), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def test_two_nodes_train_in_step_with_one_process_and_write_one_checkpoint(env, tmp_path):
    root = Path(env["ACCELAB_CACHE"])
    common = [
        "train",
        "--model",
        str(root / "tiny-vit"),
        "--dataset",
        "digits",
        "--max-steps",
        "4",
        "--batch-size",
        "16",
        "--threads",
        "1",
        "--checkpoint-every",
        "4",
        "--no-save",
        "--no-progress",
        "--no-store",
    ]
    single = tmp_path / "single"
    one = accelab(*common, "--output-dir", str(single), "--json", str(tmp_path / "one.json"), env=env)
    out, _ = one.communicate(timeout=600)
    assert one.returncode == 0, out[-3000:]
    shared = tmp_path / "shared"  # one run directory on a disk both nodes see, as the README tells
    outputs = on_two_nodes([*common, "--output-dir", str(shared), "--json", str(tmp_path / "two.json")], [[], []], env)
    assert sum("the node that holds global rank 0 writes the run's result" in out for out in outputs) == 1

    baseline = json.loads((tmp_path / "one.json").read_text())["metrics"]
    doc = json.loads((tmp_path / "two.json").read_text())  # written once, by the node of global rank 0
    assert doc["status"] == "ok" and doc["workload"]["nnodes"] == 2
    assert doc["workload"]["per_process_batch"] == 4  # 16 over 4 ranks
    assert len(doc["metrics"]["peak_rss_mb_per_rank"]) == 4
    assert doc["metrics"]["losses"] == pytest.approx(baseline["losses"], rel=DDP_LOSS_RTOL)
    checkpoints = list((shared / "checkpoints").iterdir())
    assert [c.name for c in checkpoints] == ["step-0000004"]  # one checkpoint, with every rank's RNG state
    assert sorted(p.name for p in checkpoints[0].glob("random_states_*")) == [
        f"random_states_{r}.pkl" for r in range(4)
    ]
    assert (checkpoints[0] / "trainer_state.json").is_file() and (shared / "model" / "model.safetensors").is_file()


def test_two_nodes_predict_like_one_process_with_every_input_once(env, tmp_path):
    texts = tmp_path / "texts.jsonl"
    sentences = [f"sentence number {i} about {'cats' if i % 3 else 'the weather'}" for i in range(301)]
    texts.write_text("".join(json.dumps({"id": f"s{i}", "text": t}) + "\n" for i, t in enumerate(sentences)))
    common = [
        "predict",
        "minilm-l6",
        "--inputs",
        str(texts),
        "--threads",
        "1",
        "--max-length",
        "32",
        "--no-progress",
        "--no-store",
    ]
    one_out = tmp_path / "one.jsonl"
    one = accelab(*common, "--out", str(one_out), env=env)
    out, _ = one.communicate(timeout=600)
    assert one.returncode == 0, out[-3000:]
    shared = tmp_path / "two.jsonl"  # one output path on a "shared disk", as the README tells
    on_two_nodes([*common, "--out", str(shared)], [[], []], env)
    single, double = read_output(one_out), read_output(shared)
    assert [r["id"] for r in double] == [f"s{i}" for i in range(301)]  # each input exactly once, in order
    assert np.abs(np.array([r["embedding"] for r in single]) - np.array([r["embedding"] for r in double])).max() < 1e-5


def test_accelerate_launch_with_a_config_file_says_what_to_run_instead(env, tmp_path):
    """What users already write: `accelerate launch --config_file cfg.yaml -m accelab train ...`.
    accelab starts its own workers, so it stops at once and gives the command for the same layout."""
    config = tmp_path / "accelerate.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_machines: 1\n"
        "num_processes: 2\nmachine_rank: 0\nmain_process_ip: 127.0.0.1\n"
        f"main_process_port: {free_port()}\nmixed_precision: 'no'\nuse_cpu: true\n"
    )
    accelerate = Path(sys.executable).with_name("accelerate")
    done = subprocess.run(
        [
            str(accelerate),
            "launch",
            "--config_file",
            str(config),
            "-m",
            "accelab",
            "train",
            "--model",
            "vit-tiny",
            "--dataset",
            "digits",
            "--max-steps",
            "1",
            "--no-progress",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode != 0
    assert "accelab train was started by accelerate launch" in done.stderr, done.stderr[-2000:]
    assert "accelab train ... --nproc N (your config's num_processes)" in done.stderr
    assert not any((Path(env["ACCELAB_CACHE"]) / "runs").glob("*"))  # nothing was trained


def test_the_command_for_a_two_node_launcher_names_the_rendezvous():
    from accelab.launch import refuse_outer_launcher

    environ = {
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    with pytest.raises(ValueError) as err:
        refuse_outer_launcher("predict", environ)
    assert "started by torchrun (WORLD_SIZE=8" in str(err.value)
    assert "accelab predict ... --nproc 4 --nnodes 2 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500" in str(
        err.value
    )
    refuse_outer_launcher("predict", {"WORLD_SIZE": "1"})  # a plain shell: fine
