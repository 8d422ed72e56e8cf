from __future__ import annotations

import pytest

from devmap_shims.planning import TopologyError, format_bytes, parse_gpus, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [
        ("23GiB", 23 * 2**30),
        ("23gib", 23 * 2**30),
        ("80GB", 80 * 10**9),
        ("1.5GiB", int(1.5 * 2**30)),
        ("512MiB", 512 * 2**20),
        ("1000", 1000),
        (" 2 TiB ", 2 * 2**40),
        ("1PiB", 2**50),  # the bound itself
        (7, 7),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "23 gigs", "-1GiB", "23G", "1e3GB", True, -5])
def test_parse_size_rejects(text):
    with pytest.raises(TopologyError):
        parse_size(text)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("8x23GiB", [23 * 2**30] * 8),
        ("2X80GB,1x40GB", [80 * 10**9] * 2 + [40 * 10**9]),
        ("24GiB", [24 * 2**30]),
        ("2*16GiB", [16 * 2**30] * 2),
    ],
)
def test_parse_gpus(text, expected):
    assert parse_gpus(text) == expected


@pytest.mark.parametrize("text", ["", "8x", "x23GiB", "0x23GiB", "8x0GiB", "8y23GiB", "8x23GiB,,", "99999x1GiB"])
def test_parse_gpus_rejects_with_a_readable_message(text):
    with pytest.raises(TopologyError) as info:
        parse_gpus(text)
    assert "\n" not in str(info.value)


def test_parse_gpus_bare_number_is_bytes():
    # "8x23" is 8 GPUs of 23 bytes: readable, just absurd; the plan will show it offloads
    assert parse_gpus("8x23") == [23] * 8


def test_format_bytes():
    assert format_bytes(2359296000) == "2.20 GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
