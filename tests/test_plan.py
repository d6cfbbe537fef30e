"""The Plan: validated fields, YAML round trip, presets, --set and inline overrides, backend options."""

from __future__ import annotations

import pytest

from accelab.plan.plan import Plan, apply_overrides, load_plan
from accelab.plan.presets import PRESETS


def test_every_preset_round_trips_through_yaml():
    for name, plan in PRESETS.items():
        assert plan.name == name
        assert Plan.from_yaml(plan.to_yaml()) == plan


def test_defaults_are_the_fp32_eager_baseline():
    assert Plan() == PRESETS["baseline"].with_changes(name="custom")
    assert PRESETS["baseline"].differs_from_baseline() == []
    assert PRESETS["compile-static"].differs_from_baseline() == ["compile", "kv_cache"]


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("precision", "bf16-autocst", "did you mean 'bf16-autocast'?"),
        ("kv_cache", "paged", "choose one of: dynamic, static"),
        ("tf32", "yes", "must be true or false"),
        ("batch_size", 0, "must be 1 or more"),
    ],
)
def test_a_bad_value_names_the_allowed_ones(field, value, expected):
    with pytest.raises(ValueError, match=field) as err:
        Plan(**{field: value})
    assert expected in str(err.value)


def test_unknown_fields_are_refused_with_the_field_list(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("name: mine\nprecisoin: bf16-autocast\n")
    with pytest.raises(ValueError, match="unknown Plan field 'precisoin' \\(did you mean 'precision'\\?\\)"):
        load_plan(path)
    with pytest.raises(ValueError, match="did you mean 'ort_fusion'"):
        load_plan("onnxruntime", ["ort_fuson=on"])


def test_plan_file_takes_its_name_from_the_file_then_overrides(tmp_path):
    path = tmp_path / "best.yaml"
    path.write_text(PRESETS["compile-static"].with_changes(name="custom").to_yaml())
    plan = load_plan(path, ["batch_size=16", "threads=1"])
    assert plan.compile == "default" and plan.kv_cache == "static" and plan.batch_size == 16 and plan.threads == 1
    assert plan.name == "best+batch_size=16,threads=1"


def test_inline_overrides_name_a_variant():
    plan = load_plan("compile-static[batch_size=16;threads=1]")
    assert plan.name == "compile-static[batch_size=16;threads=1]"
    assert (plan.batch_size, plan.threads, plan.kv_cache) == (16, 1, "static")
    with pytest.raises(ValueError, match="must look like field=value"):
        apply_overrides(Plan(), ["batch_size"])
    with pytest.raises(ValueError, match="unknown plan 'compile-statc'. Did you mean compile-static"):
        load_plan("compile-statc")


def test_backend_options_set_by_name_merge_and_are_checked():
    plan = load_plan("onnxruntime-fused", ["ort_quant=int8-dynamic", "ort_reduce_range=off"])
    assert plan.option == {"ort_fusion": "on", "ort_quant": "int8-dynamic", "ort_reduce_range": "off"}
    assert Plan.from_yaml(plan.to_yaml()) == plan
    # an option of another backend says which backend it needs
    with pytest.raises(ValueError, match="option of backend=onnxruntime.*--set backend=onnxruntime"):
        load_plan("baseline", ["ort_fusion=on"])
    with pytest.raises(ValueError, match="ort_fusion='maybe' is not allowed; choose one of: on, off"):
        load_plan("onnxruntime", ["ort_fusion=maybe"])
    with pytest.raises(ValueError, match="llama_threads='0' must be a whole number of 1 or more"):
        load_plan("llamacpp", ["llama_threads=0"])
    # options that contradict each other are refused when the plan is made, not at load time
    with pytest.raises(ValueError, match="ort_quant_ops='attention'.*ort_fusion"):
        load_plan("onnxruntime", ["ort_quant=int8-dynamic", "ort_quant_ops=attention"])


def test_placement_across_devices_needs_the_torch_backend():
    with pytest.raises(ValueError, match="placement='cpu-offload' needs backend='torch'"):
        Plan(placement="cpu-offload", backend="onnxruntime")
    with pytest.raises(ValueError, match="max_memory"):
        Plan(placement="device-map", max_memory="cuda:0=lots")
