"""Models from the Hugging Face Hub, end to end: the real `accelab` CLI in a subprocess, the real
huggingface_hub download code and real HTTP, against the local Hub of `hub_server.py`
(HF_ENDPOINT points at it, HF_HOME is a fresh directory per test). Nothing reaches the internet.

The model is a tiny BERT (random weights, one layer, 24 MB: the weights must be larger than
huggingface_hub's 10 MiB download chunk for a dropped connection to resume mid-file) with the
catalog MiniLM's tokenizer.
"""

import fcntl
import hashlib
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from hub_server import FakeHub, etag_of

from accelab.catalog import hub as hub_ref

pytestmark = pytest.mark.slow

QUICK = ["--batch-size", "1", "--seq-len", "8", "--warmup", "1", "--min-iters", "3", "--min-seconds", "0.1"]
WEIGHTS = "model.safetensors"
CHUNK = 10 * 1024 * 1024  # huggingface_hub's constants.DOWNLOAD_CHUNK_SIZE: a resume starts at a multiple of it
CUSTOM_CODE = '''import os

from transformers import BertModel


class TinyCustomBert(BertModel):
    """Code from the repository: it leaves a mark where the test can see that it ran."""

    def __init__(self, config):
        super().__init__(config)
        with open(os.environ["HUB_TEST_MARKER"], "a") as f:
            f.write("TinyCustomBert\\n")
'''


def tiny_bert(directory: Path, hidden: int) -> dict[str, bytes]:
    import torch
    from transformers import BertConfig, BertModel

    from accelab.catalog.fetch import fetch, is_fetched
    from accelab.catalog.store import model_dir

    if not is_fetched("minilm-l6"):
        fetch("minilm-l6")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=128,
    )
    BertModel(config).save_pretrained(directory)
    files = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        files[name] = (model_dir("minilm-l6") / name).read_bytes()
    return files


@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> dict[str, bytes]:
    files = tiny_bert(tmp_path_factory.mktemp("tiny-bert"), hidden=192)
    assert len(files[WEIGHTS]) > 2 * CHUNK + 1024  # half of it, where the server hangs up, is past one chunk
    return files


@pytest.fixture(scope="module")
def custom_files(tmp_path_factory) -> dict[str, bytes]:
    files = tiny_bert(tmp_path_factory.mktemp("custom-bert"), hidden=32)
    config = json.loads(files["config.json"])
    config["auto_map"] = {"AutoModel": "modeling_tiny.TinyCustomBert"}
    files["config.json"] = json.dumps(config).encode()
    files["modeling_tiny.py"] = CUSTOM_CODE.encode()
    return files


@pytest.fixture(scope="module")
def hub():
    with FakeHub() as server:
        yield server


