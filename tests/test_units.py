"""The unit parsers of the command line (accelab.units): what each accepts, and errors that name
the option, the value and the forms accepted."""

import pytest

from accelab.units import parse_duration_s, parse_objectives, parse_percent, parse_size_mib


@pytest.mark.parametrize(
    "text,mib",
    [
        ("2GiB", 2048),
        ("1500MiB", 1500),
        ("1GB", 1e9 / 2**20),
        ("512kib", 0.5),
        (" 1.5 gib ", 1536),
        ("2.GiB", 2048),
        (".5TiB", 2**19),
        ("1048576B", 1.0),
    ],
)
def test_sizes_are_mib(text, mib):
    assert parse_size_mib(text) == pytest.approx(mib)


def test_a_size_needs_a_unit():
    with pytest.raises(ValueError, match=r"--max-memory '2000' needs a unit: e.g. 2000MiB or 2000GiB"):
        parse_size_mib("2000")


@pytest.mark.parametrize("text", ["two GiB", "2 GiBs", "2XB", "", "-1GiB", "1.2.3GiB"])
def test_a_bad_size_names_the_value_and_the_units(text):
    with pytest.raises(
        ValueError,
        match=rf"--max-memory {text!r} must be a size like 2GiB or 1500MB "
        r"\(units: B, kB, KiB, MB, MiB, GB, GiB, TB, TiB\)",
    ):
        parse_size_mib(text)


def test_the_option_is_named_in_the_error():
    with pytest.raises(ValueError, match="--limit 'x'"):
        parse_size_mib("x", "--limit")


@pytest.mark.parametrize("text,seconds", [("90s", 90), ("10m", 600), ("1h", 3600), ("300", 300), ("1.5H", 5400)])
def test_budget_durations(text, seconds):
    assert parse_duration_s(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["5ms", "2d", "soon", "10 minutes", ""])
def test_a_duration_outside_the_options_units_is_refused(text):
    with pytest.raises(
        ValueError,
        match=rf"--budget {text!r} must be a duration like 30s, 10m, 2h "
        r"\(units: s, m, h; a bare number is s\)",
    ):
        parse_duration_s(text)


def test_ages_have_their_own_units_and_no_bare_number():
    ages = dict(units=("m", "h", "d", "w"), bare=None)
    assert parse_duration_s("7d", "--since", **ages) == 7 * 86400
    assert parse_duration_s("2W", "--since", **ages) == 14 * 86400
    with pytest.raises(ValueError, match=r"--since '7' must be a duration like 10m, 2h, 7d, 2w \(units: m, h, d, w\)$"):
        parse_duration_s("7", "--since", **ages)


def test_percentages():
    assert parse_percent("5%") == pytest.approx(0.05)
    assert parse_percent("12.5") == pytest.approx(0.125)
    assert parse_percent(" 0 % ") == 0.0
    with pytest.raises(ValueError, match="--threshold 'five' is not a percentage; give e.g. --threshold 5%"):
        parse_percent("five")
    with pytest.raises(ValueError, match="--memory-threshold '-3%' is out of range; give a percentage >= 0"):
        parse_percent("-3%", "--memory-threshold")


def test_objectives_are_seconds_by_key():
    keys = ("ttft", "tpot", "e2e")
    assert parse_objectives("ttft=500ms, E2E=2s,tpot=0.05", keys) == {"ttft": 0.5, "e2e": 2.0, "tpot": 0.05}
    assert parse_objectives("ttft=.25", keys) == {"ttft": 0.25}
    assert parse_objectives(None, keys) == {} and parse_objectives("", keys) == {}


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "latency=1s",
            r"--slo part 'latency=1s' must look like KEY=TIME with KEY one of ttft, tpot, e2e, "
            r"e.g. --slo ttft=500ms,e2e=2s",
        ),
        ("ttft", r"--slo part 'ttft' must look like KEY=TIME"),
        ("ttft=fast", r"--slo ttft='fast': give a time such as 500ms, 2s or 0.5 \(seconds\)"),
        ("e2e=1m", r"--slo e2e='1m': give a time such as 500ms, 2s or 0.5 \(seconds\)"),
    ],
)
def test_bad_objectives_name_the_part_and_the_forms(text, message):
    with pytest.raises(ValueError, match=message):
        parse_objectives(text, ("ttft", "tpot", "e2e"))
