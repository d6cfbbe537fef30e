"""backend vllm without its engine: plan options and their errors, the wire format, the vLLM
environment, finding the vLLM venv, the model checks, step gathering of a batch, and the serving
worker's contract (429, 413, deadline, cancel, stop strings, engine errors) against a FAKE engine
client (scripted messages, labelled FAKE) with a fake clock. Milliseconds each."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from accelab.backends import engine_wire as W, vllm_cli, vllm_launch
from accelab.plan.backend_options import VllmOptions
from accelab.plan.plan import Plan, load_plan
from accelab.plan.presets import PRESETS


# -- plan options --------------------------------------------------------------------------------
def test_presets_and_options_parse_to_engine_arguments():
    assert PRESETS["vllm"].backend == "vllm" and PRESETS["vllm-bf16"].option == {"vllm_dtype": "bfloat16"}
    plan = load_plan(
        "vllm[vllm_max_num_seqs=16;vllm_mode=compiled;vllm_block_size=64;vllm_prefix_caching=on;"
        "vllm_kv_cache_gib=3;vllm_max_num_batched_tokens=512;vllm_max_model_len=4096]"
    )
    options = VllmOptions.parse(plan.option)
    assert (options.max_num_seqs, options.mode, options.block_size, options.prefix_caching) == (
        16,
        "compiled",
        64,
        "on",
    )
    assert (options.kv_cache_gib, options.max_num_batched_tokens, options.max_model_len) == (3, 512, 4096)
    assert Plan.from_yaml(plan.to_yaml()) == plan
    defaults = VllmOptions.parse({})
    assert (defaults.dtype, defaults.mode, defaults.prefix_caching) == ("float32", "eager", "off")


@pytest.mark.parametrize(
    "ref, words",
    [
        ("vllm[vllm_dtype=fp32]", ["vllm_dtype='fp32'", "float32, bfloat16, float16"]),
        ("vllm[vllm_max_num_seqs=0]", ["vllm_max_num_seqs='0'", "1 or more"]),
        ("vllm[vllm_block_size=48]", ["vllm_block_size='48'", "16, 32, 64, 128, 256"]),
        ("vllm[vllm_mode=fast]", ["vllm_mode='fast'", "eager, compiled"]),
        ("vllm[vllm_blocksize=32]", ["vllm_blocksize", "did you mean 'vllm_block_size'"]),
        ("baseline[vllm_mode=eager]", ["vllm_mode", "option of backend=vllm", "--set backend=vllm"]),
        ("vllm[vllm_max_num_seqs=8;vllm_max_num_batched_tokens=4]", ["vllm_max_num_batched_tokens=4", "raise it to 8"]),
        ("vllm[ort_fusion=on]", ["ort_fusion", "backend=onnxruntime"]),
    ],
)
def test_a_bad_option_names_the_field_and_what_is_allowed(ref, words):
    with pytest.raises(ValueError) as err:
        load_plan(ref)
    for word in words:
        assert word in str(err.value)


def test_the_cli_refuses_a_bad_option_before_loading_anything(tmp_path):
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelab",
            "bench",
            "smollm2-135m",
            "--plan",
            "vllm",
            "--set",
            "vllm_dtype=half",
            "--no-store",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0
    assert (
        "vllm_dtype='half'" in proc.stdout + proc.stderr and "float32, bfloat16, float16" in proc.stdout + proc.stderr
    )
    assert time.monotonic() - started < 60  # no vLLM engine was started (that takes 30 s to minutes)


def test_torch_fields_on_a_vllm_plan_are_refused_before_loading():
    from accelab.backends import BACKENDS
    from accelab.catalog.resolve import resolve
    from accelab.plan.runtime import Unsupported

    spec = resolve("smollm2-135m", fetch=False)
    with pytest.raises(Unsupported, match="torch fields precision, compile"):
        BACKENDS["vllm"].check(
            spec, load_plan("vllm", ["precision=bf16-weights", "compile=default"]), torch.device("cpu")
        )


# -- the wire --------------------------------------------------------------------------------------
def test_every_message_round_trips_through_one_json_line():
    messages = [
        W.Submit(id="3", prompt_ids=[1, 2], max_tokens=4, min_tokens=4, temperature=0.7, seed=5),
        W.Abort(id="3"),
        W.Score(id="4", prompt_ids=[5, 6]),
        W.Watch(),
        W.Tokens(id="3", tokens=[9], finished="length"),
        W.Scored(id="4", logprobs=[-1.5]),
        W.Failed(id="3", error="boom"),
        W.Stats(running=2, waiting=1, kv_usage=0.25),
    ]
    for message in messages:
        line = W.encode(message)
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert W.decode(line) == message
    config = W.EngineConfig(model="/m", max_num_seqs=8, keep_s=5)
    assert W.EngineConfig.from_json(config.to_json()) == config
    ov = W.OvEngineConfig(model="/ov", precision="bf16", kv_precision="u8", max_num_seqs=16, threads=2)
    assert W.OvEngineConfig.from_json(ov.to_json()) == ov
    with pytest.raises(ValueError, match="unknown engine message"):
        W.decode(b'{"kind": "Nope"}')


def test_measuring_engines_are_shared_and_a_servers_engine_is_its_own():
    install = vllm_launch.VllmInstall(python=Path("/v/bin/python"), venv=Path("/v"), distribution="vllm", version="1")
    env: dict[str, str] = {}

    def key(keep_s: float, owner: int | None = None, seqs: int = 8) -> str:
        config = W.EngineConfig(model="/m", max_num_seqs=seqs, keep_s=keep_s)
        return vllm_launch.engine_key(config, install, env, owner=owner)

    assert key(600) == key(30)  # how long it stays up is not what it runs: measurements share it
    assert key(600) != key(600, seqs=16)
    assert key(0, owner=101) != key(0, owner=102) and key(0, owner=101) != key(600)  # one per server


# -- the environment and the install -------------------------------------------------------------
def test_vllm_env_fills_in_what_is_missing_and_keeps_the_users_settings(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env = vllm_cli.vllm_env({"VLLM_CPU_OMP_THREADS_BIND": "0", "LD_PRELOAD": "/x.so"}, tmp_path, threads=None)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"  # the user's
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    preload = env["LD_PRELOAD"].split(":")
    assert preload[0] == "/x.so" and str(tmp_path / "lib" / "libiomp5.so") in preload
    assert "VLLM_TARGET_DEVICE" not in env  # not the CPU build's layout
    asked = vllm_cli.vllm_env({"VLLM_CPU_KVCACHE_SPACE": "2"}, tmp_path, kv_cache_gib=5, threads=1)
    assert asked["VLLM_CPU_KVCACHE_SPACE"] == "5"  # the plan's option wins over an inherited default
    first = min(__import__("os").sched_getaffinity(0))
    assert asked["VLLM_CPU_OMP_THREADS_BIND"] == str(first)


def test_cpu_list_is_a_range_or_a_list():
    cpus = sorted(__import__("os").sched_getaffinity(0))
    text = vllm_cli.cpu_list()
    assert text == (f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 else str(cpus[0])) or text == ",".join(map(str, cpus))


def _fake_venv(root: Path, dist: str) -> Path:
    """A directory laid out like a venv holding vLLM (FAKE: no vLLM inside)."""
    site = root / "lib" / "python3.11" / "site-packages"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    (site / f"{dist}-0.32.0.dist-info").mkdir()
    (root / "bin").mkdir()
    (root / "bin" / "python").write_text("")
    return root


def test_find_vllm_follows_the_override_and_says_how_to_install(tmp_path, monkeypatch):
    from accelab.backends.vllm_launch import find_vllm

    monkeypatch.setenv("ACCELAB_VLLM_VENV", str(tmp_path / "missing"))
    install, reason = find_vllm()
    assert install is None and "make vllm" in reason and str(tmp_path / "missing") in reason
    monkeypatch.setenv("ACCELAB_VLLM_VENV", str(_fake_venv(tmp_path / "v", "vllm_cpu")))
    install, where = find_vllm()
    assert install is not None and install.distribution == "vllm-cpu" and install.version == "0.32.0"
    assert vllm_cli.is_cpu_build(install.venv) and "ACCELAB_VLLM_VENV" in where


def test_capabilities_report_vllm_and_why_not(monkeypatch, tmp_path):
    from accelab.measure.capabilities import capabilities

    monkeypatch.setenv("ACCELAB_VLLM_VENV", str(tmp_path / "none"))
    row = next(c for c in capabilities({}) if c.technique == "vllm")
    assert row.status == "unsupported" and "make vllm" in row.reason
    monkeypatch.setenv("ACCELAB_VLLM_VENV", str(_fake_venv(tmp_path / "v", "vllm")))
    row = next(c for c in capabilities({}) if c.technique == "vllm")
    assert row.status == "ok" and "vllm 0.32.0" in row.reason


def test_model_checks_say_what_vllm_runs(tmp_path):
    from accelab.backends.vllm import check_model
    from accelab.catalog.spec import ModelSpec
    from accelab.plan.runtime import Unsupported

    cpu = torch.device("cpu")
    with pytest.raises(Unsupported, match="runs text-generation models; enc is feature-extraction"):
        check_model(ModelSpec(name="enc", task="feature-extraction", source=str(tmp_path)), cpu)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(Unsupported, match="no config.json.*backend llamacpp"):
        check_model(ModelSpec(name="g", task="text-generation", source=str(tmp_path), gguf_file="m.gguf"), cpu)


def test_tune_searches_vllm_and_prunes_bf16_where_bf16_is_slow():
    from accelab.tuner.space import VARIANTS, techniques

    assert {"vllm", "vllm-bf16"} <= set(VARIANTS["generate"])
    assert techniques(PRESETS["vllm"]) == ["vllm"]
    assert techniques(PRESETS["vllm-bf16"]) == ["vllm", "bf16-weights"]


# -- a batch's steps (fake client: scripted token messages) --------------------------------------
class FakeClient:
    """FAKE engine client: records what is sent; the test delivers the engine's messages."""

    name = "FAKE engine"

    def __init__(self, *, kv_blocks: int = 10, block_size: int = 16, max_num_seqs: int = 4):
        self.info = W.Info(
            model="m",
            version="0",
            pid=0,
            max_model_len=256,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=256,
            block_size=block_size,
            kv_blocks=kv_blocks,
            dtype="float32",
            enforce_eager=True,
            prefix_caching=False,
            load_s=0.0,
        )
        self.sent: list[W.Submit] = []
        self.aborted: list[str] = []
        self.handlers: dict[str, object] = {}
        self.on_stats = None
        self.alive = True
        self._ids = itertools.count()
        self.lock = threading.Lock()

    def new_id(self) -> str:
        return str(next(self._ids))

    def submit(self, message, handler) -> None:
        with self.lock:
            self.sent.append(message)
            self.handlers[message.id] = handler

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def watch(self, on_stats) -> None:
        self.on_stats = on_stats

    def deliver(self, request_id: str, tokens: list[int], finished: str | None = None) -> None:
        self.handlers[request_id](W.Tokens(id=request_id, tokens=tokens, finished=finished))