def env_for(endpoint: str, home: Path, **extra: str) -> dict[str, str]:
    """The environment of a user on a connected machine: no token, no offline switch, this Hub."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "HUGGINGFACE_")) and k not in ("TRANSFORMERS_OFFLINE", hub_ref.TRUST_ENV)
    }
    return (
        env
        | {
            "HF_ENDPOINT": endpoint,
            "HF_HOME": str(home),
            "NO_PROXY": "127.0.0.1",
            "no_proxy": "127.0.0.1",
            "PYTHONUNBUFFERED": "1",
        }
        | extra
    )


def accelab(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "accelab", *args], capture_output=True, text=True, timeout=300, env=env, check=False
    )


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def user_error(proc: subprocess.CompletedProcess) -> str:
    """The message of a user error: exit code 2, one line, no traceback."""
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def info(name: str, env: dict[str, str], *flags: str) -> dict:
    """`accelab models info` resolves (and downloads) without loading: the spec it found."""
    return json.loads(ok(accelab(*flags, "models", "info", name, env=env)).stdout)["spec"]


def snapshot_dir(home: Path, repo: str, commit: str) -> Path:
    return home / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / commit


def test_parse_ref():
    assert hub_ref.parse_ref("acme/tiny-bert") == ("acme/tiny-bert", None)
    assert hub_ref.parse_ref("acme/tiny-bert@v1.0") == ("acme/tiny-bert", "v1.0")
    assert hub_ref.parse_ref("acme/tiny-bert@refs/pr/3") == ("acme/tiny-bert", "refs/pr/3")
    assert hub_ref.parse_ref("minilm-l6") is None and hub_ref.parse_ref("./models/x") is None


def test_remote_code_is_found_in_the_tokenizer_config_too(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert hub_ref.needs_remote_code(tmp_path) is None
    hub_ref.check_remote_code(tmp_path, "acme/x", trust_remote_code=False)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["tok.T", None]}}))
    assert hub_ref.needs_remote_code(tmp_path) == "tokenizer_config.json"
    with pytest.raises(ValueError, match="its tokenizer_config.json has auto_map.*--trust-remote-code"):
        hub_ref.check_remote_code(tmp_path, "acme/x", trust_remote_code=False)
    hub_ref.check_remote_code(tmp_path, "acme/x", trust_remote_code=True)


def test_download_measure_then_offline_from_the_cache(hub, model_files, tmp_path):
    commit = hub.add("acme/tiny-bert", model_files)
    env = env_for(hub.url, tmp_path / "hf")
    out = tmp_path / "online.json"
    ok(accelab("bench", "acme/tiny-bert", *QUICK, "--no-store", "--json", str(out), env=env))
    result = json.loads(out.read_text())
    snapshot = snapshot_dir(tmp_path / "hf", "acme/tiny-bert", commit)
    assert result["status"] == "ok" and result["metrics"]["iterations"] >= 3
    assert result["model"]["source"] == str(snapshot) and result["model"]["task"] == "feature-extraction"
    for name, data in model_files.items():  # every file, byte for byte, in huggingface_hub's cache layout
        assert (snapshot / name).read_bytes() == data, name
    assert (snapshot / WEIGHTS).resolve().name == etag_of(model_files[WEIGHTS])  # a link to its blob
    assert len(hub.requests("GET", f"/acme/tiny-bert/resolve/{commit}/{WEIGHTS}")) == 1

    # offline: the same command measures from the cache, with no Hub to ask (nothing listens on port 9)
    seen = len(hub.requests())
    out = tmp_path / "offline.json"
    offline_env = env_for("http://127.0.0.1:9", tmp_path / "hf")
    ok(accelab("--offline", "bench", "acme/tiny-bert", *QUICK, "--no-store", "--json", str(out), env=offline_env))
    result = json.loads(out.read_text())
    assert result["status"] == "ok" and result["model"]["source"] == str(snapshot)
    assert len(hub.requests()) == seen


def test_revision_pins_a_branch_tag_or_commit(hub, tmp_path):
    encoder = {"architectures": ["BertModel"], "model_type": "bert"}
    decoder = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    main = hub.add("acme/revs", {"config.json": json.dumps(encoder).encode()})
    v1 = hub.add("acme/revs", {"config.json": json.dumps(decoder).encode()}, revision="v1")
    env = env_for(hub.url, tmp_path / "hf")
    home = tmp_path / "hf"

    spec = info("acme/revs@v1", env)
    assert (spec["name"], spec["hub_id"], spec["task"]) == ("acme/revs@v1", "acme/revs", "text-generation")
    assert spec["source"] == str(snapshot_dir(home, "acme/revs", v1))
    spec = info("acme/revs", env)
    assert spec["task"] == "feature-extraction" and spec["source"] == str(snapshot_dir(home, "acme/revs", main))
    # a commit id needs no lookup of what it points at
    lookups = len(hub.requests("GET", "/api/models/acme/revs/revision/"))
    spec = info(f"acme/revs@{v1}", env)
    assert spec["task"] == "text-generation" and spec["source"] == str(snapshot_dir(home, "acme/revs", v1))
    assert len(hub.requests("GET", "/api/models/acme/revs/revision/")) == lookups

    pr = hub.add("acme/revs", {"config.json": json.dumps(decoder).encode()}, revision="refs/pr/1")
    assert info("acme/revs@refs/pr/1", env)["source"] == str(snapshot_dir(home, "acme/revs", pr))

    message = user_error(accelab("models", "info", "acme/revs@v9", env=env))
    assert "acme/revs has no revision 'v9'" in message and "org/name@revision" in message


def test_missing_repository_is_named_with_what_to_check(hub, tmp_path):
    env = env_for(hub.url, tmp_path / "hf")
    # without a token the Hub answers 401 for a repository that does not exist, as for a private one
    message = user_error(accelab("models", "info", "acme/nope", env=env))
    assert "acme/nope was not found on the Hub" in message and "check the name" in message
    assert "hf auth login" in message and hub.url in message
    message = user_error(accelab("models", "info", "acme/nope", env=env | {"HF_TOKEN": FakeHub.TOKEN}))
    assert "acme/nope was not found on the Hub" in message and "(404)" in message and "check the name" in message


def test_private_and_gated_repositories_say_how_to_log_in(hub, tmp_path):
    config = {"config.json": json.dumps({"architectures": ["BertModel"], "model_type": "bert"}).encode()}
    hub.add("acme/private", config, access="private")
    hub.add("acme/gated", config, access="gated")
    env = env_for(hub.url, tmp_path / "hf")

    message = user_error(accelab("models", "info", "acme/private", env=env))
    assert "private" in message and "hf auth login" in message and "HF_TOKEN" in message
    assert info("acme/private", env | {"HF_TOKEN": FakeHub.TOKEN})["hub_id"] == "acme/private"
    assert hub.requests("GET", "/api/models/acme/private/")[-1].token == FakeHub.TOKEN
    # (in a fresh cache: huggingface_hub answers from the cache when the Hub refuses and the snapshot is there)
    elsewhere = env_for(hub.url, tmp_path / "hf2", HF_TOKEN="hf_expired")
    message = user_error(accelab("models", "info", "acme/private", env=elsewhere))
    assert "refused the token" in message and "(401" in message and "HF_TOKEN" in message

    message = user_error(accelab("models", "info", "acme/gated", env=env))
    assert "acme/gated is gated" in message and "accept its terms" in message and "HF_TOKEN" in message
    message = user_error(accelab("models", "info", "acme/gated", env=env | {"HF_TOKEN": FakeHub.TOKEN}))
    assert "acme/gated is gated" in message and "a token of the account that did" in message


def test_dropped_connection_resumes_and_a_broken_file_is_never_used(hub, model_files, tmp_path):
    commit = hub.add("acme/flaky", model_files)
    env, home = env_for(hub.url, tmp_path / "hf"), tmp_path / "hf"
    weights_url = f"/acme/flaky/resolve/{commit}/{WEIGHTS}"

    # 1. every GET of the weights hangs up half way: huggingface_hub resumes from the last whole
    #    chunk (a Range request), gets nothing more 5 times, gives up; accelab says what to do
    hub.cut[WEIGHTS] = 100
    message = user_error(accelab("models", "info", "acme/flaky", env=env))
    assert "downloading acme/flaky" in message and "broke off" in message and "run the same command again" in message
    ranges = [s.range for s in hub.requests("GET", weights_url)]
    assert ranges[0] is None and set(ranges[1:]) == {f"bytes={CHUNK}-"} and len(ranges) == 6
    snapshot, blobs = snapshot_dir(home, "acme/flaky", commit), home / "hub" / "models--acme--flaky" / "blobs"
    assert (snapshot / "config.json").read_bytes() == model_files["config.json"]  # complete files are kept
    assert not (snapshot / WEIGHTS).exists() and not (blobs / etag_of(model_files[WEIGHTS])).exists()
    assert not list(blobs.glob("*.incomplete"))  # the half-written file is gone
    message = user_error(accelab("--offline", "models", "info", "acme/flaky", env=env))
    assert "only partly in the local Hugging Face cache" in message  # offline, the partial snapshot is refused

    # 2. once more, with one hang-up: resumed in place, the rest comes with a Range request
    hub.cut[WEIGHTS] = 1
    seen = len(hub.requests())
    assert info("acme/flaky", env)["source"] == str(snapshot)
    again = hub.requests()[seen:]
    assert [s.range for s in again if s.method == "GET" and s.path == weights_url] == [None, f"bytes={CHUNK}-"]
    assert not [s for s in again if s.path.endswith("/config.json")]  # kept from the first attempt
    assert hashlib.sha256((snapshot / WEIGHTS).read_bytes()).hexdigest() == etag_of(model_files[WEIGHTS])


def test_remote_code_needs_the_flag(hub, custom_files, tmp_path):
    hub.add("acme/custom", custom_files)
    marker = tmp_path / "marker"
    env = env_for(hub.url, tmp_path / "hf", HUB_TEST_MARKER=str(marker))

    message = user_error(accelab("models", "info", "acme/custom", env=env))
    assert "its config.json has auto_map" in message and "--trust-remote-code" in message and not marker.exists()
    out = tmp_path / "r.json"
    ok(accelab("--trust-remote-code", "bench", "acme/custom", *QUICK, "--no-store", "--json", str(out), env=env))
    result = json.loads(out.read_text())
    assert result["status"] == "ok" and result["model"]["trust_remote_code"] is True
    assert "TinyCustomBert" in marker.read_text()  # the repository's class is the model that was measured


def test_offline_and_not_cached_is_explained(hub, model_files, tmp_path):
    hub.add("acme/uncached", {"config.json": model_files["config.json"]})
    env = env_for(hub.url, tmp_path / "hf")
    for flags, extra in ((["--offline"], {}), ([], {"HF_HUB_OFFLINE": "1"})):
        message = user_error(accelab(*flags, "models", "info", "acme/uncached", env=env | extra))
        assert "acme/uncached is not in the local Hugging Face cache" in message and "unset HF_HUB_OFFLINE" in message
    assert not hub.requests(contains="acme/uncached")


def test_progress_bar_on_a_terminal_only(hub, model_files, tmp_path):
    hub.add("acme/bar", {"config.json": model_files["config.json"]})
    assert "Fetching" not in ok(accelab("models", "info", "acme/bar", env=env_for(hub.url, tmp_path / "a"))).stderr
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty is 0 columns wide
    proc = subprocess.Popen(
        [sys.executable, "-m", "accelab", "models", "info", "acme/bar"],
        stdout=subprocess.PIPE,
        stderr=secondary,
        env=env_for(hub.url, tmp_path / "b"),
    )
    os.close(secondary)
    terminal = b""
    try:
        while chunk := os.read(primary, 4096):
            terminal += chunk
    except OSError:  # EIO: the child closed the terminal
        pass
    finally:
        os.close(primary)
    assert proc.wait(60) == 0 and json.loads(proc.stdout.read())["spec"]["hub_id"] == "acme/bar"
    assert b"Fetching 1 files" in terminal and b"100%" in terminal, terminal