def test_a_batch_becomes_steps_whatever_order_the_rows_tokens_arrive_in():
    from accelab.backends.engine_model import EngineModel

    client = FakeClient()
    model = EngineModel(client, config=type("C", (), {"eos_token_id": 2})(), generation_config=None)
    seen: list[list[int]] = []

    def clock(input_ids, scores):
        seen.append(input_ids[:, -1].tolist())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def engine():  # row 1 runs ahead of row 0, then both finish at length 3
        while len(client.sent) < 2:
            time.sleep(0.001)
        client.deliver("1", [21, 22])
        client.deliver("0", [11])
        client.deliver("0", [12, 13], finished="length")
        client.deliver("1", [23], finished="length")

    thread = threading.Thread(target=engine)
    thread.start()
    batch = {"input_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]), "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])}
    out = model.generate(batch, max_new_tokens=3, min_new_tokens=3, stopping_criteria=[clock], pad_token_id=0)
    thread.join()
    assert [m.prompt_ids for m in client.sent] == [[5, 6], [7, 8, 9]]  # left padding removed
    assert all(m.min_tokens == 3 and m.max_tokens == 3 and m.temperature == 0.0 for m in client.sent)
    assert seen == [[11, 21], [12, 22], [13, 23]]  # once per step, after both rows had their token
    assert out[:, 3:].tolist() == [[11, 12, 13], [21, 22, 23]]
    assert client.aborted == []  # nothing left running


def test_an_engine_failure_fails_the_call_and_aborts_the_other_rows():
    from accelab.backends.engine_model import EngineModel

    client = FakeClient()
    model = EngineModel(client, config=type("C", (), {"eos_token_id": 2})(), generation_config=None)

    def engine():
        while len(client.sent) < 2:
            time.sleep(0.001)
        client.handlers["1"](W.Failed(id="1", error="FAKE engine error"))

    threading.Thread(target=engine).start()
    with pytest.raises(RuntimeError, match="row 1 of the batch: FAKE engine error"):
        model.generate({"input_ids": torch.tensor([[1, 2], [3, 4]])}, max_new_tokens=2)
    assert client.aborted == ["0"]


def test_a_logits_processor_cannot_run_inside_vllm():
    from accelab.backends.engine_model import EngineModel

    model = EngineModel(FakeClient(), config=None, generation_config=None)
    with pytest.raises(ValueError, match="logits_processor"):
        model.generate({"input_ids": torch.tensor([[1]])}, max_new_tokens=1, do_sample=True, logits_processor=[1])
